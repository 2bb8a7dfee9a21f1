/* Exact flash attention of a prefill chunk against its KV cache, for x86-64 CPUs with AVX-512 or AVX2, with
 * grouped KV heads read once for every query head they serve.
 *
 * A unit of work is one KV head and a run of query positions: its rows are every (position, query head of the
 * group), so the keys and values of a block are packed once and used by all of them (torch's CPU flash kernel
 * reads them once per query head). Each query position sees the keys [lo, hi) (causal, sliding window); keys
 * outside take no weight. The softmax is online and in float32; with sinks, each head's sink logit joins the
 * denominator and adds no value (gpt-oss).
 *
 * Three bodies: bfloat16 on AMX tiles (QK and PV as tile products with float32 accumulation, the weights rounded
 * to bf16 for PV as torch's bf16 kernel does), and float32 with AVX-512 FMA or with AVX2 FMA (one body written
 * once over each one's vectors, UNIT_F32). Units are shared out to `threads` POSIX threads (the caller's thread is
 * one of them) by an atomic counter.
 * Built and loaded at run time by attention_kernel.py, which checks the CPU first.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define AVX2 __attribute__((target("avx2,fma")))
#define AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))
#define NK 128       /* keys per block */
#define TR 16        /* rows per row tile */
#define MAX_DIM 256
#ifndef MR
#define MR 8        /* float32 on AVX-512: rows x 16·MC keys or columns per register tile */
#define MC 2
#endif
#define MR2 4       /* on AVX2: its 8 sums, 2 loads and a broadcast fit the 16 registers */
#define MC2 2

typedef struct {
    const void *q, *k, *v;
    void *out;
    int64_t q_head, q_row, k_head, k_row, v_head, v_row, o_head, o_row; /* element strides */
    const int64_t *lo, *hi; /* per query position: the keys [lo, hi) it sees */
    const float *sinks;     /* per query head, or NULL */
    int64_t heads, groups, rows, dim, positions; /* positions: query positions per unit */
    float scale;
    int64_t units, next;
    int failed;
} job_t;

/* 2^y for y <= 0: 2^n · p(y - n), n the nearest integer, p Taylor's series of e^(r ln2) to degree 7 (about 1 ulp)
 * or, for weights that are rounded to bf16 anyway, degree 5 (2e-6 relative); below -150 it is 0. */
#define EXP2_BODY(degree)                                                                                            \
    y = _mm512_max_ps(y, _mm512_set1_ps(-150.0f));                                                                  \
    const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                        \
    const __m512 r = _mm512_mul_ps(_mm512_sub_ps(y, n), _mm512_set1_ps(0.693147180559945309f));                     \
    __m512 p = _mm512_set1_ps(degree == 7 ? 1.0f / 5040 : 1.0f / 120);                                              \
    if (degree == 7) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));                                         \
    if (degree == 7) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));                                         \
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));                                                           \
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));                                                            \
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));                                                                \
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));                                                                \
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));                                                                \
    return _mm512_scalef_ps(p, n);
static inline AVX512 __m512 exp2_512(__m512 y) { EXP2_BODY(7) }
static inline AVX512 __m512 exp2_512_short(__m512 y) { EXP2_BODY(5) }

static inline AVX512 float exp2_1(float y) { return _mm512_cvtss_f32(exp2_512(_mm512_set1_ps(y))); }

static inline AVX512 __mmask16 lanes(int64_t a, int64_t b, int64_t base) {
    /* the lanes base..base+15 that fall in [a, b) */
    int64_t from = a - base < 0 ? 0 : a - base, to = b - base > 16 ? 16 : b - base;
    if (to <= from) return 0;
    return (__mmask16)(((1u << to) - 1) & ~((1u << from) - 1));
}

#define LOG2E 1.44269504088896341f

/* Online softmax of one row's block of raw scores s[NK] (keys j0..), whose logits are s·scale: updates the
 * row's running maximum m (of raw scores) and sum l; writes the weights (zero where hidden) to pb in bf16, or
 * over s in float32; returns the factor the row's earlier output is scaled by. */
#define SOFTMAX_ROW(name, target, bf16)                                                                               \
static inline __attribute__((always_inline)) target float name(float *s, uint16_t *pb, float *m, float *l,            \
                                                                int64_t lo, int64_t hi, int64_t j0, float scale) {    \
    __mmask16 k[NK / 16];                                                                                             \
    __m512 vmax = _mm512_set1_ps(-__builtin_inff());                                                                  \
    const int every = lo <= j0 && hi >= j0 + NK;                                                                      \
    for (int c = 0; c < NK / 16; c++) {                                                                               \
        k[c] = every ? 0xffff : lanes(lo, hi, j0 + 16 * c);                                                           \
        vmax = _mm512_mask_max_ps(vmax, k[c], vmax, _mm512_loadu_ps(s + 16 * c));                                     \
    }                                                                                                                 \
    const float block_max = _mm512_reduce_max_ps(vmax);                                                               \
    if (block_max == -__builtin_inff()) { /* nothing visible */                                                       \
        if (bf16) memset(pb, 0, NK * sizeof(uint16_t));                                                               \
        else memset(s, 0, NK * sizeof(float));                                                                        \
        return 1.0f;                                                                                                  \
    }                                                                                                                 \
    const float m_new = block_max > *m ? block_max : *m, c2 = scale * LOG2E;                                          \
    const float alpha = *m == m_new ? 1.0f : *m == -__builtin_inff() ? 0.0f : exp2_1((*m - m_new) * c2);             \
    const __m512 vc = _mm512_set1_ps(c2), vmc = _mm512_set1_ps(m_new * c2);                                           \
    __m512 sum = _mm512_setzero_ps();                                                                                 \
    for (int c = 0; c < NK / 16; c++) {                                                                               \
        const __m512 y = _mm512_fmsub_ps(_mm512_loadu_ps(s + 16 * c), vc, vmc);                                       \
        const __m512 p = _mm512_maskz_mov_ps(k[c], bf16 ? exp2_512_short(y) : exp2_512(y));                           \
        sum = _mm512_add_ps(sum, p);                                                                                  \
        if (bf16) _mm256_storeu_si256((__m256i *)(pb + 16 * c), (__m256i)_mm512_cvtneps_pbh(p));                      \
        else _mm512_storeu_ps(s + 16 * c, p);                                                                         \
    }                                                                                                                 \
    *l = *l * alpha + _mm512_reduce_add_ps(sum);                                                                      \
    *m = m_new;                                                                                                       \
    return alpha;                                                                                                     \
}

SOFTMAX_ROW(softmax_row_f32, AVX512, 0)

/* The final output row's factor: 1 / l, with the sink's share of the denominator when there is one; exp2_1 is the
 * body's 2^y. */
static inline __attribute__((always_inline)) float final_factor(float m, float l, const float *sink, float scale,
                                                                float (*exp2_1)(float)) {
    if (sink == NULL) return l > 0 ? 1.0f / l : 0.0f;
    const float own = m == -__builtin_inff() ? -__builtin_inff() : m * scale * LOG2E, theirs = *sink * LOG2E;
    const float top = own > theirs ? own : theirs, kept = own == -__builtin_inff() ? 0.0f : exp2_1(own - top);
    return kept / (l * kept + exp2_1(theirs - top));
}

/* Rows of a unit: r = position offset * per_group + head in group. Row tiles cover [first, last) keys. */
typedef struct {
    int64_t g, p0, count, rows; /* KV head, first position, positions, rows (count * per_group) */
} unit_t;

static unit_t unit_of(const job_t *job, int64_t u) {
    int64_t per_unit = (job->rows + job->positions - 1) / job->positions;
    unit_t unit = {u / per_unit, (u % per_unit) * job->positions, 0, 0};
    unit.count = job->rows - unit.p0 < job->positions ? job->rows - unit.p0 : job->positions;
    unit.rows = unit.count * (job->heads / job->groups);
    return unit;
}

/* ---------------------------------------------------------------- bfloat16 on AMX tiles */

/* A unit's rows (its query positions x the query heads of its KV group) made ready: each row's query copied in
 * (elements of `elem` bytes; rows past the unit's padded with zeros), its softmax state and output reset, and the
 * keys each row tile sees, [tlo, thi), and the whole unit, [first, last). */
static void start_unit(const job_t *job, const unit_t *unit, int64_t tiles, size_t elem, void *q_rows, float *o,
                       float *m, float *l, int64_t *tlo, int64_t *thi, int64_t *first, int64_t *last) {
    const int64_t d = job->dim, per_group = job->heads / job->groups;
    const char *q = job->q;
    *first = INT64_MAX, *last = 0;
    for (int64_t t = 0; t < tiles; t++) tlo[t] = INT64_MAX, thi[t] = 0;
    for (int64_t r = 0; r < tiles * TR; r++) {
        char *qr = (char *)q_rows + r * d * elem;
        m[r] = -__builtin_inff(), l[r] = 0.0f;
        memset(o + r * d, 0, d * sizeof(float));
        if (r >= unit->rows) {
            memset(qr, 0, d * elem);
            continue;
        }
        int64_t pos = unit->p0 + r / per_group, head = unit->g * per_group + r % per_group;
        memcpy(qr, q + (head * job->q_head + pos * job->q_row) * elem, d * elem);
        int64_t lo = job->lo[pos], hi = job->hi[pos];
        if (lo < hi) {
            if (lo < tlo[r / TR]) tlo[r / TR] = lo;
            if (hi > thi[r / TR]) thi[r / TR] = hi;
        }
    }
    for (int64_t t = 0; t < tiles; t++) {
        if (tlo[t] < *first) *first = tlo[t];
        if (thi[t] > *last) *last = thi[t];
    }
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config_t;

typedef struct {
    uint16_t *q;   /* rows x dim, bf16 */
    float *o;      /* rows x dim */
    float *m, *l;  /* rows */
    float *s;      /* 2TR x NK */
    uint16_t *p;   /* 2TR x NK, bf16 */
    uint16_t *kb;  /* dim/2 x NK x 2: the block's keys as AMX's B operand of QK */
    uint16_t *vb;  /* NK/2 x dim x 2: the block's values as AMX's B operand of PV */
    int64_t *tlo, *thi; /* per row tile: the keys any of its rows sees */
} bf16_buffers;

SOFTMAX_ROW(softmax_row_bf16, AMX, 1)

static inline AMX void to_bf16_row(uint16_t *dst, const float *src, int64_t n) {
    for (int64_t c = 0; c < n; c += 16)
        _mm256_storeu_si256((__m256i *)(dst + c), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + c)));
}

static AMX void unit_bf16(const job_t *job, const unit_t *unit, bf16_buffers *b) {
    const int64_t d = job->dim, per_group = job->heads / job->groups;
    const int64_t tiles = (unit->rows + 2 * TR - 1) / (2 * TR) * 2;
    const uint16_t *k = (const uint16_t *)job->k + unit->g * job->k_head,
                   *v = (const uint16_t *)job->v + unit->g * job->v_head;
    int64_t first, last;
    start_unit(job, unit, tiles, sizeof(uint16_t), b->q, b->o, b->m, b->l, b->tlo, b->thi, &first, &last);
    for (int64_t j0 = first; j0 < last; j0 += NK) {
        const int64_t keys = last - j0 < NK ? last - j0 : NK;
        uint32_t *kb = (uint32_t *)b->kb, *vb = (uint32_t *)b->vb;
        for (int64_t j = 0; j < NK; j++) {
            const uint32_t *kj = (const uint32_t *)(k + (j0 + j) * job->k_row);
            for (int64_t pair = 0; pair < d / 2; pair++) kb[pair * NK + j] = j < keys ? kj[pair] : 0;
        }
        for (int64_t pair = 0; pair < NK / 2; pair++) {
            const int64_t j = 2 * pair;
            const uint16_t *v0 = v + (j0 + j) * job->v_row, *v1 = v0 + job->v_row;
            for (int64_t c = 0; c < d; c++)
                vb[pair * d + c] = (j < keys ? v0[c] : 0) | (uint32_t)(j + 1 < keys ? v1[c] : 0) << 16;
        }
        for (int64_t t = 0; t < tiles; t += 2) { /* two row tiles: tiles 0-3 accumulate, 4-5 hold rows, 6-7 keys */
            if ((b->thi[t] <= j0 || b->tlo[t] >= j0 + NK) && (b->thi[t + 1] <= j0 || b->tlo[t + 1] >= j0 + NK)) continue;
            const uint16_t *q0 = b->q + t * TR * d, *q1 = q0 + TR * d;
            for (int64_t kh = 0; kh < NK / 32; kh++) { /* S = Q Kᵀ, 32 rows x 32 keys at a time */
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                for (int64_t c = 0; c < d / 32; c++) {
                    _tile_loadd(4, q0 + c * 32, d * 2);
                    _tile_loadd(5, q1 + c * 32, d * 2);
                    _tile_loadd(6, b->kb + ((c * 16) * NK + kh * 32) * 2, NK * 4);
                    _tile_loadd(7, b->kb + ((c * 16) * NK + kh * 32 + 16) * 2, NK * 4);
                    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
                }
                _tile_stored(0, b->s + kh * 32, NK * 4);
                _tile_stored(1, b->s + kh * 32 + 16, NK * 4);
                _tile_stored(2, b->s + TR * NK + kh * 32, NK * 4);
                _tile_stored(3, b->s + TR * NK + kh * 32 + 16, NK * 4);
            }
            float alpha[2 * TR];
            for (int64_t i = 0; i < 2 * TR; i++) {
                int64_t r = t * TR + i, lo = 0, hi = 0;
                if (r < unit->rows) lo = job->lo[unit->p0 + r / per_group], hi = job->hi[unit->p0 + r / per_group];
                alpha[i] = softmax_row_bf16(b->s + i * NK, b->p + i * NK, b->m + r, b->l + r, lo, hi, j0, job->scale);
            }
            for (int64_t i = 0; i < 2 * TR; i++) { /* rows whose running maximum moved: their output so far scales */
                if (alpha[i] == 1.0f) continue;
                float *o = b->o + (t * TR + i) * d;
                const __m512 a = _mm512_set1_ps(alpha[i]);
                for (int64_t c = 0; c < d; c += 16) _mm512_storeu_ps(o + c, _mm512_mul_ps(_mm512_loadu_ps(o + c), a));
            }
            float *o0 = b->o + t * TR * d, *o1 = o0 + TR * d;
            for (int64_t c0 = 0; c0 < d; c0 += 32) { /* O += P V, 32 rows x 32 columns at a time, in the tiles */
                _tile_loadd(0, o0 + c0, d * 4);
                _tile_loadd(1, o0 + c0 + 16, d * 4);
                _tile_loadd(2, o1 + c0, d * 4);
                _tile_loadd(3, o1 + c0 + 16, d * 4);
                for (int64_t kc = 0; kc < NK / 32; kc++) {
                    _tile_loadd(4, b->p + kc * 32, NK * 2);
                    _tile_loadd(5, b->p + TR * NK + kc * 32, NK * 2);
                    _tile_loadd(6, b->vb + ((kc * 16) * d + c0) * 2, d * 4);
                    _tile_loadd(7, b->vb + ((kc * 16) * d + c0 + 16) * 2, d * 4);
                    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
                }
                _tile_stored(0, o0 + c0, d * 4);
                _tile_stored(1, o0 + c0 + 16, d * 4);
                _tile_stored(2, o1 + c0, d * 4);
                _tile_stored(3, o1 + c0 + 16, d * 4);
            }
        }
    }
    for (int64_t r = 0; r < unit->rows; r++) {
        int64_t pos = unit->p0 + r / per_group, head = unit->g * per_group + r % per_group;
        const float f = final_factor(b->m[r], b->l[r], job->sinks ? job->sinks + head : NULL, job->scale, exp2_1);
        float *o = b->o + r * d;
        for (int64_t c = 0; c < d; c += 16) _mm512_storeu_ps(o + c, _mm512_mul_ps(_mm512_loadu_ps(o + c), _mm512_set1_ps(f)));
        to_bf16_row((uint16_t *)job->out + head * job->o_head + pos * job->o_row, o, d);
    }
}

static AMX void *worker_bf16(void *arg) {
    job_t *job = arg;
    tile_config_t config = {0};
    config.palette = 1;
    for (int i = 0; i < 8; i++) config.rows[i] = 16, config.colsb[i] = 64;
    _tile_loadconfig(&config);
    const int64_t d = job->dim, rows = job->positions * (job->heads / job->groups) + 2 * TR;
    bf16_buffers b;
    char *memory = aligned_alloc(64, (rows * d * 2 + rows * d * 4 + rows * 8 + 2 * TR * NK * 6 + 2 * NK * d * 2
                                      + (rows / TR + 1) * 16 + 64 * 12) / 64 * 64);
    if (memory == NULL) {
        __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);
        _tile_release();
        return NULL;
    }
    char *at = memory;
#define TAKE(field, type, count) b.field = (type *)at; at += ((count) * sizeof(type) + 63) / 64 * 64;
    TAKE(q, uint16_t, rows * d) TAKE(o, float, rows * d) TAKE(m, float, rows) TAKE(l, float, rows)
    TAKE(s, float, 2 * TR * NK) TAKE(p, uint16_t, 2 * TR * NK) TAKE(kb, uint16_t, NK * d) TAKE(vb, uint16_t, NK * d)
    TAKE(tlo, int64_t, rows / TR + 1) TAKE(thi, int64_t, rows / TR + 1)
#undef TAKE
    for (int64_t u; (u = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED)) < job->units;) {
        unit_t unit = unit_of(job, u);
        unit_bf16(job, &unit, &b);
    }
    free(memory);
    _tile_release();
    return NULL;
}

/* ---------------------------------------------------------------- float32 with AVX2 FMA: its softmax */

/* 2^y for y <= 0 as exp2_512 computes it, 2^n put in the exponent's bits (AVX2 has no scalef); below -126 it is
 * 2^-126 times p, not 0, which no row's sum (at least 1, its maximum's weight) can notice. */
static inline AVX2 __m256 exp2_256(__m256 y) {
    y = _mm256_max_ps(y, _mm256_set1_ps(-126.0f));
    const __m256 n = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_mul_ps(_mm256_sub_ps(y, n), _mm256_set1_ps(0.693147180559945309f));
    static const float terms[] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
    __m256 p = _mm256_set1_ps(terms[0]);
    for (int i = 1; i < 8; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(terms[i]));
    const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(power));
}

static inline AVX2 float exp2_1_avx2(float y) { return _mm256_cvtss_f32(exp2_256(_mm256_set1_ps(y))); }

static inline AVX2 float max_256(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline AVX2 float sum_256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* softmax_row_f32 in 8 lanes: the lanes of keys outside [lo, hi) are hidden by compare masks. */
static inline AVX2 float softmax_row_avx2(float *s, uint16_t *pb, float *m, float *l, int64_t lo, int64_t hi,
                                          int64_t j0, float scale) {
    (void)pb;
    __m256 k[NK / 8];
    const __m256i step = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i first = _mm256_set1_epi32((int32_t)(lo - j0 - 1)), end = _mm256_set1_epi32((int32_t)(hi - j0));
    const __m256 hidden = _mm256_set1_ps(-__builtin_inff());
    __m256 vmax = hidden;
    for (int c = 0; c < NK / 8; c++) { /* key j0 + i is seen when lo - 1 < i - j0 < hi (j0, lo, hi within 2^31) */
        const __m256i at = _mm256_add_epi32(step, _mm256_set1_epi32(8 * c));
        k[c] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(at, first), _mm256_cmpgt_epi32(end, at)));
        vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(hidden, _mm256_loadu_ps(s + 8 * c), k[c]));
    }
    const float block_max = max_256(vmax);
    if (block_max == -__builtin_inff()) { /* nothing visible */
        memset(s, 0, NK * sizeof(float));
        return 1.0f;
    }
    const float m_new = block_max > *m ? block_max : *m, c2 = scale * LOG2E;
    const float alpha = *m == m_new ? 1.0f : *m == -__builtin_inff() ? 0.0f : exp2_1_avx2((*m - m_new) * c2);
    const __m256 vc = _mm256_set1_ps(c2), vmc = _mm256_set1_ps(m_new * c2);
    __m256 sum = _mm256_setzero_ps();
    for (int c = 0; c < NK / 8; c++) {
        const __m256 p = _mm256_and_ps(k[c], exp2_256(_mm256_fmsub_ps(_mm256_loadu_ps(s + 8 * c), vc, vmc)));
        sum = _mm256_add_ps(sum, p);
        _mm256_storeu_ps(s + 8 * c, p);
    }
    *l = *l * alpha + sum_256(sum);
    *m = m_new;
    return alpha;
}

/* ---------------------------------------------------------------- float32 with AVX-512 or AVX2 FMA */

typedef struct {
    float *q, *o, *m, *l, *s, *kt; /* kt: dim x NK, the block's keys transposed */
    int64_t *tlo, *thi;
} f32_buffers;

/* A unit in float32 on vectors of type V (W lanes: load, store, set1, zero, fma, mul), SOFTMAX and EXP2_1 the
 * ISA's own, R rows x W·C keys or columns per register tile. */
#define UNIT_F32(name, target, V, W, load, store, set1, zero, fma, mul, SOFTMAX, EXP2_1, R, C)                          \
static target void name(const job_t *job, const unit_t *unit, f32_buffers *b) {                                        \
    const int64_t d = job->dim, per_group = job->heads / job->groups;                                                  \
    const int64_t tiles = (unit->rows + TR - 1) / TR;                                                                  \
    const float *k = (const float *)job->k + unit->g * job->k_head, *v = (const float *)job->v + unit->g * job->v_head; \
    int64_t first, last;                                                                                               \
    start_unit(job, unit, tiles, sizeof(float), b->q, b->o, b->m, b->l, b->tlo, b->thi, &first, &last);               \
    for (int64_t j0 = first; j0 < last; j0 += NK) {                                                                    \
        const int64_t keys = last - j0 < NK ? last - j0 : NK;                                                          \
        for (int64_t j = 0; j < NK; j++) {                                                                             \
            const float *kj = k + (j0 + j) * job->k_row;                                                               \
            for (int64_t c = 0; c < d; c++) b->kt[c * NK + j] = j < keys ? kj[c] : 0.0f;                               \
        }                                                                                                              \
        for (int64_t t = 0; t < tiles; t++) {                                                                          \
            if (b->thi[t] <= j0 || b->tlo[t] >= j0 + NK) continue;                                                     \
            /* S = Q Kᵀ, R rows x W·C keys at a time */                                                                \
            for (int64_t r0 = t * TR; r0 < t * TR + TR; r0 += R) {                                                     \
                for (int64_t j1 = 0; j1 < NK; j1 += W * C) {                                                           \
                    V acc[R][C];                                                                                       \
                    for (int i = 0; i < R; i++)                                                                        \
                        for (int c = 0; c < C; c++) acc[i][c] = zero();                                                \
                    for (int64_t e = 0; e < d; e++) {                                                                  \
                        V kt[C];                                                                                       \
                        for (int c = 0; c < C; c++) kt[c] = load(b->kt + e * NK + j1 + W * c);                         \
                        _Pragma("GCC unroll 8")                                                                        \
                        for (int i = 0; i < R; i++) {                                                                  \
                            const V x = set1(b->q[(r0 + i) * d + e]);                                                  \
                            for (int c = 0; c < C; c++) acc[i][c] = fma(x, kt[c], acc[i][c]);                          \
                        }                                                                                              \
                    }                                                                                                  \
                    for (int i = 0; i < R; i++)                                                                        \
                        for (int c = 0; c < C; c++) store(b->s + (r0 - t * TR + i) * NK + j1 + W * c, acc[i][c]);      \
                }                                                                                                      \
            }                                                                                                          \
            float alpha[TR];                                                                                           \
            for (int64_t i = 0; i < TR; i++) {                                                                         \
                int64_t r = t * TR + i, lo = 0, hi = 0;                                                                \
                if (r < unit->rows) lo = job->lo[unit->p0 + r / per_group], hi = job->hi[unit->p0 + r / per_group];    \
                alpha[i] = SOFTMAX(b->s + i * NK, NULL, b->m + r, b->l + r, lo, hi, j0, job->scale);                   \
            }                                                                                                          \
            /* O = O·alpha + P V, R rows x W·C columns at a time */                                                    \
            for (int64_t r0 = 0; r0 < TR; r0 += R) {                                                                   \
                for (int64_t c0 = 0; c0 < d; c0 += W * C) {                                                            \
                    V acc[R][C];                                                                                       \
                    for (int i = 0; i < R; i++) {                                                                      \
                        const V a = set1(alpha[r0 + i]);                                                               \
                        for (int c = 0; c < C; c++)                                                                    \
                            acc[i][c] = mul(load(b->o + (t * TR + r0 + i) * d + c0 + W * c), a);                       \
                    }                                                                                                  \
                    for (int64_t j = 0; j < keys; j++) {                                                               \
                        V vj[C];                                                                                       \
                        for (int c = 0; c < C; c++) vj[c] = load(v + (j0 + j) * job->v_row + c0 + W * c);              \
                        _Pragma("GCC unroll 8")                                                                        \
                        for (int i = 0; i < R; i++) {                                                                  \
                            const V x = set1(b->s[(r0 + i) * NK + j]);                                                 \
                            for (int c = 0; c < C; c++) acc[i][c] = fma(x, vj[c], acc[i][c]);                          \
                        }                                                                                              \
                    }                                                                                                  \
                    for (int i = 0; i < R; i++)                                                                        \
                        for (int c = 0; c < C; c++) store(b->o + (t * TR + r0 + i) * d + c0 + W * c, acc[i][c]);      \
                }                                                                                                      \
            }                                                                                                          \
        }                                                                                                              \
    }                                                                                                                  \
    for (int64_t r = 0; r < unit->rows; r++) {                                                                         \
        int64_t pos = unit->p0 + r / per_group, head = unit->g * per_group + r % per_group;                            \
        const V f = set1(final_factor(b->m[r], b->l[r], job->sinks ? job->sinks + head : NULL, job->scale, EXP2_1));   \
        float *out = (float *)job->out + head * job->o_head + pos * job->o_row;                                        \
        for (int64_t c = 0; c < d; c += W) store(out + c, mul(load(b->o + r * d + c), f));                             \
    }                                                                                                                  \
}

UNIT_F32(unit_f32, AVX512, __m512, 16, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_set1_ps, _mm512_setzero_ps,
         _mm512_fmadd_ps, _mm512_mul_ps, softmax_row_f32, exp2_1, MR, MC)
UNIT_F32(unit_f32_avx2, AVX2, __m256, 8, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_set1_ps, _mm256_setzero_ps,
         _mm256_fmadd_ps, _mm256_mul_ps, softmax_row_avx2, exp2_1_avx2, MR2, MC2)

/* A float32 thread: its buffers, then units until none is left, each run by `unit`. */
static void *work_f32(job_t *job, void (*unit_body)(const job_t *, const unit_t *, f32_buffers *)) {
    const int64_t d = job->dim, rows = job->positions * (job->heads / job->groups) + TR;
    f32_buffers b;
    char *memory = aligned_alloc(64, (rows * d * 8 + rows * 8 + TR * NK * 4 + NK * d * 4 + (rows / TR + 1) * 16 + 64 * 8)
                                     / 64 * 64 + 64);
    if (memory == NULL) {
        __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);
        return NULL;
    }
    char *at = memory;
#define TAKE(field, type, count) b.field = (type *)at; at += ((count) * sizeof(type) + 63) / 64 * 64;
    TAKE(q, float, rows * d) TAKE(o, float, rows * d) TAKE(m, float, rows) TAKE(l, float, rows)
    TAKE(s, float, TR * NK) TAKE(kt, float, NK * d) TAKE(tlo, int64_t, rows / TR + 1) TAKE(thi, int64_t, rows / TR + 1)
#undef TAKE
    for (int64_t u; (u = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED)) < job->units;) {
        unit_t unit = unit_of(job, u);
        unit_body(job, &unit, &b);
    }
    free(memory);
    return NULL;
}

static void *worker_f32(void *arg) { return work_f32(arg, unit_f32); }
static void *worker_f32_avx2(void *arg) { return work_f32(arg, unit_f32_avx2); }

/* ---------------------------------------------------------------- entry points */

/* Asks Linux for the AMX tile state (once per process); 0 when granted. */
int npumoe_attention_amx_init(void) {
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0 ? 0 : -1;
}

static int run(job_t *job, void *(*worker)(void *), int64_t threads) {
    pthread_t ids[64];
    int64_t started = 0;
    if (threads > 64) threads = 64;
    for (int64_t i = 1; i < threads; i++) {
        if (pthread_create(&ids[started], NULL, worker, job) != 0) break;
        started++;
    }
    worker(job);
    for (int64_t i = 0; i < started; i++) pthread_join(ids[i], NULL);
    return job->failed ? -1 : 0;
}

/* q (heads, rows, dim) with strides; k, v (groups, keys, dim); out (heads, rows, dim). dim % 64 == 0, <= 256;
 * heads % groups == 0. Returns 0, or -1 when a thread could not get its buffers. */
#define ENTRY(name, worker)                                                                                           \
    int name(const void *q, int64_t q_head, int64_t q_row, const void *k, int64_t k_head, int64_t k_row,            \
             const void *v, int64_t v_head, int64_t v_row, void *out, int64_t o_head, int64_t o_row,               \
             const int64_t *lo, const int64_t *hi, const float *sinks, int64_t heads, int64_t groups, int64_t rows, \
             int64_t dim, float scale, int64_t positions, int64_t threads) {                                       \
        if (dim % 64 || dim > MAX_DIM || heads % groups || positions < 1) return -2;                              \
        job_t job = {q, k, v, out, q_head, q_row, k_head, k_row, v_head, v_row, o_head, o_row, lo, hi, sinks,     \
                     heads, groups, rows, dim, positions, scale, groups * ((rows + positions - 1) / positions), 0, 0}; \
        return run(&job, worker, threads);                                                                        \
    }
ENTRY(npumoe_attention_bf16_amx, worker_bf16)
ENTRY(npumoe_attention_f32, worker_f32)
ENTRY(npumoe_attention_f32_avx2, worker_f32_avx2)

/* Each row of a (rows, keys) boolean mask as the one run of keys it shows: lo, hi per row (0, 0 for none).
 * Returns 0, or -1 when a row shows keys apart from each other (the mask is not ranges). */
int npumoe_mask_ranges(const uint8_t *mask, int64_t rows, int64_t keys, int64_t stride, int64_t *lo, int64_t *hi) {
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = mask + r * stride, *first = memchr(row, 1, keys);
        lo[r] = hi[r] = 0;
        if (first == NULL) continue;
        const uint8_t *end = memchr(first, 0, keys - (first - row));
        const int64_t a = first - row, b = end == NULL ? keys : end - row;
        if (b < keys && memchr(row + b, 1, keys - b) != NULL) return -1;
        lo[r] = a, hi[r] = b;
    }
    return 0;
}
