/* y = x · Wᵀ in bf16 with float32 accumulation, for x86-64 CPUs with AVX512-BF16.
 *
 * The weight is packed as [N/64][K/2][64][2]: each block of 64 output columns is one contiguous
 * stream, read in order, with the two K values of a pair side by side (the operand layout of
 * VDPBF16PS). A tile of up to 6 rows x 64 columns keeps 24 accumulators in registers; every row tile
 * of a block after the first finds the block (at most K·128 bytes) in L2. Row tiles are balanced, so
 * 8 rows run as 4 + 4 rather than 6 + 2.
 *
 * At the row counts an MoE expert sees in prefill (a few to a few dozen), a plain in-order stream
 * keeps the hardware prefetcher busy and reads the weights faster than oneDNN's small-batch kernels.
 * Built and loaded at run time by bf16_linear.py, which asks the CPU for AVX512-BF16 first.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define TILE_ROWS 6
#define BLOCK 64

static inline TARGET void tile(const int rows, const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t k,
                               uint16_t *y, int64_t ldy) {
    __m512 acc[TILE_ROWS][4];
    for (int r = 0; r < TILE_ROWS; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t pair = 0; pair < k / 2; pair++) {
        const uint16_t *wp = w + pair * 2 * BLOCK;
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
        __m512bh w2 = (__m512bh)_mm512_loadu_si512(wp + 64), w3 = (__m512bh)_mm512_loadu_si512(wp + 96);
#pragma GCC unroll 6
        for (int r = 0; r < TILE_ROWS; r++) {
            if (r < rows) {
                int32_t both;
                memcpy(&both, x + r * ldx + 2 * pair, sizeof both);
                __m512bh xr = (__m512bh)_mm512_set1_epi32(both);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xr, w0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xr, w1);
                acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xr, w2);
                acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xr, w3);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 4; c++)
            _mm256_storeu_si256((__m256i *)(y + r * ldy + c * 16), (__m256i)_mm512_cvtneps_pbh(acc[r][c]));
}

/* x: (m, k) with row stride ldx; w: packed (n/64, k/2, 64, 2); y: (m, n) with row stride ldy. n % 64 == 0, k even. */
TARGET void npumoe_linear_bf16(const uint16_t *x, int64_t m, int64_t ldx, const uint16_t *w, int64_t n, int64_t k,
                               uint16_t *y, int64_t ldy) {
    const int64_t tiles = (m + TILE_ROWS - 1) / TILE_ROWS;
    for (int64_t block = 0; block < n / BLOCK; block++) {
        const uint16_t *wb = w + block * BLOCK * k;
        for (int64_t t = 0, r0 = 0; t < tiles; t++) {
            const int64_t rows = (m - r0 + (tiles - t) - 1) / (tiles - t);  /* tiles differ by a row at most */
            const uint16_t *xt = x + r0 * ldx;
            uint16_t *yt = y + r0 * ldy + block * BLOCK;
            switch (rows) {  /* a constant row count per call, so each loop unrolls fully */
            case 1: tile(1, xt, ldx, wb, k, yt, ldy); break;
            case 2: tile(2, xt, ldx, wb, k, yt, ldy); break;
            case 3: tile(3, xt, ldx, wb, k, yt, ldy); break;
            case 4: tile(4, xt, ldx, wb, k, yt, ldy); break;
            case 5: tile(5, xt, ldx, wb, k, yt, ldy); break;
            default: tile(6, xt, ldx, wb, k, yt, ldy); break;
            }
            r0 += rows;
        }
    }
}
