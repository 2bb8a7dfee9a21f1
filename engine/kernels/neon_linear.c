/* y = x · ŵᵀ for int8 and int4 quantized weights ŵ (quantize.py), for arm64 CPUs with the dot-product instructions.
 *
 * Each call rounds every row of x (float32 or bf16) to signed int8 codes with its own scale (absmax / 127, rounded
 * to nearest even, as quant_kernels.quantize_rows does); a row that this rounds by more than ROUNDING_BOUND
 * (relative L2, as outlier features make it) takes a second row of codes for what the first missed, at 1/254 of its
 * scale, as vnni_linear.c does. Codes and weights are both signed, so SDOT (vdotq_s32) and SMMLA (vmmlaq_s32, i8mm)
 * multiply them as they are: no offset to take back out.
 *
 * int8 weights are packed in blocks of 16 output columns, each one in-order stream along K of octets (8 K values): an
 * octet is 8 pairs of columns, 16 bytes a pair, a column's 8 K values then its neighbour's. That is SMMLA's 2x8
 * operand as it stands; SDOT reads the same 16 bytes against a row's 8 codes twice over and a pairwise add at the
 * end folds its four lanes (two a column) into two columns.
 * int4 weights keep that layout two octets at a time: a hexadecet (16 K values) is 8 pairs of columns, 16 bytes a
 * pair, the first octet in the low nibbles and the second in the high ones, so an AND and a shift give two int8
 * octets (codes 0..15 are non-negative int8) for the same SDOT and SMMLA. Each group of K values keeps its int32 sums
 * apart and adds them in float at its end: Σ w·x = s·Σ q·x + (z − 8s)·Σ x, w = (q − 8)·s + z (quantize.py).
 * Tiles are 2 rows x 16 columns with SDOT, 4 rows (two pairs) x 16 columns with SMMLA: the sums stay in registers.
 * Built and loaded at run time by neon_linear.py, which asks the CPU for asimddp (and i8mm) first.
 */
#include <arm_neon.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "npumoe_kernels.h"

#if defined(__clang__)
#define DOTPROD __attribute__((target("dotprod")))
#define I8MM __attribute__((target("dotprod,i8mm")))
#else
#define DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))
#define I8MM __attribute__((target("arch=armv8.2-a+dotprod+i8mm")))
#endif
#define BLOCK 16
#define OCTET_BYTES (BLOCK * 8)

static inline float load_x(const void *row, int bf16, int64_t i) {
    if (!bf16) return ((const float *)row)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)row)[i] << 16;
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* v as float32, or as bf16 rounded to nearest even. */
static inline void store_y(void *row, int bf16, int64_t j, float v) {
    if (!bf16) {
        ((float *)row)[j] = v;
        return;
    }
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1);
    ((uint16_t *)row)[j] = (uint16_t)(bits >> 16);
}

/* 4 activations from column i on as float32 (those at k or past it 0). */
static inline float32x4_t load4(const void *row, int bf16, int64_t i, int64_t k) {
    if (i + 4 <= k)
        return bf16 ? vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t *)row + i), 16))
                    : vld1q_f32((const float *)row + i);
    float v[4] = {0.0f};
    for (int j = 0; i + j < k; j++) v[j] = load_x(row, bf16, i + j);
    return vld1q_f32(v);
}

/* 4 values times `inverse`, rounded to nearest even and clamped to ±127, into q[i..] (those below k). */
static inline int32x4_t store_codes(float32x4_t v, float32x4_t inverse, int8_t *q, int64_t i, int64_t k) {
    const int32x4_t codes = vmaxq_s32(vminq_s32(vcvtnq_s32_f32(vmulq_f32(v, inverse)), vdupq_n_s32(127)),
                                      vdupq_n_s32(-127));
    int32_t four[4];
    vst1q_s32(four, codes);
    for (int j = 0; j < 4 && i + j < k; j++) q[i + j] = (int8_t)four[j];
    return codes;
}

/* x's m rows as codes: `rows` rows of `padded` codes (zeros past k, and a zero row to make the count even), a scale
 * each; token r's rows are first_row[r] .. first_row[r + 1] - 1. */
struct codes {
    int8_t *q;
    float *xs;
    int64_t *first_row, rows;
};

static void free_codes(struct codes *c) {
    free(c->q);
    free(c->xs);
    free(c->first_row);
}

static int round_rows(const void *x, int64_t m, int64_t ldx, int bf16, int64_t k, int64_t padded, struct codes *c) {
    const int64_t size = bf16 ? 2 : 4;
    c->q = calloc((size_t)((2 * m + 2) * padded), 1);
    c->xs = malloc((size_t)(2 * m + 2) * sizeof *c->xs);
    c->first_row = malloc((size_t)(m + 1) * sizeof *c->first_row);
    if (!c->q || !c->xs || !c->first_row) {
        free_codes(c);
        return -1;
    }
    int64_t rows = 0;
    for (int64_t r = 0; r < m; r++) {
        const char *row = (const char *)x + r * ldx * size;
        float32x4_t top = vdupq_n_f32(0.0f);
        for (int64_t i = 0; i < k; i += 4) top = vmaxq_f32(top, vabsq_f32(load4(row, bf16, i, k)));
        float scale = vmaxvq_f32(top) / 127.0f;
        if (scale < FLT_MIN) scale = FLT_MIN;  /* an all-zero row: zero codes */
        const float32x4_t step = vdupq_n_f32(scale), inverse = vdupq_n_f32(1.0f / scale);
        int8_t *hi = c->q + rows * padded;
        float32x4_t lost = vdupq_n_f32(0.0f), whole = vdupq_n_f32(0.0f);
        for (int64_t i = 0; i < k; i += 4) {
            const float32x4_t v = load4(row, bf16, i, k);
            const float32x4_t missed = vfmsq_f32(v, vcvtq_f32_s32(store_codes(v, inverse, hi, i, k)), step);
            lost = vfmaq_f32(lost, missed, missed);
            whole = vfmaq_f32(whole, v, v);
        }
        c->first_row[r] = rows;
        c->xs[rows++] = scale;
        const float norm = vaddvq_f32(whole);
        if (norm > 0.0f && vaddvq_f32(lost) > ROUNDING_BOUND * ROUNDING_BOUND * norm) {
            const float fine = scale / 254.0f;
            const float32x4_t finer = vdupq_n_f32(1.0f / fine);
            int8_t *lo = c->q + rows * padded;
            for (int64_t i = 0; i < k; i += 4) {
                int32_t four;  /* codes i..i+3 (those past k are 0) */
                memcpy(&four, hi + i, sizeof four);
                const int8x8_t eight = vreinterpret_s8_s32(vdup_n_s32(four));
                const float32x4_t coarse = vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(eight))));
                store_codes(vfmsq_f32(load4(row, bf16, i, k), coarse, step), finer, lo, i, k);
            }
            c->xs[rows++] = fine;
        }
    }
    c->first_row[m] = c->rows = rows;
    c->xs[rows] = 0.0f;  /* the zero row that makes the count even */
    return 0;
}

/* Up to 2 code rows (row stride ldq) times one block (K8/8 octets) -> their int32 sums, 16 a row, into raw. */
static DOTPROD void tile_sdot(int rows, const int8_t *q, int64_t ldq, const int8_t *w, int64_t octets, int32_t *raw) {
    int32x4_t acc[2][8];
    for (int r = 0; r < 2; r++)
        for (int p = 0; p < 8; p++) acc[r][p] = vdupq_n_s32(0);
    for (int64_t o = 0; o < octets; o++) {
        const int8_t *wo = w + o * OCTET_BYTES;
        int8x16_t wp[8];
        for (int p = 0; p < 8; p++) wp[p] = vld1q_s8(wo + 16 * p);
        for (int r = 0; r < 2; r++) {
            if (r < rows) {
                const int8x8_t x8 = vld1_s8(q + r * ldq + 8 * o);
                const int8x16_t twice = vcombine_s8(x8, x8);
                for (int p = 0; p < 8; p++) acc[r][p] = vdotq_s32(acc[r][p], wp[p], twice);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++) vst1q_s32(raw + r * BLOCK + 4 * j, vpaddq_s32(acc[r][2 * j], acc[r][2 * j + 1]));
}

/* Up to 4 code rows (an even count; row stride ldq) times one block -> their int32 sums, 16 a row, into raw. */
static I8MM void tile_smmla(int rows, const int8_t *q, int64_t ldq, const int8_t *w, int64_t octets, int32_t *raw) {
    int32x4_t acc[2][8];  /* per pair of rows and pair of columns: (row 0, row 1) x (column 0, column 1) */
    for (int r = 0; r < 2; r++)
        for (int p = 0; p < 8; p++) acc[r][p] = vdupq_n_s32(0);
    for (int64_t o = 0; o < octets; o++) {
        const int8_t *wo = w + o * OCTET_BYTES;
        int8x16_t wp[8];
        for (int p = 0; p < 8; p++) wp[p] = vld1q_s8(wo + 16 * p);
        for (int pair = 0; pair < 2; pair++) {
            if (2 * pair < rows) {
                const int8_t *row = q + 2 * pair * ldq + 8 * o;
                const int8x16_t two = vcombine_s8(vld1_s8(row), vld1_s8(row + ldq));
                for (int p = 0; p < 8; p++) acc[pair][p] = vmmlaq_s32(acc[pair][p], two, wp[p]);
            }
        }
    }
    for (int pair = 0; 2 * pair < rows; pair++)
        for (int j = 0; j < 4; j++) {
            const int32x4_t a = acc[pair][2 * j], b = acc[pair][2 * j + 1];
            vst1q_s32(raw + 2 * pair * BLOCK + 4 * j, vcombine_s32(vget_low_s32(a), vget_low_s32(b)));
            vst1q_s32(raw + (2 * pair + 1) * BLOCK + 4 * j, vcombine_s32(vget_high_s32(a), vget_high_s32(b)));
        }
}

/* The float work at the end of an int4 group, for one code row: its 16 columns' int32 sums (four vectors of four) times
 * the group's scales (sc), plus its zero shares (zc: z − 8s) times the row's sum of codes over the group, into part.
 * One function for both tiles, so that they round alike. */
static inline void group_end(const int32x4_t sums[4], const float32x4_t sc[4], const float32x4_t zc[4], int32_t codes,
                             float *part) {
    const float32x4_t total = vdupq_n_f32((float)codes);
    for (int j = 0; j < 4; j++)
        vst1q_f32(part + 4 * j, vfmaq_f32(vfmaq_f32(vld1q_f32(part + 4 * j), vcvtq_f32_s32(sums[j]), sc[j]), zc[j], total));
}

/* A group's bf16 scales and zeros for 16 columns as float32: sc = s, zc = z − 8s. */
static inline void group_scales(const uint16_t *s, const uint16_t *z, float32x4_t sc[4], float32x4_t zc[4]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(s + 4 * j), 16));
        zc[j] = vfmsq_f32(vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(z + 4 * j), 16)), vdupq_n_f32(8.0f), sc[j]);
    }
}

/* One int4 weight block as the tiles read it: nibble pairs (K/16 hexadecets of 8 pairs x 16 bytes), its (groups, 16)
 * bf16 scales and zeros, and `hexes` hexadecets a group. */
struct int4_block {
    const uint8_t *w;
    const uint16_t *s, *z;
    int64_t groups, hexes;
};

/* The two int8 octets a pair's 16 bytes of nibbles hold: low nibbles the first, high nibbles the second. */
static inline void octets_of(const uint8_t *pair, int8x16_t *first, int8x16_t *second) {
    const uint8x16_t b = vld1q_u8(pair);
    *first = vreinterpretq_s8_u8(vandq_u8(b, vdupq_n_u8(0x0F)));
    *second = vreinterpretq_s8_u8(vshrq_n_u8(b, 4));
}

/* Up to 2 code rows (row stride ldq; each group's sum of codes in codes, row stride groups) times one int4 block ->
 * Σ over groups of (s·Σ q·x + (z − 8s)·Σ x) in code units, 16 a row, into part (row stride BLOCK). */
static DOTPROD void tile4_sdot(int rows, const int8_t *q, int64_t ldq, const int32_t *codes, const struct int4_block *b,
                               float *part) {
    memset(part, 0, (size_t)rows * BLOCK * sizeof *part);
    for (int64_t g = 0; g < b->groups; g++) {
        int32x4_t acc[2][8];
        for (int r = 0; r < 2; r++)
            for (int p = 0; p < 8; p++) acc[r][p] = vdupq_n_s32(0);
        for (int64_t h = g * b->hexes; h < (g + 1) * b->hexes; h++) {
            const uint8_t *wh = b->w + h * OCTET_BYTES;  /* 16 columns x 16 nibbles */
            int8x16_t first[2], second[2];  /* each row's codes for the hexadecet's two octets, twice over */
            for (int r = 0; r < rows; r++) {
                const int8x8_t a = vld1_s8(q + r * ldq + 16 * h), c = vld1_s8(q + r * ldq + 16 * h + 8);
                first[r] = vcombine_s8(a, a);
                second[r] = vcombine_s8(c, c);
            }
            for (int p = 0; p < 8; p++) {
                int8x16_t lo, hi;
                octets_of(wh + 16 * p, &lo, &hi);
                for (int r = 0; r < 2; r++)
                    if (r < rows) acc[r][p] = vdotq_s32(vdotq_s32(acc[r][p], lo, first[r]), hi, second[r]);
            }
        }
        float32x4_t sc[4], zc[4];
        group_scales(b->s + g * BLOCK, b->z + g * BLOCK, sc, zc);
        for (int r = 0; r < rows; r++) {
            int32x4_t sums[4];
            for (int j = 0; j < 4; j++) sums[j] = vpaddq_s32(acc[r][2 * j], acc[r][2 * j + 1]);
            group_end(sums, sc, zc, codes[r * b->groups + g], part + r * BLOCK);
        }
    }
}

/* tile4_sdot with SMMLA: up to 4 code rows, an even count. */
static I8MM void tile4_smmla(int rows, const int8_t *q, int64_t ldq, const int32_t *codes, const struct int4_block *b,
                             float *part) {
    memset(part, 0, (size_t)rows * BLOCK * sizeof *part);
    for (int64_t g = 0; g < b->groups; g++) {
        int32x4_t acc[2][8];  /* per pair of rows and pair of columns: (row 0, row 1) x (column 0, column 1) */
        for (int r = 0; r < 2; r++)
            for (int p = 0; p < 8; p++) acc[r][p] = vdupq_n_s32(0);
        for (int64_t h = g * b->hexes; h < (g + 1) * b->hexes; h++) {
            const uint8_t *wh = b->w + h * OCTET_BYTES;  /* 16 columns x 16 nibbles */
            int8x16_t first[2], second[2];  /* each pair of rows' codes for the hexadecet's two octets */
            for (int pair = 0; 2 * pair < rows; pair++) {
                const int8_t *row = q + 2 * pair * ldq + 16 * h;
                first[pair] = vcombine_s8(vld1_s8(row), vld1_s8(row + ldq));
                second[pair] = vcombine_s8(vld1_s8(row + 8), vld1_s8(row + ldq + 8));
            }
            for (int p = 0; p < 8; p++) {
                int8x16_t lo, hi;
                octets_of(wh + 16 * p, &lo, &hi);
                for (int pair = 0; pair < 2; pair++)
                    if (2 * pair < rows)
                        acc[pair][p] = vmmlaq_s32(vmmlaq_s32(acc[pair][p], first[pair], lo), second[pair], hi);
            }
        }
        float32x4_t sc[4], zc[4];
        group_scales(b->s + g * BLOCK, b->z + g * BLOCK, sc, zc);
        for (int pair = 0; 2 * pair < rows; pair++) {
            int32x4_t top[4], bottom[4];
            for (int j = 0; j < 4; j++) {
                const int32x4_t a = acc[pair][2 * j], c = acc[pair][2 * j + 1];
                top[j] = vcombine_s32(vget_low_s32(a), vget_low_s32(c));
                bottom[j] = vcombine_s32(vget_high_s32(a), vget_high_s32(c));
            }
            group_end(top, sc, zc, codes[2 * pair * b->groups + g], part + 2 * pair * BLOCK);
            group_end(bottom, sc, zc, codes[(2 * pair + 1) * b->groups + g], part + (2 * pair + 1) * BLOCK);
        }
    }
}

/* Each code row's sum of codes over each group of K values (row stride groups), the zero row's too; NULL when memory
 * ran out. */
static int32_t *group_sums(const struct codes *c, int64_t padded, int64_t group, int64_t groups) {
    int32_t *sums = calloc((size_t)((c->rows + 1) * groups), sizeof *sums);
    if (!sums) return NULL;
    for (int64_t r = 0; r < c->rows; r++)
        for (int64_t g = 0; g < groups; g++)
            for (int64_t i = g * group; i < (g + 1) * group; i += 16)
                sums[r * groups + g] += vaddlvq_s8(vld1q_s8(c->q + r * padded + i));
    return sums;
}

/* The weights of int8 (int4 false): w->codes packed (n16/16, k8/8, 8, 2, 8), w->scale (n16,) float32; int4: w->codes
 * (n16/16, k/16, 8, 2, 8) nibble pairs, w->scale and w->zero (n16/16, k/group, 16) bf16, w->group a multiple of 16
 * dividing k; SMMLA tiles with i8mm, else SDOT. */
static int linear(const void *x, int64_t m, int64_t ldx, int bf16, int int4, int i8mm, const struct npumoe_weight *w,
                  void *y, int64_t ldy, int ybf16) {
    const int64_t n = w->n, k = w->k, padded = (k + 7) / 8 * 8, octets = padded / 8, ysize = ybf16 ? 2 : 4;
    const int64_t groups = int4 ? k / w->group : 0;
    struct codes c;
    if (round_rows(x, m, ldx, bf16, k, padded, &c)) return -1;
    float *partial = malloc((size_t)(c.rows + 4) * BLOCK * sizeof *partial);  /* each code row's scaled sums */
    int32_t *sums = int4 ? group_sums(&c, padded, w->group, groups) : NULL;
    if (!partial || (int4 && !sums)) {
        free(partial);
        free(sums);
        free_codes(&c);
        return -1;
    }
    const int step = i8mm ? 4 : 2;
    int32_t raw[4 * BLOCK];
    for (int64_t block = 0; block * BLOCK < n; block++) {
        const struct int4_block b4 = {(const uint8_t *)w->codes + block * octets * OCTET_BYTES / 2,
                                      (const uint16_t *)w->scale + block * groups * BLOCK,
                                      (const uint16_t *)w->zero + block * groups * BLOCK, groups,
                                      int4 ? w->group / 16 : 0};
        const int8_t *wb = (const int8_t *)w->codes + block * octets * OCTET_BYTES;
        for (int64_t r0 = 0; r0 < c.rows; r0 += step) {
            const int64_t left = c.rows - r0;
            const int rows = (int)(left < step ? left : step), even = rows + (rows & 1);  /* + the zero row */
            const int8_t *qt = c.q + r0 * padded;
            float *part = partial + r0 * BLOCK;
            if (int4 && i8mm)
                tile4_smmla(even, qt, padded, sums + r0 * groups, &b4, part);
            else if (int4)
                tile4_sdot(rows, qt, padded, sums + r0 * groups, &b4, part);
            else if (i8mm)
                tile_smmla(even, qt, padded, wb, octets, raw);
            else
                tile_sdot(rows, qt, padded, wb, octets, raw);
            for (int r = 0; r < rows; r++)  /* times the row's scale: int8's from its int32 sums */
                for (int j = 0; j < BLOCK; j++)
                    part[r * BLOCK + j] = (int4 ? part[r * BLOCK + j] : (float)raw[r * BLOCK + j]) * c.xs[r0 + r];
        }
        const float *scale = int4 ? NULL : (const float *)w->scale + block * BLOCK;  /* int4's are in the groups */
        const int64_t columns = n - block * BLOCK < BLOCK ? n - block * BLOCK : BLOCK;
        for (int64_t t = 0; t < m; t++) {
            const float *hi = partial + c.first_row[t] * BLOCK;
            const int two = c.first_row[t + 1] - c.first_row[t] == 2;
            void *row = (char *)y + t * ldy * ysize;
            for (int64_t j = 0; j < columns; j++) {
                const float v = hi[j] + (two ? hi[BLOCK + j] : 0.0f);
                store_y(row, ybf16, block * BLOCK + j, scale ? v * scale[j] : v);
            }
        }
    }
    free(partial);
    free(sums);
    free_codes(&c);
    return 0;
}

/* silu(gate) · up in float32, where npumoe_kernels.h's NPUMOE_EXPORTS says. */
static void silu_glu_rows(float *h, int64_t m, int64_t ldh, int64_t inter) {
    for (int64_t r = 0; r < m; r++) {
        float *row = h + r * ldh;
        for (int64_t j = 0; j < inter; j++) row[j] = row[j] / (1.0f + expf(-row[j])) * row[inter + j];
    }
}

NPUMOE_EXPORTS(npumoe_neon)
