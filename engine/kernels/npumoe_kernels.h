/* What the engine's int8/int4 kernels (vnni_linear.c, avx2_linear.c, neon_linear.c) share: the packed weight the
 * Python side hands them (int_linear.py's NativeWeight mirrors it), the two functions each exports, built around
 * its own `linear`, the rounding bound past which a row takes a second level of codes, how far ahead the x86 kernels
 * fetch weights, their int4 scratch and their e^x for silu.
 * native.py compiles every kernel with this folder on the include path and hashes this header into the build's name.
 */
#ifndef NPUMOE_KERNELS_H
#define NPUMOE_KERNELS_H

#include <stdint.h>
#include <stdlib.h>

/* A packed weight: int8 codes, each column's sum of codes (the x86 layouts only) and scale; int4 codes, scale, zero
 * and group. Each kernel's source says how its layout orders the codes. */
struct npumoe_weight {
    const void *codes, *sums, *scale, *zero;
    int64_t group, n, k;
};

/* An expert's rows lose at most about this share of themselves to rounding (relative L2): 3 %, above what a
 * Gaussian row of thousands of values loses (0.9 %) or a gated expert's heavier-tailed intermediate row, so only rows
 * with outliers pay for a second level of codes. */
#define ROUNDING_BOUND 0.03f

/* Weights stream from memory once per call: the x86 kernels ask for the bytes this far ahead of the ones they are
 * multiplying, so that DRAM's latency overlaps the arithmetic (16 KiB measured best of 8-64 KiB on AMX). */
#define AHEAD 16384

/* The x86 int4 kernels' scratch for x's m rows rounded to k codes each: the codes (int8, or in vnni_linear.c uint8), a
 * scale a row, and each row's sums of codes per group of K values (zeroed). */
struct int4_scratch {
    void *q;
    float *xs, *gs;
};

static inline void free_int4_scratch(struct int4_scratch *s) {
    free(s->q);
    free(s->xs);
    free(s->gs);
}

/* 0, or -1 when memory ran out (nothing left to free). */
static inline int alloc_int4_scratch(struct int4_scratch *s, int64_t m, int64_t k, int64_t groups) {
    s->q = malloc((size_t)(m * k));
    s->xs = malloc((size_t)m * sizeof *s->xs);
    s->gs = calloc((size_t)(m * groups), sizeof *s->gs);
    if (s->q && s->xs && s->gs) return 0;
    free_int4_scratch(s);
    return -1;
}

/* Defines `exp_ps`, e^x for |x| up to 88 (clamped beyond), to about 1e-6 relative: 2^n · 2^f with
 * n = round(x·log2 e), |f| <= 1/2, and 2^f by its Taylor series to the f^6 term; for the vector type V whose
 * intrinsics' names begin with P (_mm512, _mm256), `round` rounding to the nearest integer and `times_2_to(p, n)`
 * giving p · 2^n. */
#define DEFINE_EXP_PS(target, V, P, round, times_2_to)                                                                 \
    static inline target V exp_ps(V x) {                                                                               \
        static const float terms[] = {1.5403530e-4f, 1.3333558e-3f, 9.6181291e-3f, 5.5504109e-2f, 2.4022651e-1f,      \
                                      6.9314718e-1f, 1.0f};                                                            \
        x = P##_max_ps(P##_min_ps(x, P##_set1_ps(88.0f)), P##_set1_ps(-88.0f));                                       \
        const V t = P##_mul_ps(x, P##_set1_ps(1.44269504f));                                                          \
        const V n = round(t);                                                                                          \
        const V f = P##_sub_ps(t, n);                                                                                  \
        V p = P##_set1_ps(terms[0]);                                                                                   \
        for (int i = 1; i < 7; i++) p = P##_fmadd_ps(p, f, P##_set1_ps(terms[i]));                                    \
        return times_2_to(p, n);                                                                                       \
    }

/* The two functions every int8/int4 kernel exports as `<prefix>_linear` and `<prefix>_silu_glu_expert` (the ctypes
 * contract of int_linear.py), from its own
 *     int linear(const void *x, int64_t m, int64_t ldx, int bf16, int int4, int variant,
 *                const struct npumoe_weight *w, void *y, int64_t ldy, int ybf16)
 * (x: (m, k) float32 or bf16 rows, bf16 when `bf16`, row stride ldx; w int4 when `int4`, else int8; `variant` the
 * kernel's faster instructions where the CPU has them (AMX, AVX-VNNI, SMMLA); y: (m, n) float32, or bf16 when ybf16,
 * row stride ldy) and its `silu_glu_rows(float *h, int64_t m, int64_t ldh, int64_t inter)`, which turns each of m
 * rows of h (row stride ldh) into silu(gate) · up in its first `inter` values, gate the first `inter` and up the next.
 * `<prefix>_linear` gives y in x's dtype. `<prefix>_silu_glu_expert` runs one expert's gated FFN in one call,
 * y = (silu(x·Gᵀ) · x·Uᵀ) · Dᵀ with up = [G; U] packed (2I, K) and down packed (N, I), the intermediate float32 (each
 * matmul rounds its rows to int8 itself). Both return 0, -1 when scratch memory ran out, or the kernel's own code. */
#define NPUMOE_EXPORTS(prefix)                                                                                         \
    int prefix##_linear(const void *x, int64_t m, int64_t ldx, int bf16, int int4, int variant,                        \
                        const struct npumoe_weight *w, void *y, int64_t ldy) {                                         \
        return linear(x, m, ldx, bf16, int4, variant, w, y, ldy, bf16);                                                \
    }                                                                                                                  \
    int prefix##_silu_glu_expert(const void *x, int64_t m, int64_t ldx, int bf16, int int4, int variant,               \
                                 const struct npumoe_weight *up, const struct npumoe_weight *down, void *y,            \
                                 int64_t ldy) {                                                                        \
        const int64_t inter = down->k, width = up->n;                                                                  \
        float *h = malloc((size_t)(m * width) * sizeof *h);                                                            \
        if (!h) return -1;                                                                                             \
        int failed = linear(x, m, ldx, bf16, int4, variant, up, h, width, 0);                                         \
        if (!failed) {                                                                                                 \
            silu_glu_rows(h, m, width, inter);                                                                         \
            failed = linear(h, m, width, 0, int4, variant, down, y, ldy, bf16);                                        \
        }                                                                                                              \
        free(h);                                                                                                       \
        return failed;                                                                                                 \
    }

#endif
