/* RMSNorm of rows of float32 or bfloat16 in one pass over memory, for x86-64 CPUs with AVX-512.
 *
 * Each row is read once from memory: its sum of squares in float32, r = 1 / sqrt(sum / n + eps) (the division
 * and square root correctly rounded, as torch's mean and rsqrt are), then y = x·r scaled by the weight, while the
 * row is still in cache (rows go in blocks of up to 16 KB). transformers' RMSNorm modules round at two different
 * points, and each is kept:
 *   CAST_FIRST:   y = round(round(x·r) · w)  the normalised row rounded to the input dtype before the weight
 *                                            (Llama, Qwen3-MoE, Mixtral, OLMoE...); bf16 · bf16 is exact in float32,
 *                                            so one rounding of the float32 product is torch's bf16 multiply
 *   WEIGHT_FIRST: y = round(x·r · w)         the weight applied in float32, one rounding at the end (gpt-oss);
 *                                            Gemma-style (1 + w) is this with w already 1 + w
 * The weight always comes as float32 (a bf16 weight widened, which is exact). Rounding to bf16 is to nearest
 * even, by AVX512-BF16's conversion where the CPU has it, else on the integer bits (AVX-512F/BW); NaNs stay NaNs.
 * Only the order of the sum of squares differs from torch's. Built and loaded by norm_kernel.py.
 */
#include <immintrin.h>
#include <stdint.h>

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define CAST_FIRST 0
#define WEIGHT_FIRST 1

static inline AVX512 __mmask16 tail(int64_t left) { return left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1); }

static inline AVX512 __m512 load_bf16(const uint16_t *p, __mmask16 m) {  /* masked-off lanes read as 0 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

/* float32 -> bf16 bits, to nearest even; a NaN keeps its sign and top bits and is made quiet */
static inline AVX512 __m256i round_bf16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(rounded);
}

/* a bf16-rounded value back as float32 */
static inline AVX512 __m512 widen_bf16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Rows per block: a block's rows are summed, their inverse RMS found at once in one vector (no scalar chain per
 * row), then scaled while they are still in L1. */
static inline int64_t rows_per_block(int64_t row_bytes) {
    const int64_t rows = (16 * 1024) / (row_bytes > 0 ? row_bytes : 1);
    return rows < 1 ? 1 : rows > 16 ? 16 : rows;
}

#define LOAD_F32(p, m) _mm512_maskz_loadu_ps(m, p)
#define STORE_F32(p, m, v) _mm512_mask_storeu_ps(p, m, v)
#define SAME_F32(v) (v)
#define STORE_BF16(p, m, v) _mm256_mask_storeu_epi16(p, m, round_bf16(v))
#define CAST_BF16(v) widen_bf16(round_bf16(v))
#define STORE_BF16_NATIVE(p, m, v) _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v))
#define CAST_BF16_NATIVE(v) widen_bf16((__m256i)_mm512_cvtneps_pbh(v))

/* x: rows of n elements, row stride ldx; w: n floats; y: rows of n elements, row stride ldy */
#define RMS_NORM(name, target, type, load, store, cast)                                                             \
target void name(const type *x, int64_t rows, int64_t ldx, int64_t n, const float *w, float eps, int32_t mode,      \
                 type *y, int64_t ldy) {                                                                            \
    const int64_t block = rows_per_block(n * (int64_t)sizeof(type));                                                \
    for (int64_t r0 = 0; r0 < rows; r0 += block) {                                                                  \
        const int64_t count = rows - r0 < block ? rows - r0 : block;                                                \
        float sums[16] = {0}, inverse[16];                                                                          \
        for (int64_t i = 0; i < count; i++) {                                                                       \
            const type *xr = x + (r0 + i) * ldx;                                                                    \
            __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();                                          \
            int64_t j = 0;                                                                                          \
            for (; j + 32 <= n; j += 32) {                                                                          \
                const __m512 a = load(xr + j, 0xffff), b = load(xr + j + 16, 0xffff);                              \
                acc0 = _mm512_fmadd_ps(a, a, acc0);                                                                 \
                acc1 = _mm512_fmadd_ps(b, b, acc1);                                                                 \
            }                                                                                                       \
            for (; j < n; j += 16) {                                                                                \
                const __m512 a = load(xr + j, tail(n - j));                                                         \
                acc0 = _mm512_fmadd_ps(a, a, acc0);                                                                 \
            }                                                                                                       \
            sums[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));                                              \
        }                                                                                                           \
        /* torch's mean is the sum divided by n, its rsqrt 1 / sqrt: both correctly rounded, as here */            \
        const __m512 variance = _mm512_div_ps(_mm512_loadu_ps(sums), _mm512_set1_ps((float)n));                     \
        _mm512_storeu_ps(inverse, _mm512_div_ps(_mm512_set1_ps(1.0f),                                               \
                                                _mm512_sqrt_ps(_mm512_add_ps(variance, _mm512_set1_ps(eps)))));    \
        for (int64_t i = 0; i < count; i++) {                                                                       \
            const type *xr = x + (r0 + i) * ldx;                                                                    \
            type *yr = y + (r0 + i) * ldy;                                                                          \
            const __m512 r = _mm512_set1_ps(inverse[i]);                                                            \
            for (int64_t j = 0; j < n; j += 16) {                                                                   \
                const __mmask16 m = tail(n - j);                                                                    \
                __m512 h = _mm512_mul_ps(load(xr + j, m), r);                                                       \
                if (mode == CAST_FIRST) h = cast(h);                                                                \
                store(yr + j, m, _mm512_mul_ps(h, _mm512_maskz_loadu_ps(m, w + j)));                                \
            }                                                                                                       \
        }                                                                                                           \
    }                                                                                                               \
}

/* in float32 both roundings are float32's own: the two conventions compute alike */
RMS_NORM(npumoe_rms_norm_f32, AVX512, float, LOAD_F32, STORE_F32, SAME_F32)
/* bf16 as uint16_t bits, rounded on the integer bits (any AVX-512 CPU) or by AVX512-BF16's conversion */
RMS_NORM(npumoe_rms_norm_bf16, AVX512, uint16_t, load_bf16, STORE_BF16, CAST_BF16)
RMS_NORM(npumoe_rms_norm_bf16_native, AVX512_BF16, uint16_t, load_bf16, STORE_BF16_NATIVE, CAST_BF16_NATIVE)
