/* The combine of an MoE layer's expert outputs: each token's weighted sum of its k assignments' output rows,
 *     y[t] = Σ_j w[t·k + j] · out[at[t·k + j]],
 * read straight from the (S, H) rows the experts wrote in sorted order (no gathered copy), summed in float32 and
 * rounded once to the outputs' dtype (bf16 to nearest even, as torch rounds), for tokens [first, last).
 * Plain C that the compiler vectorises: no CPU feature is assumed, so it builds wherever a C compiler does. With
 * glibc on x86-64 it is also built for AVX2 and AVX-512, and the loader runs the widest the CPU has (512 tokens of
 * Qwen3-30B-A3B on one thread: 4.3 -> 2.9 ms in bf16, 5.6 -> 4.3 ms in float32, the same sums).
 * Built and loaded at run time by combine_kernel.py. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float from_bf16(uint16_t b) {
    const uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint16_t rounded = (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
    return (bits & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)0x7FC0 : rounded;  /* NaN stays NaN */
}

/* out: (S, h) rows, bf16 when `bf16` else float32, row stride h; at: (T·k,) each assignment's row of out; w: (T·k,)
 * float32 weights; y: (T, h) in out's dtype. Returns 0, or -1 when scratch memory ran out. */
#if defined(__x86_64__) && defined(__GLIBC__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
int npumoe_combine(const void *out, int64_t h, int bf16, const int64_t *at, const float *w, int64_t k,
                   int64_t first, int64_t last, void *y) {
    float *sum = malloc((size_t)h * sizeof *sum);
    if (!sum) return -1;
    for (int64_t t = first; t < last; t++) {
        memset(sum, 0, (size_t)h * sizeof *sum);
        for (int64_t j = t * k; j < (t + 1) * k; j++) {
            const float weight = w[j];
            if (bf16) {
                const uint16_t *row = (const uint16_t *)out + at[j] * h;
                for (int64_t i = 0; i < h; i++) sum[i] += weight * from_bf16(row[i]);
            } else {
                const float *row = (const float *)out + at[j] * h;
                for (int64_t i = 0; i < h; i++) sum[i] += weight * row[i];
            }
        }
        if (bf16) {
            uint16_t *yt = (uint16_t *)y + t * h;
            for (int64_t i = 0; i < h; i++) yt[i] = to_bf16(sum[i]);
        } else {
            memcpy((float *)y + t * h, sum, (size_t)h * sizeof *sum);
        }
    }
    free(sum);
    return 0;
}
