/* y = x · ŵᵀ for int8 and int4 quantized weights ŵ (quantize.py), for x86-64 CPUs with AVX512-VNNI.
 *
 * Each call rounds every row of x (float32 or bf16) to int8 with its own scale (absmax / 127, rounded to
 * nearest even, as quant_kernels.quantize_rows does; for int8, a row that this rounds by more than ROUNDING_BOUND, as
 * outlier features make it, takes a second row of codes for what the first missed), then multiplies bytes with VPDPBUSD (u8 x s8 -> s32,
 * four products a lane) and scales the int32 sums at the end. Weights are packed in blocks of 64 output columns,
 * each one in-order stream along K with four K values of a column side by side (VPDPBUSD's operand layout); a
 * tile of up to 6 rows x 64 columns keeps its sums in registers, and row tiles are balanced (8 rows run as 4 + 4).
 *
 * int8: the unsigned operand is x + 128; the offset comes back out through each column's weight sum.
 * int4: the unsigned operand is the weight code (0..15), two codes a byte: the low nibbles of a 64-column
 * block's 256 bytes are K values 8j..8j+3, the high nibbles 8j+4..8j+7. Each group of K values has a scale s
 * and zero z per column (w = (q - 8)·s + z), so a group's sum is s·Σq·x + (z - 8s)·Σx, with Σx, the group's
 * sum of x codes, found while rounding x.
 * int8's block is cut along K into chunks of 64 values, and a chunk into four 1 KiB runs of 16 columns (16 rows of
 * 4 K values x 16 columns each): the operand of an AMX-INT8 TDPBUSD, so that int8 also runs on AMX tiles where the
 * CPU has them, 16 rows x 64 K at a time, rows padded to 16. The AMX kernel lays the rows' codes out as tiles too
 * (16 rows x 64 codes, 1 KiB): a tile load from contiguous bytes ran about three times as fast from L2 on a Sapphire
 * Rapids core as one whose 16 rows lie 256 bytes or more apart.
 * Built and loaded at run time by vnni_linear.py, which asks the CPU for AVX512-VNNI first.
 */
#define _GNU_SOURCE  /* syscall() */
#include <float.h>
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "npumoe_kernels.h"

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")))
#define TILE_ROWS 6
#define BLOCK 64
#define INLINE __attribute__((always_inline))  /* each row count its own fully unrolled copy */

static inline __mmask16 first(int64_t lanes) {
    return lanes >= 16 ? 0xFFFF : lanes <= 0 ? 0 : (__mmask16)((1u << lanes) - 1);
}

/* 16 activations from column k on as float32 (lanes outside `mask` are 0). */
static inline TARGET __m512 load_x(const void *row, int bf16, int64_t k, __mmask16 mask) {
    if (bf16) {
        __m256i half = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)row + k);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
    }
    return _mm512_maskz_loadu_ps(mask, (const float *)row + k);
}

/* 16 results from column j on, as float32 or rounded to nearest even bf16 (AVX512-BF16 not needed). */
static inline TARGET void store_y(void *row, int bf16, int64_t j, __m512 v, __mmask16 mask) {
    if (bf16) {
        __m512i bits = _mm512_castps_si512(v);
        __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
        bits = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
        _mm512_mask_cvtepi32_storeu_epi16((uint16_t *)row + j, mask, _mm512_srli_epi32(bits, 16));
    } else {
        _mm512_mask_storeu_ps((float *)row + j, mask, v);
    }
}

/* One row of k activations as int8 codes plus `offset` into q (padded with `offset` up to `padded`);
 * returns the row's scale. With `sums`, also each group of `group` (a multiple of 16) codes' sum; with `loss`, the
 * share of the row's squared L2 norm that rounding lost. */
static TARGET float quantize_row(const void *row, int bf16, int64_t k, int64_t padded, int32_t offset, uint8_t *q,
                                 int64_t group, float *sums, float *loss) {
    __m512 top = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) top = _mm512_max_ps(top, _mm512_abs_ps(load_x(row, bf16, i, first(k - i))));
    float scale = _mm512_reduce_max_ps(top) / 127.0f;
    if (scale < FLT_MIN) scale = FLT_MIN;  /* an all-zero row: zero codes */
    /* times the reciprocal rather than divided by the scale: the divisions took about 0.25 µs of each 2,048-wide row */
    const __m512 step = _mm512_set1_ps(scale), inverse = _mm512_set1_ps(1.0f / scale);
    const __m512i shift = _mm512_set1_epi32(offset);
    __m512 lost = _mm512_setzero_ps(), whole = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) {
        const __mmask16 mask = first(k - i);
        const __m512 v = load_x(row, bf16, i, mask);
        __m512i codes = _mm512_cvtps_epi32(_mm512_mul_ps(v, inverse));
        if (sums) sums[i / group] += (float)_mm512_reduce_add_epi32(codes);
        if (loss) {
            const __m512 missed = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(codes), step, v);
            lost = _mm512_fmadd_ps(missed, missed, lost);
            whole = _mm512_fmadd_ps(v, v, whole);
        }
        _mm512_mask_cvtepi32_storeu_epi8(q + i, mask, _mm512_add_epi32(codes, shift));
    }
    memset(q + k, offset, (size_t)(padded - k));
    if (loss) {
        const float norm = _mm512_reduce_add_ps(whole);
        *loss = norm > 0.0f ? _mm512_reduce_add_ps(lost) / norm : 0.0f;  /* an all-zero row loses nothing */
    }
    return scale;
}

/* One row as int8 codes plus 128 at its scale s (as quantize_row) into `hi`, and, when those lose more than
 * ROUNDING_BOUND of the row (relative L2: a row whose largest values dwarf the rest, as outlier features do), what
 * they missed (x − s·code, at most s/2 in size) at s/254 into `lo`: the pair carries the row to about 15 bits.
 * Writes the scales used to `scales`; returns the levels used, 1 or 2. */
static TARGET int quantize_row_levels(const void *row, int bf16, int64_t k, int64_t padded, uint8_t *hi, uint8_t *lo,
                                      float *scales) {
    float loss;
    const float scale = quantize_row(row, bf16, k, padded, 128, hi, 16, NULL, &loss), fine = scale / 254.0f;
    scales[0] = scale;
    if (!(loss > ROUNDING_BOUND * ROUNDING_BOUND)) return 1;
    const __m512 coarse = _mm512_set1_ps(scale), inverse = _mm512_set1_ps(1.0f / fine);
    const __m512i shift = _mm512_set1_epi32(128);
    for (int64_t i = 0; i < k; i += 16) {
        const __mmask16 mask = first(k - i);
        const __m512i codes = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, hi + i)), shift);
        const __m512 missed = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(codes), coarse, load_x(row, bf16, i, mask));
        _mm512_mask_cvtepi32_storeu_epi8(lo + i, mask,
                                         _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(missed, inverse)), shift));
    }
    memset(lo + k, 128, (size_t)(padded - k));
    scales[1] = fine;
    return 2;
}

/* acc + VPDPBUSD(u8 a, s8 b). Written out because GCC 12's intrinsic keeps a tile's sums in memory, copying them
 * at every step (the tied operand defeats its register allocation); the instruction itself keeps them in registers. */
static inline TARGET INLINE __m512i dot(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

/* Asks for the 64-byte lines [p, p + bytes) + AHEAD. */
static inline TARGET INLINE void fetch_ahead(const void *p, int bytes) {
    for (int line = 0; line < bytes; line += 64) _mm_prefetch((const char *)p + AHEAD + line, _MM_HINT_T0);
}

static inline TARGET int32_t four_bytes(const uint8_t *p) {
    int32_t four;
    memcpy(&four, p, sizeof four);
    return four;
}

/* One row of int8 results from its int32 sums over 64 columns: (Σ(x + 128)·w − 128·Σw) · x scale · w scale; with
 * `lo`, the sums of the row's second level (quantize_row_levels) at scale xs_lo are added. */
static inline TARGET INLINE void finish_int8_row(const __m512i acc[4], const __m512i *lo, const int32_t *sums,
                                                 const float *scale, float xs, float xs_lo, void *y, int bf16,
                                                 int64_t columns) {
    for (int c = 0; c < 4; c++) {
        const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(sums + 16 * c), 7);
        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[c], offset)), _mm512_set1_ps(xs));
        if (lo) v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(lo[c], offset)), _mm512_set1_ps(xs_lo), v);
        store_y(y, bf16, 16 * c, _mm512_mul_ps(v, _mm512_loadu_ps(scale + 16 * c)), first(columns - 16 * c));
    }
}

/* x's m rows rounded for the int8 kernels: u8 codes q, a scale each in xs; token r's rows are first_row[r] ..
 * first_row[r + 1] - 1, one, or two where one loses more than ROUNDING_BOUND (quantize_row_levels). q holds rows
 * (stride `padded`), or with `tiled`, AMX tiles of 16 rows x 64 codes (place); whole tiles either way, the padding
 * rows codes 128 (zero). */
struct codes {
    uint8_t *q;
    float *xs;
    int64_t *first_row, rows;
};

static void free_codes(struct codes *codes) {
    free(codes->q);
    free(codes->xs);
    free(codes->first_row);
}

/* Row `row` of codes, `padded` bytes at src, into AMX tiles q: its 64 codes of each chunk of K in the tile of its 16
 * rows for that chunk, the tiles of a 16 rows' chunks one after another. */
static void place(uint8_t *q, int64_t row, int64_t padded, const uint8_t *src) {
    uint8_t *at = q + row / 16 * 16 * padded + row % 16 * 64;
    for (int64_t chunk = 0; chunk < padded / 64; chunk++) memcpy(at + chunk * 1024, src + chunk * 64, 64);
}

/* Fills `codes` (0), or returns -1 when memory ran out (nothing left to free). */
static TARGET int round_rows(const void *x, int64_t m, int64_t ldx, int bf16, int64_t k, int64_t padded, int tiled,
                             struct codes *codes) {
    const int64_t most = 2 * m, size = bf16 ? 2 : 4, tile = tiled ? 16 : 1;
    codes->q = malloc((size_t)(((most + tile - 1) / tile * tile + 1) * padded));  /* + a row for an unused level */
    codes->xs = malloc((size_t)most * sizeof *codes->xs);
    codes->first_row = malloc((size_t)(m + 1) * sizeof *codes->first_row);
    uint8_t *pair = tiled ? malloc((size_t)(2 * padded)) : NULL;  /* a token's rows, before they go to their tiles */
    if (!codes->q || !codes->xs || !codes->first_row || (tiled && !pair)) {
        free(pair);
        free_codes(codes);
        return -1;
    }
    int64_t rows = 0;
    for (int64_t r = 0; r < m; r++) {
        const char *row = (const char *)x + r * ldx * size;
        uint8_t *at = tiled ? pair : codes->q + rows * padded;
        codes->first_row[r] = rows;
        const int levels = quantize_row_levels(row, bf16, k, padded, at, at + padded, codes->xs + rows);
        for (int level = 0; tiled && level < levels; level++) place(codes->q, rows + level, padded, pair + level * padded);
        rows += levels;
    }
    codes->first_row[m] = codes->rows = rows;
    const int64_t whole = (rows + tile - 1) / tile * tile;
    if (tiled) {
        memset(pair, 128, (size_t)padded);
        for (int64_t r = rows; r < whole; r++) place(codes->q, r, padded, pair);
        free(pair);
    } else {
        memset(codes->q + rows * padded, 128, (size_t)((whole - rows) * padded));
    }
    return 0;
}

/* Token r's results over one block of 64 columns from its rows' int32 sums, hi and (its second level) lo or NULL. */
static inline TARGET void finish_token(const int32_t *hi, const int32_t *lo, const struct codes *codes, int64_t r,
                                       const int32_t *sums, const float *scale, void *y, int bf16, int64_t columns) {
    const int64_t at = codes->first_row[r];
    const __m512i acc[8] = {_mm512_loadu_si512(hi), _mm512_loadu_si512(hi + 16), _mm512_loadu_si512(hi + 32),
                            _mm512_loadu_si512(hi + 48), _mm512_loadu_si512(lo ? lo : hi),
                            _mm512_loadu_si512((lo ? lo : hi) + 16), _mm512_loadu_si512((lo ? lo : hi) + 32),
                            _mm512_loadu_si512((lo ? lo : hi) + 48)};
    finish_int8_row(acc, lo ? acc + 4 : NULL, sums, scale, codes->xs[at], lo ? codes->xs[at + 1] : 0.0f, y, bf16,
                    columns);
}

/* Where quad (4 K values) `quad` of 16 columns starts in an int8 block: chunks of 16 quads, each 4 runs of 16 columns. */
static inline const int8_t *int8_quad(const int8_t *block, int64_t quad) {
    return block + quad / 16 * 16 * 4 * BLOCK + quad % 16 * 64;
}

/* Rows of the int8 kernel: u8 codes (x + 128) q with row stride ldq and scales xs; w one block (K/64, 4, 16, 16, 4). With
 * `raw`, the rows' int32 sums go there (64 a row) for the caller to finish. */
static inline TARGET INLINE void tile_int8(const int rows, const uint8_t *q, int64_t ldq, const float *xs, const int8_t *w,
                                    int64_t quads, const int32_t *sums, const float *scale, void *y, int64_t ldy,
                                    int bf16, int64_t columns, int fetch, int32_t *raw) {
    __m512i acc[TILE_ROWS][4];
    for (int r = 0; r < TILE_ROWS; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_si512();
    for (int64_t quad = 0; quad < quads; quad++) {
        const int8_t *wq = int8_quad(w, quad);
        if (fetch) fetch_ahead(w + quad * 4 * BLOCK, 4 * BLOCK);  /* the block's bytes in order, as it streams */
        const __m512i w0 = _mm512_loadu_si512(wq), w1 = _mm512_loadu_si512(wq + 1024);
        const __m512i w2 = _mm512_loadu_si512(wq + 2048), w3 = _mm512_loadu_si512(wq + 3072);
#pragma GCC unroll 6
        for (int r = 0; r < TILE_ROWS; r++) {
            if (r < rows) {
                const __m512i xr = _mm512_set1_epi32(four_bytes(q + r * ldq + 4 * quad));
                acc[r][0] = dot(acc[r][0], xr, w0);
                acc[r][1] = dot(acc[r][1], xr, w1);
                acc[r][2] = dot(acc[r][2], xr, w2);
                acc[r][3] = dot(acc[r][3], xr, w3);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        if (raw)
            for (int c = 0; c < 4; c++) _mm512_storeu_si512(raw + r * BLOCK + 16 * c, acc[r][c]);
        else
            finish_int8_row(acc[r], NULL, sums, scale, xs[r], 0.0f, (char *)y + r * ldy, bf16, columns);
    }
}

/* int8 x · ŵᵀ (as `linear` says) with y in float32, or bf16 when ybf16, whatever x's dtype. Where rows with outliers
 * took two levels of codes (round_rows), the tiles leave their sums for a finish token by token once all are made. */
static TARGET int linear_int8(const void *x, int64_t m, int64_t ldx, int bf16, const int8_t *w, const int32_t *sums,
                              const float *scale, int64_t n, int64_t k, void *y, int64_t ldy, int ybf16) {
    const int64_t padded = (k + 63) / 64 * 64, ysize = ybf16 ? 2 : 4;
    struct codes codes;
    if (round_rows(x, m, ldx, bf16, k, padded, 0, &codes)) return -1;
    const int64_t rows_of_codes = codes.rows, tiles = (rows_of_codes + TILE_ROWS - 1) / TILE_ROWS;
    int32_t *raw = NULL;  /* every row's sums over a block, when some token has two rows */
    if (rows_of_codes > m && !(raw = malloc((size_t)(rows_of_codes * BLOCK) * sizeof *raw))) {
        free_codes(&codes);
        return -1;
    }
    const float *xs = codes.xs;
    for (int64_t block = 0; block * BLOCK < n; block++) {
        const int8_t *wb = w + block * BLOCK * padded;
        const int64_t columns = n - block * BLOCK;
        const int32_t *sb = sums + block * BLOCK;
        const float *cb = scale + block * BLOCK;
        for (int64_t t = 0, r0 = 0; t < tiles; t++) {
            const int64_t rows = (rows_of_codes - r0 + (tiles - t) - 1) / (tiles - t);  /* tiles differ by a row at most */
            const uint8_t *qt = codes.q + r0 * padded;
            void *yt = (char *)y + (r0 * ldy + block * BLOCK) * ysize;
            const int64_t ystride = ldy * ysize;
            int32_t *rt = raw ? raw + r0 * BLOCK : NULL;
            switch (rows) {  /* a constant row count per call, so each loop unrolls fully */
            case 1: tile_int8(1, qt, padded, xs + r0, wb, padded / 4, sb, cb, yt, ystride, ybf16, columns, !t, rt); break;
            case 2: tile_int8(2, qt, padded, xs + r0, wb, padded / 4, sb, cb, yt, ystride, ybf16, columns, !t, rt); break;
            case 3: tile_int8(3, qt, padded, xs + r0, wb, padded / 4, sb, cb, yt, ystride, ybf16, columns, !t, rt); break;
            case 4: tile_int8(4, qt, padded, xs + r0, wb, padded / 4, sb, cb, yt, ystride, ybf16, columns, !t, rt); break;
            case 5: tile_int8(5, qt, padded, xs + r0, wb, padded / 4, sb, cb, yt, ystride, ybf16, columns, !t, rt); break;
            default: tile_int8(6, qt, padded, xs + r0, wb, padded / 4, sb, cb, yt, ystride, ybf16, columns, !t, rt); break;
            }
            r0 += rows;
        }
        for (int64_t r = 0; raw && r < m; r++) {
            const int64_t at = codes.first_row[r];
            finish_token(raw + at * BLOCK, codes.first_row[r + 1] - at == 2 ? raw + (at + 1) * BLOCK : NULL, &codes, r,
                         sb, cb, (char *)y + (r * ldy + block * BLOCK) * ysize, ybf16, columns);
        }
    }
    free(raw);
    free_codes(&codes);
    return 0;
}

/* Linux hands a process AMX tile state only when asked: 0 once it has, else the error. */
int npumoe_amx_init(void) {
#ifdef __linux__
    return (int)syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */);
#else
    return -1;
#endif
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
};

/* 16 rows of u8 codes q (tiled by round_rows) times one packed block w over `chunks` of 64 K: sums (16, 64) into c.
 * Tiles 0-3 hold the sums of 16 columns each, 4 the rows' codes, 5 and 6 the weights (a row of a weight tile is
 * 4 K values of 16 columns). */
static inline AMX INLINE void amx_block(const uint8_t *q, const int8_t *w, int64_t chunks, int32_t *c, int fetch) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t chunk = 0; chunk < chunks; chunk++) {
        const int8_t *wk = w + chunk * 16 * 4 * BLOCK;
        if (fetch) fetch_ahead(wk, 16 * 4 * BLOCK);
        _tile_loadd(4, q + chunk * 1024, 64);
        _tile_loadd(5, wk, 64);
        _tile_loadd(6, wk + 1024, 64);
        _tile_dpbusd(0, 4, 5);
        _tile_loadd(5, wk + 2048, 64);
        _tile_dpbusd(1, 4, 6);
        _tile_loadd(6, wk + 3072, 64);
        _tile_dpbusd(2, 4, 5);
        _tile_dpbusd(3, 4, 6);
    }
    _tile_stored(0, c, 4 * BLOCK);
    _tile_stored(1, c + 16, 4 * BLOCK);
    _tile_stored(2, c + 32, 4 * BLOCK);
    _tile_stored(3, c + 48, 4 * BLOCK);
}

/* Where the int32 sums of row `row` of codes lie in `c`, which holds those of the last two row tiles. */
static inline int32_t *sums_of(int32_t *c, int64_t row) {
    return c + ((row / 16) % 2 * 16 + row % 16) * BLOCK;
}

/* linear_int8 on AMX-INT8 tiles (npumoe_amx_init must have succeeded in this process). A token whose row took two
 * levels of codes has two rows in the tiles, and its results sum both. */
static AMX int linear_int8_amx(const void *x, int64_t m, int64_t ldx, int bf16, const int8_t *w, const int32_t *sums,
                               const float *scale, int64_t n, int64_t k, void *y, int64_t ldy, int ybf16) {
    const int64_t padded = (k + 63) / 64 * 64, ysize = ybf16 ? 2 : 4;
    struct codes codes;
    if (round_rows(x, m, ldx, bf16, k, padded, 1, &codes)) return -1;
    const int64_t tiles = (codes.rows + 15) / 16;
    struct tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 7; t++) {
        config.rows[t] = 16;
        config.bytes_per_row[t] = 64;
    }
    _tile_loadconfig(&config);
    int32_t c[2 * 16 * BLOCK] __attribute__((aligned(64)));  /* two row tiles' sums: a token's rows may straddle */
    for (int64_t block = 0; block * BLOCK < n; block++) {
        const int8_t *wb = w + block * BLOCK * padded;
        for (int64_t t = 0, r = 0; t < tiles; t++) {  /* later row tiles find the block cached */
            amx_block(codes.q + t * 16 * padded, wb, padded / 64, sums_of(c, 16 * t), t == 0);
            for (; r < m && codes.first_row[r + 1] <= (t + 1) * 16; r++) {  /* the tokens whose rows are all summed */
                const int64_t at = codes.first_row[r];
                finish_token(sums_of(c, at), codes.first_row[r + 1] - at == 2 ? sums_of(c, at + 1) : NULL, &codes, r,
                             sums + block * BLOCK, scale + block * BLOCK,
                             (char *)y + (r * ldy + block * BLOCK) * ysize, ybf16, n - block * BLOCK);
            }
        }
    }
    _tile_release();
    free_codes(&codes);
    return 0;
}

static inline TARGET __m512 bf16_to_ps(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* Rows of the int4 kernel: s8 codes q (row stride ldq), scales xs, group sums gs (row stride groups); w one block
 * (k/8, 64, 4) of nibble pairs; s, z the block's (groups, 64) bf16 scales and zeros. */
static inline TARGET INLINE void tile_int4(const int rows, const uint8_t *q, int64_t ldq, const float *xs, const float *gs,
                                    const uint8_t *w, int64_t groups, int64_t octets, const uint16_t *s,
                                    const uint16_t *z, void *y, int64_t ldy, int bf16, int64_t columns, int fetch) {
    __m512 total[TILE_ROWS][4];
    for (int r = 0; r < TILE_ROWS; r++)
        for (int c = 0; c < 4; c++) total[r][c] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t g = 0; g < groups; g++) {
        __m512i acc[TILE_ROWS][4];
        for (int r = 0; r < TILE_ROWS; r++)
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_si512();
        for (int64_t o = g * octets; o < (g + 1) * octets; o++) {
            const uint8_t *wo = w + o * 4 * BLOCK;
            if (fetch) fetch_ahead(wo, 4 * BLOCK);
            __m512i wc[4];
            for (int c = 0; c < 4; c++) wc[c] = _mm512_and_si512(_mm512_loadu_si512(wo + 64 * c), low);
#pragma GCC unroll 6
            for (int r = 0; r < TILE_ROWS; r++) {
                if (r < rows) {
                    const __m512i xr = _mm512_set1_epi32(four_bytes(q + r * ldq + 8 * o));
                    for (int c = 0; c < 4; c++) acc[r][c] = dot(acc[r][c], wc[c], xr);
                }
            }
            for (int c = 0; c < 4; c++)
                wc[c] = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(wo + 64 * c), 4), low);
#pragma GCC unroll 6
            for (int r = 0; r < TILE_ROWS; r++) {
                if (r < rows) {
                    const __m512i xr = _mm512_set1_epi32(four_bytes(q + r * ldq + 8 * o + 4));
                    for (int c = 0; c < 4; c++) acc[r][c] = dot(acc[r][c], wc[c], xr);
                }
            }
        }
        for (int c = 0; c < 4; c++) {
            const __m512 gscale = bf16_to_ps(s + g * BLOCK + 16 * c);
            const __m512 gzero = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), gscale, bf16_to_ps(z + g * BLOCK + 16 * c));
            for (int r = 0; r < rows; r++) {
                total[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]), gscale, total[r][c]);
                total[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(gs[r * groups + g]), gzero, total[r][c]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 4; c++)
            store_y((char *)y + r * ldy, bf16, 16 * c, _mm512_mul_ps(total[r][c], _mm512_set1_ps(xs[r])),
                    first(columns - 16 * c));
}

/* int4 x · ŵᵀ (as `linear` says) with y in float32, or bf16 when ybf16, whatever x's dtype. */
static TARGET int linear_int4(const void *x, int64_t m, int64_t ldx, int bf16, const uint8_t *w, const uint16_t *s,
                              const uint16_t *z, int64_t group, int64_t n, int64_t k, void *y, int64_t ldy, int ybf16) {
    const int64_t groups = k / group, size = bf16 ? 2 : 4, ysize = ybf16 ? 2 : 4;
    struct int4_scratch scratch;
    if (alloc_int4_scratch(&scratch, m, k, groups)) return -1;
    uint8_t *q = scratch.q;
    float *xs = scratch.xs, *gs = scratch.gs;
    for (int64_t r = 0; r < m; r++)
        xs[r] = quantize_row((const char *)x + r * ldx * size, bf16, k, k, 0, q + r * k, group, gs + r * groups, NULL);
    const int64_t tiles = (m + TILE_ROWS - 1) / TILE_ROWS, octets = group / 8;
    for (int64_t block = 0; block * BLOCK < n; block++) {
        const uint8_t *wb = w + block * BLOCK * k / 2;
        const uint16_t *sb = s + block * groups * BLOCK, *zb = z + block * groups * BLOCK;
        const int64_t columns = n - block * BLOCK;
        for (int64_t t = 0, r0 = 0; t < tiles; t++) {
            const int64_t rows = (m - r0 + (tiles - t) - 1) / (tiles - t);
            const uint8_t *qt = q + r0 * k;
            const float *gt = gs + r0 * groups;
            void *yt = (char *)y + (r0 * ldy + block * BLOCK) * ysize;
            const int64_t ystride = ldy * ysize;
            switch (rows) {
            case 1: tile_int4(1, qt, k, xs + r0, gt, wb, groups, octets, sb, zb, yt, ystride, ybf16, columns, !t); break;
            case 2: tile_int4(2, qt, k, xs + r0, gt, wb, groups, octets, sb, zb, yt, ystride, ybf16, columns, !t); break;
            case 3: tile_int4(3, qt, k, xs + r0, gt, wb, groups, octets, sb, zb, yt, ystride, ybf16, columns, !t); break;
            case 4: tile_int4(4, qt, k, xs + r0, gt, wb, groups, octets, sb, zb, yt, ystride, ybf16, columns, !t); break;
            case 5: tile_int4(5, qt, k, xs + r0, gt, wb, groups, octets, sb, zb, yt, ystride, ybf16, columns, !t); break;
            default: tile_int4(6, qt, k, xs + r0, gt, wb, groups, octets, sb, zb, yt, ystride, ybf16, columns, !t); break;
            }
            r0 += rows;
        }
    }
    free_int4_scratch(&scratch);
    return 0;
}

static inline TARGET __m512 round_ps(__m512 t) {
    return _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

DEFINE_EXP_PS(TARGET, __m512, _mm512, round_ps, _mm512_scalef_ps)

/* silu(gate) · up in float32, 16 values at a time, where npumoe_kernels.h's NPUMOE_EXPORTS says. */
static TARGET void silu_glu_rows(float *h, int64_t m, int64_t ldh, int64_t inter) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t r = 0; r < m; r++) {
        float *row = h + r * ldh;
        for (int64_t j = 0; j < inter; j += 16) {
            const __mmask16 mask = first(inter - j);
            const __m512 gate = _mm512_maskz_loadu_ps(mask, row + j), up = _mm512_maskz_loadu_ps(mask, row + inter + j);
            const __m512 decay = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gate));
            const __m512 silu = _mm512_div_ps(gate, _mm512_add_ps(one, decay));
            _mm512_mask_storeu_ps(row + j, mask, _mm512_mul_ps(silu, up));
        }
    }
}

/* The weights of int8 (int4 false): w->codes packed (n64/64, k64/64, 4, 16, 16, 4) int8 with k64 = k rounded up to 64
 * and n64 = n rounded up to 64, w->sums Σ_k w (n64,) int32, w->scale (n64,) float32; on AMX-INT8 tiles with `amx`
 * (npumoe_amx_init must have succeeded in this process). int4: w->codes packed (n64/64, k/8, 64, 4) nibble pairs,
 * w->scale and w->zero (n64/64, k/group, 64) bf16, w->group a multiple of 16 dividing k. */
static int linear(const void *x, int64_t m, int64_t ldx, int bf16, int int4, int amx, const struct npumoe_weight *w,
                  void *y, int64_t ldy, int ybf16) {
    if (int4) return linear_int4(x, m, ldx, bf16, w->codes, w->scale, w->zero, w->group, w->n, w->k, y, ldy, ybf16);
    if (amx) return linear_int8_amx(x, m, ldx, bf16, w->codes, w->sums, w->scale, w->n, w->k, y, ldy, ybf16);
    return linear_int8(x, m, ldx, bf16, w->codes, w->sums, w->scale, w->n, w->k, y, ldy, ybf16);
}

NPUMOE_EXPORTS(npumoe_vnni)
