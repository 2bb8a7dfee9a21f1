/* y = x · ŵᵀ for int8 and int4 quantized weights ŵ (quantize.py), for x86-64 CPUs with AVX2 and FMA but no
 * AVX-512: the weights packed as vnni_linear.c packs them (vnni_linear.pack), read 32 bytes at a time, and the same
 * results up to float rounding, without VNNI's int32 byte dot products.
 *
 * Each call rounds every row of x (float32 or bf16) to signed int8 codes with its own scale (absmax / 127, rounded
 * to nearest even, as quant_kernels.quantize_rows does); for int8, a row that this rounds by more than
 * ROUNDING_BOUND takes a second row of codes for what the first missed, as in vnni_linear.c.
 *
 * Byte products without saturation: AVX2's byte multiply, VPMADDUBSW (u8 x s8), adds each pair of products in
 * int16 with saturation, which is what makes x86 int8 matmuls without VNNI wrong on the whole int8 range (255 · 127
 * · 2 > 32767). Here no pair can reach it:
 * int8: the unsigned operand is |x| (at most 127) and the signed one the weight with x's sign (VPSIGNB), so a pair
 * sums to at most 2 · 127 · 128 = 32512; VPMADDWD with ones then adds the pairs into int32.
 * int4: the unsigned operand is the weight code (0..15), x the signed one: a pair is at most 2 · 15 · 127 = 3810,
 * so up to 8 of them (four octets of K) add in int16 before VPMADDWD widens them.
 * A 32-byte load holds 8 columns x 4 K values (int8: one quad of a run; int4: one octet's low or high nibbles), so
 * a column's sum lands in one int32 lane. int4: a tile of up to 6 rows x 16 columns keeps its sums in 12 registers;
 * the block's runs of 16 columns go one after another, the first pass asking for the block's bytes ahead. int8: a
 * tile of up to 4 rows takes a whole block, read in its stored order; rows go in panels whose codes stay in L2.
 * AVX-VNNI (Intel's client cores from Alder Lake, AMD's from Zen 5; the VEX form of AVX512-VNNI's dot products):
 * VPDPBUSD adds each four u8 x s8 products into int32 itself, without int16 pair sums, so x goes in as its codes
 * + 128 (u8) times the weights as stored, and 128 times each column's sum of codes (vnni_linear.pack's sums) comes
 * off at the end, as in vnni_linear.c: one instruction a quad of K where AVX2 takes four, with no second broadcast,
 * which frees the registers for tiles of 6 rows (int8 only; int4's products are already cheap).
 * Built and loaded at run time by avx2_linear.py, which asks the CPU for AVX2 (and AVX-VNNI) first.
 */
#include <float.h>
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "npumoe_kernels.h"

#define TARGET __attribute__((target("avx2,fma")))
#if defined(__has_include) && __has_include(<avxvnniintrin.h>) /* GCC 11 and clang 12 on */
#define HAS_AVX_VNNI 1
#define TARGET_VNNI __attribute__((target("avx2,fma,avxvnni")))
#else
#define HAS_AVX_VNNI 0
#endif
#define INLINE __attribute__((always_inline))
#define TILE_ROWS 6
#define INT8_TILE_ROWS 4 /* its 8 sums, 2 weight registers and their operands fit AVX2's 16 registers; 6 rows spill */
#define VNNI_TILE_ROWS 6 /* its 12 sums, 2 weight registers and a broadcast fit them */
#define BLOCK 64
#define PANEL_BYTES 262144 /* int8: x codes a panel of rows keeps in L2 (Zen 3's is 512 KB) */

/* 8 activations from column i on as float32, zeros past k. */
static inline TARGET INLINE __m256 load_x(const void *row, int bf16, int64_t k, int64_t i) {
    if (i + 8 <= k) {
        if (bf16) {
            const __m128i half = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + i));
            return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
        }
        return _mm256_loadu_ps((const float *)row + i);
    }
    float tail[8] = {0};
    for (int64_t j = i; j < k; j++) {
        if (bf16) {
            const uint32_t bits = (uint32_t)((const uint16_t *)row)[j] << 16;
            memcpy(tail + (j - i), &bits, sizeof bits);
        } else {
            tail[j - i] = ((const float *)row)[j];
        }
    }
    return _mm256_loadu_ps(tail);
}

/* 8 results from column j on (the first `columns` of them), as float32 or bf16 rounded to nearest even. */
static inline TARGET INLINE void store_y(void *row, int bf16, int64_t j, __m256 v, int64_t columns) {
    const int64_t n = columns < 8 ? columns : 8;
    if (n <= 0) return;
    if (bf16) {
        __m256i bits = _mm256_castps_si256(v);
        const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
        bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
        const __m128i halves = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
        if (n == 8) {
            _mm_storeu_si128((__m128i *)((uint16_t *)row + j), halves);
        } else {
            uint16_t out[8];
            _mm_storeu_si128((__m128i *)out, halves);
            memcpy((uint16_t *)row + j, out, (size_t)n * sizeof *out);
        }
    } else if (n == 8) {
        _mm256_storeu_ps((float *)row + j, v);
    } else {
        float out[8];
        _mm256_storeu_ps(out, v);
        memcpy((float *)row + j, out, (size_t)n * sizeof *out);
    }
}

static inline TARGET INLINE float max_of(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline TARGET INLINE float sum_of(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline TARGET INLINE int32_t sum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

/* 8 int32 codes (each within ±127) as 8 bytes at q. */
static inline TARGET INLINE void store_codes(int8_t *q, __m256i codes) {
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(codes), _mm256_extracti128_si256(codes, 1));
    _mm_storel_epi64((__m128i *)q, _mm_packs_epi16(words, words));
}

/* One row of k activations as int8 codes into q (room for k rounded up to 8; the caller zeroes the padding).
 * Returns the row's scale. With `sums`, also each group of `group` (a multiple of 8) codes' sum; with `loss`, the
 * share of the row's squared L2 norm that rounding lost. */
static TARGET float quantize_row(const void *row, int bf16, int64_t k, int8_t *q, int64_t group, float *sums,
                                 float *loss) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 top = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 8) top = _mm256_max_ps(top, _mm256_and_ps(load_x(row, bf16, k, i), magnitude));
    float scale = max_of(top) / 127.0f;
    if (scale < FLT_MIN) scale = FLT_MIN; /* an all-zero row: zero codes */
    const __m256 step = _mm256_set1_ps(scale), inverse = _mm256_set1_ps(1.0f / scale);
    __m256 lost = _mm256_setzero_ps(), whole = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 8) {
        const __m256 v = load_x(row, bf16, k, i);
        const __m256i codes = _mm256_cvtps_epi32(_mm256_mul_ps(v, inverse)); /* nearest even */
        if (sums) sums[i / group] += (float)sum_epi32(codes);
        if (loss) {
            const __m256 missed = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(codes), step, v);
            lost = _mm256_fmadd_ps(missed, missed, lost);
            whole = _mm256_fmadd_ps(v, v, whole);
        }
        store_codes(q + i, codes);
    }
    if (loss) {
        const float norm = sum_of(whole);
        *loss = norm > 0.0f ? sum_of(lost) / norm : 0.0f; /* an all-zero row loses nothing */
    }
    return scale;
}

/* x's m rows rounded for the int8 kernel: in each row of q (stride ldq), `padded` bytes of codes (padding 0) and then
 * their magnitudes (with `offset`: the codes + 128, as u8), a row a little longer than the two so that a tile's rows
 * do not share L1 sets; a scale each in
 * xs; token r's rows are first_row[r] .. first_row[r + 1] - 1: one, or two where one loses more than
 * ROUNDING_BOUND, the second what the first missed (x − s·code, at most s/2) at s/254. */
struct codes {
    int8_t *q;
    float *xs;
    int64_t *first_row, rows, ldq;
};

static void free_codes(struct codes *codes) {
    free(codes->q);
    free(codes->xs);
    free(codes->first_row);
}

/* Fills `codes` (0), or returns -1 when memory ran out (nothing left to free). */
static TARGET int round_rows(const void *x, int64_t m, int64_t ldx, int bf16, int64_t k, int64_t padded, int offset,
                             struct codes *codes) {
    const int64_t most = 2 * m, size = bf16 ? 2 : 4, ldq = codes->ldq = 2 * padded + 64;
    codes->q = calloc((size_t)(most * ldq), 1); /* the padding stays 0: codes past k round zeros */
    codes->xs = malloc((size_t)most * sizeof *codes->xs);
    codes->first_row = malloc((size_t)(m + 1) * sizeof *codes->first_row);
    float *missed = malloc((size_t)((k + 7) / 8 * 8) * sizeof *missed);
    if (!codes->q || !codes->xs || !codes->first_row || !missed) {
        free(missed);
        free_codes(codes);
        return -1;
    }
    int64_t rows = 0;
    for (int64_t r = 0; r < m; r++) {
        const char *row = (const char *)x + r * ldx * size;
        int8_t *hi = codes->q + rows * ldq;
        float loss;
        const float scale = quantize_row(row, bf16, k, hi, 8, NULL, &loss);
        codes->first_row[r] = rows;
        codes->xs[rows++] = scale;
        if (loss > ROUNDING_BOUND * ROUNDING_BOUND) {
            for (int64_t i = 0; i < k; i += 8) {
                const __m256 coarse = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(hi + i))));
                _mm256_storeu_ps(missed + i, _mm256_fnmadd_ps(coarse, _mm256_set1_ps(scale), load_x(row, bf16, k, i)));
            }
            /* rounded at the fine scale s/254 itself: quantize_row's absmax of what was missed can be below s/2 */
            const __m256 inverse = _mm256_set1_ps(254.0f / scale);
            int8_t *lo = codes->q + rows * ldq;
            for (int64_t i = 0; i < k; i += 8)
                store_codes(lo + i, _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(missed + i), inverse)));
            codes->xs[rows++] = scale / 254.0f;
        }
    }
    codes->first_row[m] = codes->rows = rows;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < padded; i++) {
            const int code = codes->q[r * ldq + i];
            ((uint8_t *)codes->q)[r * ldq + padded + i] = (uint8_t)(offset ? code + 128 : abs(code));
        }
    free(missed);
    return 0;
}

/* Asks for the 64-byte lines [p, p + bytes) + AHEAD. */
static inline TARGET INLINE void fetch_ahead(const void *p, int bytes) {
    for (int line = 0; line < bytes; line += 64) _mm_prefetch((const char *)p + AHEAD + line, _MM_HINT_T0);
}

static inline TARGET INLINE __m256i broadcast4(const void *p) {
    int32_t four;
    memcpy(&four, p, sizeof four);
    return _mm256_set1_epi32(four);
}

/* One quad of K's products of a row's codes with 8 columns' weights w, added into their int32 sums: AVX2 multiplies
 * the row's magnitudes (xa) by the weights with the row's signs (xs), VPMADDUBSW's pair sums widened by VPMADDWD with
 * ones; AVX-VNNI the row's codes + 128 (xa) by the weights, in VPDPBUSD. */
#define PRODUCTS_AVX2(acc, q, xa, w) \
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(xa, _mm256_sign_epi8(w, broadcast4(q))), ones))
#define PRODUCTS_VNNI(acc, q, xa, w) _mm256_dpbusd_avx_epi32(acc, xa, w)

/* `rows` rows of codes (row stride ldq; their magnitudes at a) times one block's 64 columns (w: its first byte; inputs
 * in `chunks` chunks of 64) -> their int32 sums, 64 a row, into raw (row stride BLOCK). The block is read in the
 * order it is stored, a chunk (16 quads x 4 runs of 16 columns, 4 KB) at a time, each run's sums taken from raw and
 * put back around it: the weights stream in order (the hardware prefetchers follow), and a chunk's codes stay in L1
 * for its four runs. With `fetch`, the block's bytes are asked for ahead as they stream. */
#define TILE_INT8(name, target, PRODUCTS, HEIGHT)                                                                      \
static inline target INLINE void name(const int rows, const int8_t *q, const uint8_t *a, int64_t ldq,                  \
                                      const int8_t *w, int64_t chunks, int fetch, int32_t *raw) {                      \
    const __m256i ones = _mm256_set1_epi16(1);                                                                         \
    (void)ones, (void)q; /* what AVX-VNNI's products do not read */                                                   \
    for (int r = 0; r < rows; r++) memset(raw + r * BLOCK, 0, BLOCK * sizeof *raw);                                    \
    for (int64_t chunk = 0; chunk < chunks; chunk++) {                                                                 \
        const int8_t *wc = w + chunk * 16 * 4 * BLOCK;                                                                 \
        if (fetch) fetch_ahead(wc, 16 * 4 * BLOCK);                                                                    \
        for (int run = 0; run < 4; run++) {                                                                            \
            __m256i acc[HEIGHT][2];                                                                                    \
            for (int r = 0; r < rows; r++) {                                                                           \
                acc[r][0] = _mm256_loadu_si256((const __m256i *)(raw + r * BLOCK + 16 * run));                         \
                acc[r][1] = _mm256_loadu_si256((const __m256i *)(raw + r * BLOCK + 16 * run + 8));                     \
            }                                                                                                          \
            for (int quad = 0; quad < 16; quad++) {                                                                    \
                const int8_t *wq = wc + run * 1024 + quad * 64;                                                        \
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)wq);                                            \
                const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wq + 32));                                     \
                const int64_t at = 64 * chunk + 4 * quad;                                                              \
                _Pragma("GCC unroll 6")                                                                                \
                for (int r = 0; r < HEIGHT; r++) {                                                                     \
                    if (r < rows) {                                                                                    \
                        const __m256i xa = broadcast4(a + r * ldq + at);                                               \
                        acc[r][0] = PRODUCTS(acc[r][0], q + r * ldq + at, xa, w0);                                     \
                        acc[r][1] = PRODUCTS(acc[r][1], q + r * ldq + at, xa, w1);                                     \
                    }                                                                                                  \
                }                                                                                                      \
            }                                                                                                          \
            for (int r = 0; r < rows; r++) {                                                                           \
                _mm256_storeu_si256((__m256i *)(raw + r * BLOCK + 16 * run), acc[r][0]);                               \
                _mm256_storeu_si256((__m256i *)(raw + r * BLOCK + 16 * run + 8), acc[r][1]);                           \
            }                                                                                                          \
        }                                                                                                              \
    }                                                                                                                  \
}

/* A tile of 1 to HEIGHT rows through `tile`, its row count a constant in each call so its loops unroll (a count past
 * HEIGHT never comes: those cases are HEIGHT's). */
#define ROWS_CASE(tile, n, HEIGHT) \
    case n: tile((n) < (HEIGHT) ? (n) : (HEIGHT), q, a, ldq, w, chunks, fetch, raw); break;
#define TILES_INT8(name, target, tile, HEIGHT)                                                                         \
static target void name(int rows, const int8_t *q, const uint8_t *a, int64_t ldq, const int8_t *w, int64_t chunks,    \
                        int fetch, int32_t *raw) {                                                                     \
    switch (rows) {                                                                                                    \
    ROWS_CASE(tile, 1, HEIGHT) ROWS_CASE(tile, 2, HEIGHT) ROWS_CASE(tile, 3, HEIGHT) ROWS_CASE(tile, 4, HEIGHT)        \
    ROWS_CASE(tile, 5, HEIGHT)                                                                                         \
    default: tile(HEIGHT, q, a, ldq, w, chunks, fetch, raw); break;                                                    \
    }                                                                                                                  \
}

/* How an int8 product runs: its tiles, their height, and whether x goes in as codes + 128 (see round_rows). */
struct int8_way {
    void (*tiles)(int rows, const int8_t *q, const uint8_t *a, int64_t ldq, const int8_t *w, int64_t chunks, int fetch,
                  int32_t *raw);
    int height, offset;
};

TILE_INT8(tile_int8, TARGET, PRODUCTS_AVX2, INT8_TILE_ROWS)
TILES_INT8(tiles_int8, TARGET, tile_int8, INT8_TILE_ROWS)
static const struct int8_way AVX2_WAY = {tiles_int8, INT8_TILE_ROWS, 0};
#if HAS_AVX_VNNI
TILE_INT8(tile_int8_vnni, TARGET_VNNI, PRODUCTS_VNNI, VNNI_TILE_ROWS)
TILES_INT8(tiles_int8_vnni, TARGET_VNNI, tile_int8_vnni, VNNI_TILE_ROWS)
static const struct int8_way VNNI_WAY = {tiles_int8_vnni, VNNI_TILE_ROWS, 1};
#endif

/* int8 x · ŵᵀ (as `linear` says) with y in float32, or bf16 when ybf16, whatever x's dtype, the `way` it says. */
static TARGET int linear_int8(const void *x, int64_t m, int64_t ldx, int bf16, const int8_t *w, const int32_t *sums,
                              const float *scale, int64_t n, int64_t k, void *y, int64_t ldy, int ybf16,
                              const struct int8_way *way) {
    const int64_t padded = (k + 63) / 64 * 64, ysize = ybf16 ? 2 : 4;
    struct codes codes;
    if (round_rows(x, m, ldx, bf16, k, padded, way->offset, &codes)) return -1;
    /* tokens a panel takes: its codes stay in L2 while every block of weights streams past them */
    const int64_t panel = codes.ldq < PANEL_BYTES ? PANEL_BYTES / codes.ldq : 1;
    const int64_t most = codes.rows < 2 * panel ? codes.rows : 2 * panel; /* two a token at most */
    int32_t *raw = malloc((size_t)(most * BLOCK) * sizeof *raw); /* a panel's rows of codes' sums over a block */
    if (!raw) {
        free_codes(&codes);
        return -1;
    }
    for (int64_t t0 = 0; t0 < m; t0 += panel) {
        const int64_t t1 = t0 + panel < m ? t0 + panel : m, first = codes.first_row[t0];
        const int64_t panel_rows = codes.first_row[t1] - first;
        const int64_t tiles = (panel_rows + way->height - 1) / way->height;
        for (int64_t block = 0; block * BLOCK < n; block++) {
            const int8_t *wb = w + block * BLOCK * padded;
            const int64_t columns = n - block * BLOCK < BLOCK ? n - block * BLOCK : BLOCK; /* this block's alone */
            for (int64_t t = 0, r0 = 0; t < tiles; t++) {
                const int64_t rows = (panel_rows - r0 + (tiles - t) - 1) / (tiles - t); /* tiles differ by a row at most */
                const int8_t *qt = codes.q + (first + r0) * codes.ldq;
                const uint8_t *at = (const uint8_t *)qt + padded;
                int32_t *rt = raw + r0 * BLOCK;
                way->tiles((int)rows, qt, at, codes.ldq, wb, padded / 64, t == 0, rt);
                r0 += rows;
            }
            const float *cb = scale + block * BLOCK;
            for (int64_t r = t0; r < t1; r++) { /* Σ over the token's levels of sums · x scale, times the column's scale */
                for (int c = 0; 8 * c < columns; c++) {
                    __m256 v = _mm256_setzero_ps();
                    const __m256i shift = way->offset /* 128 · the columns' sums of codes */
                        ? _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(sums + block * BLOCK + 8 * c)), 7)
                        : _mm256_setzero_si256();
                    for (int64_t level = codes.first_row[r]; level < codes.first_row[r + 1]; level++) {
                        const __m256i dot = _mm256_sub_epi32(
                            _mm256_loadu_si256((const __m256i *)(raw + (level - first) * BLOCK + 8 * c)), shift);
                        v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(codes.xs[level]), v);
                    }
                    store_y((char *)y + (r * ldy + block * BLOCK) * ysize, ybf16, 8 * c,
                            _mm256_mul_ps(v, _mm256_loadu_ps(cb + 8 * c)), columns - 8 * c);
                }
            }
        }
    }
    free(raw);
    free_codes(&codes);
    return 0;
}

/* The int8 way of `vnni` (AVX-VNNI's, else AVX2's); NULL where this build has no AVX-VNNI. */
static const struct int8_way *int8_way(int vnni) {
#if HAS_AVX_VNNI
    if (vnni) return &VNNI_WAY;
#else
    if (vnni) return NULL;
#endif
    return &AVX2_WAY;
}

/* Whether this build has the AVX-VNNI int8 tiles (the compiler knew the instructions). */
int npumoe_avx2_has_vnni(void) { return HAS_AVX_VNNI; }

static inline TARGET INLINE __m256 bf16_to_ps(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* Rows of the int4 kernel over 16 columns: s8 codes q (row stride ldq), scales xs, group sums gs (row stride groups);
 * w the block's (k/8, 64, 4) nibble pairs (`block`) from the 16 columns' first byte; s, z their (groups, 64) bf16
 * scales and zeros from the same column. With `fetch`, the block's bytes are asked for in order as it streams. */
static inline TARGET INLINE void tile_int4(const int rows, const int8_t *q, int64_t ldq, const float *xs,
                                           const float *gs, const uint8_t *w, const uint8_t *block, int64_t groups,
                                           int64_t octets,
                                           const uint16_t *s, const uint16_t *z, void *y, int64_t ldy, int bf16,
                                           int64_t columns, int fetch) {
    __m256 total[TILE_ROWS][2];
    for (int r = 0; r < TILE_ROWS; r++) total[r][0] = total[r][1] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int64_t g = 0; g < groups; g++) {
        const __m256 gscale[2] = {bf16_to_ps(s + g * BLOCK), bf16_to_ps(s + g * BLOCK + 8)};
        for (int64_t o0 = g * octets; o0 < (g + 1) * octets; o0 += 4) { /* 4 octets: 8 pair sums, within int16 */
            __m256i acc[TILE_ROWS][2];
            for (int r = 0; r < TILE_ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
            for (int64_t o = o0; o < o0 + 4 && o < (g + 1) * octets; o++) {
                const uint8_t *wo = w + o * 4 * BLOCK;
                if (fetch) fetch_ahead(block + o * 4 * BLOCK, 4 * BLOCK); /* the whole block's bytes, in order */
                const __m256i b0 = _mm256_loadu_si256((const __m256i *)wo), b1 = _mm256_loadu_si256((const __m256i *)(wo + 32));
                const __m256i lo0 = _mm256_and_si256(b0, low), lo1 = _mm256_and_si256(b1, low);
                const __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(b0, 4), low);
                const __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(b1, 4), low);
#pragma GCC unroll 6
                for (int r = 0; r < TILE_ROWS; r++) {
                    if (r < rows) {
                        const __m256i xl = broadcast4(q + r * ldq + 8 * o), xh = broadcast4(q + r * ldq + 8 * o + 4);
                        acc[r][0] = _mm256_add_epi16(acc[r][0], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, xl),
                                                                                 _mm256_maddubs_epi16(hi0, xh)));
                        acc[r][1] = _mm256_add_epi16(acc[r][1], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, xl),
                                                                                 _mm256_maddubs_epi16(hi1, xh)));
                    }
                }
            }
            for (int r = 0; r < rows; r++)
                for (int c = 0; c < 2; c++)
                    total[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(acc[r][c], ones)), gscale[c],
                                                  total[r][c]);
        }
        for (int c = 0; c < 2; c++) { /* w = (q − 8)·s + z: the zero's share is (z − 8s)·Σx */
            const __m256 gzero = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), gscale[c], bf16_to_ps(z + g * BLOCK + 8 * c));
            for (int r = 0; r < rows; r++)
                total[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(gs[r * groups + g]), gzero, total[r][c]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 2; c++)
            store_y((char *)y + r * ldy, bf16, 8 * c, _mm256_mul_ps(total[r][c], _mm256_set1_ps(xs[r])),
                    columns - 8 * c);
}

/* int4 x · ŵᵀ (as `linear` says) with y in float32, or bf16 when ybf16, whatever x's dtype. */
static TARGET int linear_int4(const void *x, int64_t m, int64_t ldx, int bf16, const uint8_t *w, const uint16_t *s,
                              const uint16_t *z, int64_t group, int64_t n, int64_t k, void *y, int64_t ldy, int ybf16) {
    const int64_t groups = k / group, size = bf16 ? 2 : 4, ysize = ybf16 ? 2 : 4;
    struct int4_scratch scratch;
    if (alloc_int4_scratch(&scratch, m, k, groups)) return -1;
    int8_t *q = scratch.q;
    float *xs = scratch.xs, *gs = scratch.gs;
    for (int64_t r = 0; r < m; r++)
        xs[r] = quantize_row((const char *)x + r * ldx * size, bf16, k, q + r * k, group, gs + r * groups, NULL);
    const int64_t tiles = (m + TILE_ROWS - 1) / TILE_ROWS, octets = group / 8;
    for (int64_t block = 0; block * BLOCK < n; block++) {
        const uint8_t *wb = w + block * BLOCK * k / 2;
        for (int run = 0; run < 4; run++) {
            const uint16_t *sb = s + block * groups * BLOCK + 16 * run, *zb = z + block * groups * BLOCK + 16 * run;
            const int64_t columns = n - block * BLOCK - 16 * run;
            if (columns <= 0) break;
            for (int64_t t = 0, r0 = 0; t < tiles; t++) {
                const int64_t rows = (m - r0 + (tiles - t) - 1) / (tiles - t);
                const int8_t *qt = q + r0 * k;
                const float *gt = gs + r0 * groups;
                const uint8_t *wr = wb + 64 * run;
                void *yt = (char *)y + (r0 * ldy + block * BLOCK + 16 * run) * ysize;
                const int64_t ystride = ldy * ysize;
                const int fetch = run == 0 && t == 0;
                switch (rows) {
                case 1: tile_int4(1, qt, k, xs + r0, gt, wr, wb, groups, octets, sb, zb, yt, ystride, ybf16, columns, fetch); break;
                case 2: tile_int4(2, qt, k, xs + r0, gt, wr, wb, groups, octets, sb, zb, yt, ystride, ybf16, columns, fetch); break;
                case 3: tile_int4(3, qt, k, xs + r0, gt, wr, wb, groups, octets, sb, zb, yt, ystride, ybf16, columns, fetch); break;
                case 4: tile_int4(4, qt, k, xs + r0, gt, wr, wb, groups, octets, sb, zb, yt, ystride, ybf16, columns, fetch); break;
                case 5: tile_int4(5, qt, k, xs + r0, gt, wr, wb, groups, octets, sb, zb, yt, ystride, ybf16, columns, fetch); break;
                default: tile_int4(6, qt, k, xs + r0, gt, wr, wb, groups, octets, sb, zb, yt, ystride, ybf16, columns, fetch); break;
                }
                r0 += rows;
            }
        }
    }
    free_int4_scratch(&scratch);
    return 0;
}

static inline TARGET __m256 round_ps(__m256 t) {
    return _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* p · 2^n for whole n in float32's exponent range, 2^n put in the exponent's bits (AVX2 has no scalef). */
static inline TARGET __m256 times_2_to(__m256 p, __m256 n) {
    const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(power));
}

DEFINE_EXP_PS(TARGET, __m256, _mm256, round_ps, times_2_to)

/* silu(gate) · up in float32, 8 values at a time, where npumoe_kernels.h's NPUMOE_EXPORTS says. */
static TARGET void silu_glu_rows(float *h, int64_t m, int64_t ldh, int64_t inter) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t r = 0; r < m; r++) {
        float *row = h + r * ldh;
        for (int64_t j = 0; j < inter; j += 8) {
            const __m256 gate = load_x(row, 0, inter, j), up = load_x(row + inter, 0, inter, j);
            const __m256 decay = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), gate));
            store_y(row, 0, j, _mm256_mul_ps(_mm256_div_ps(gate, _mm256_add_ps(one, decay)), up), inter - j);
        }
    }
}

/* The weights as vnni_linear.c's `linear` takes them (vnni_linear.pack), int8 on AVX-VNNI's dot products with `vnni`;
 * -2 when this build has no AVX-VNNI. */
static int linear(const void *x, int64_t m, int64_t ldx, int bf16, int int4, int vnni, const struct npumoe_weight *w,
                  void *y, int64_t ldy, int ybf16) {
    if (int4) return linear_int4(x, m, ldx, bf16, w->codes, w->scale, w->zero, w->group, w->n, w->k, y, ldy, ybf16);
    const struct int8_way *way = int8_way(vnni);
    return way ? linear_int8(x, m, ldx, bf16, w->codes, w->sums, w->scale, w->n, w->k, y, ldy, ybf16, way) : -2;
}

NPUMOE_EXPORTS(npumoe_avx2)
