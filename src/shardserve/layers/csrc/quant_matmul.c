/* Matrix products against GGUF block-quantized weights, for the CPU, kept in their file formats.
 *
 * y[M, N] = x[M, K] . W[N, K]^T where each row of W is a run of blocks in one of llama.cpp's
 * formats: Q4_0, Q4_1, Q8_0 (blocks of 32) and Q4_K, Q6_K (super-blocks of 256). Memory holds
 * only the blocks: 4.5-8.5 bits per weight instead of 32, which is what a one-row (decode)
 * product is bound by.
 *
 * Arithmetic: the activations are rounded to 16-bit fixed point per block of 32 (a float step
 * d = max|x| / 32767, so each value is off by at most d / 2: a relative 1.5e-5 of the block's
 * largest), and each weight block is widened to 16-bit integers and multiplied with AVX2's
 * 16-bit multiply-add; one float multiply-add per block applies the scales. Per block:
 *   sum_i (s q_i + m) x_i = s d_x (q . x_q) + m sum(x).
 * (llama.cpp rounds the activations to 8 bits instead, 256x coarser: a small model such as
 * SmolLM2-135M then drifts off its float answers. 16 bits keep them, at ~2x the speed of
 * widening every weight to a float.)
 *
 * From GEMM_ROWS activation rows on (prefill, many streams) the weight is expanded to floats 16
 * rows at a time instead and multiplied by a register-blocked float GEMM (exact to float
 * rounding; see gemm_rows).
 *
 * `qmatmul` threads over the rows of W (torch's OpenMP pool). `qmatmul_rows` is the same work
 * for a range of rows, for callers inside a parallel region of their own (decode_loop.c).
 * `qdequant` expands chosen rows to floats (embedding look-ups).
 *
 * Without AVX2 a row is expanded by the plain loops below (the readable statement of each
 * format) and multiplied in float.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };
#define QK 32   /* activation block */
#define QKK 256 /* K-quant super-block */

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 0) {
        if (man == 0) { bits = sign; }
        else { /* subnormal: normalise */
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 1024));
            bits = sign | (uint32_t)(127 - 15 - e) << 23 | (man & 1023) << 13;
        }
    } else if (exp == 31) { bits = sign | 0x7f800000u | man << 13; }
    else { bits = sign | (exp + 127 - 15) << 23 | man << 13; }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* Q4_K packs eight 6-bit (scale, min) pairs into 12 bytes. */
static inline void k4_scale_min(const uint8_t *q, int j, int *sc, int *m) {
    if (j < 4) { *sc = q[j] & 63; *m = q[j + 4] & 63; }
    else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* ------------------------------------------------------------------ dequantize one row */

__attribute__((unused)) static void dequant_row(int type, const uint8_t *w, int64_t k, float *y) {
    if (type == Q4_0 || type == Q4_1 || type == Q8_0) {
        int64_t bytes = type == Q4_0 ? 18 : type == Q4_1 ? 20 : 34;
        for (int64_t b = 0; b < k / QK; b++, w += bytes, y += QK) {
            float d = f16(w);
            if (type == Q8_0) {
                for (int i = 0; i < QK; i++) y[i] = d * (int8_t)w[2 + i];
                continue;
            }
            float m = type == Q4_1 ? f16(w + 2) : -8.0f * d;
            const uint8_t *qs = w + (type == Q4_1 ? 4 : 2);
            for (int i = 0; i < 16; i++) {
                y[i] = d * (qs[i] & 0xF) + m;
                y[i + 16] = d * (qs[i] >> 4) + m;
            }
        }
    } else if (type == Q4_K) {
        for (int64_t b = 0; b < k / QKK; b++, w += 144) {
            float d = f16(w), dmin = f16(w + 2);
            const uint8_t *sc = w + 4, *qs = w + 16;
            for (int j = 0; j < 8; j += 2, qs += 32) {
                int s0, m0, s1, m1;
                k4_scale_min(sc, j, &s0, &m0);
                k4_scale_min(sc, j + 1, &s1, &m1);
                for (int i = 0; i < 32; i++) *y++ = d * s0 * (qs[i] & 0xF) - dmin * m0;
                for (int i = 0; i < 32; i++) *y++ = d * s1 * (qs[i] >> 4) - dmin * m1;
            }
        }
    } else { /* Q6_K: ql[128] qh[64] scales[16] d */
        for (int64_t b = 0; b < k / QKK; b++, w += 210) {
            const uint8_t *ql = w, *qh = w + 128;
            const int8_t *sc = (const int8_t *)(w + 192);
            float d = f16(w + 208);
            for (int half = 0; half < 2; half++, ql += 64, qh += 32, sc += 8, y += 128) {
                for (int l = 0; l < 32; l++) {
                    int is = l / 16;
                    y[l] = d * sc[is] * (((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32);
                    y[l + 32] = d * sc[is + 2] * (((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
                    y[l + 64] = d * sc[is + 4] * (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                    y[l + 96] = d * sc[is + 6] * (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
                }
            }
        }
    }
}

/* ------------------------------------------------------------------ activations to 16 bits */

/* xq = round(x / d) with d = max|x| / 32767 per block of 32; xd = d; xs = the block's float sum. */
static void quantize16(const float *x, int64_t k, int16_t *xq, float *xd, float *xs) {
    for (int64_t b = 0; b < k / QK; b++, x += QK, xq += QK) {
        float amax = 0.0f, sum = 0.0f;
        for (int i = 0; i < QK; i++) { amax = fmaxf(amax, fabsf(x[i])); sum += x[i]; }
        float d = amax / 32767.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
        for (int i = 0; i < QK; i++) xq[i] = (int16_t)lrintf(x[i] * inv);
        xd[b] = d;
        xs[b] = sum;
    }
}

typedef struct {
    int16_t *q;
    float *d, *s;
    int64_t k; /* row length; rows are k apart in q, k / 32 apart in d and s */
} Acts;

static void quantize_rows(const float *x, int64_t m, int64_t ldx, int64_t k, const Acts *a) {
    for (int64_t i = 0; i < m; i++) quantize16(x + i * ldx, k, a->q + i * k, a->d + i * (k / QK), a->s + i * (k / QK));
}

/* ------------------------------------------------------------------ one weight row . up to 4 rows */

#define ROWS 4

#ifdef __AVX2__
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Block b (32 weights) of a row as 16-bit integers: lo = weights 0..15, hi = 16..31; the
 * block's weights are s_lo * lo + min and s_hi * hi + min (s_lo == s_hi except in Q6_K, whose
 * scales cover 16 weights). */
typedef struct {
    __m256i lo, hi;
    float s_lo, s_hi, min;
} Block;

static inline __attribute__((always_inline)) Block block16(const int type, const uint8_t *row, int64_t b) {
    Block k;
    const __m128i m4 = _mm_set1_epi8(0x0F);
    if (type == Q4_0 || type == Q4_1) {
        const uint8_t *blk = row + b * (type == Q4_1 ? 20 : 18);
        __m128i t = _mm_loadu_si128((const __m128i *)(blk + (type == Q4_1 ? 4 : 2)));
        k.lo = _mm256_cvtepu8_epi16(_mm_and_si128(t, m4));
        k.hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(t, 4), m4));
        k.s_lo = k.s_hi = f16(blk);
        k.min = type == Q4_1 ? f16(blk + 2) : -8.0f * k.s_lo;
    } else if (type == Q8_0) {
        const uint8_t *blk = row + b * 34;
        k.lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 2)));
        k.hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 18)));
        k.s_lo = k.s_hi = f16(blk);
        k.min = 0.0f;
    } else if (type == Q4_K) {
        const uint8_t *blk = row + (b / 8) * 144, *qs = blk + 16 + ((b % 8) / 2) * 32;
        int j = (int)(b % 8), sc, m;
        k4_scale_min(blk + 4, j, &sc, &m);
        __m128i t0 = _mm_loadu_si128((const __m128i *)qs), t1 = _mm_loadu_si128((const __m128i *)(qs + 16));
        if (j & 1) { t0 = _mm_srli_epi16(t0, 4); t1 = _mm_srli_epi16(t1, 4); }
        k.lo = _mm256_cvtepu8_epi16(_mm_and_si128(t0, m4));
        k.hi = _mm256_cvtepu8_epi16(_mm_and_si128(t1, m4));
        k.s_lo = k.s_hi = f16(blk) * sc;
        k.min = -f16(blk + 2) * m;
    } else { /* Q6_K: group g of half h */
        const uint8_t *blk = row + (b / 8) * 210;
        int h = (int)(b % 8) / 4, g = (int)(b % 4);
        const uint8_t *ql = blk + h * 64 + (g & 1) * 32, *qh = blk + 128 + h * 32;
        const int8_t *sc = (const int8_t *)(blk + 192) + h * 8 + 2 * g;
        __m256i l = _mm256_loadu_si256((const __m256i *)ql), hb = _mm256_loadu_si256((const __m256i *)qh);
        if (g >= 2) l = _mm256_srli_epi16(l, 4);
        l = _mm256_and_si256(l, _mm256_set1_epi8(0x0F));
        hb = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * g), _mm256_set1_epi8(3));
        __m256i q = _mm256_sub_epi8(_mm256_or_si256(l, _mm256_slli_epi16(hb, 4)), _mm256_set1_epi8(32));
        k.lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q));
        k.hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1));
        float d = f16(blk + 208);
        k.s_lo = d * sc[0];
        k.s_hi = d * sc[1];
        k.min = 0.0f;
    }
    return k;
}

/* acc += block k . activation block (xv: 32 int16, dx its step); Q4/Q8/Q4_K's minimum apart. */
static inline __attribute__((always_inline)) __m256 block_fma(const int type, Block k, const __m256i *xv, float dx,
                                                              __m256 acc) {
    __m256i p0 = _mm256_madd_epi16(k.lo, _mm256_loadu_si256(xv));
    __m256i p1 = _mm256_madd_epi16(k.hi, _mm256_loadu_si256(xv + 1));
    if (type == Q6_K) {
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(k.s_lo * dx), acc);
        return _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(k.s_hi * dx), acc);
    }
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)), _mm256_set1_ps(k.s_lo * dx), acc);
}

/* One activation row (decode at batch 1): two blocks per step into two accumulators, so the
 * multiply-add chains of neighbouring blocks overlap. */
static inline __attribute__((always_inline)) float row_dot1(const int type, const uint8_t *row, const Acts *a,
                                                            int64_t i) {
    int64_t nb = a->k / QK;
    const int16_t *xq = a->q + i * a->k;
    const float *xd = a->d + i * nb, *xs = a->s + i * nb;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float off = 0.0f;
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        Block k0 = block16(type, row, b), k1 = block16(type, row, b + 1);
        acc0 = block_fma(type, k0, (const __m256i *)(xq + b * QK), xd[b], acc0);
        acc1 = block_fma(type, k1, (const __m256i *)(xq + (b + 1) * QK), xd[b + 1], acc1);
        off += k0.min * xs[b] + k1.min * xs[b + 1];
    }
    if (b < nb) {
        Block k0 = block16(type, row, b);
        acc0 = block_fma(type, k0, (const __m256i *)(xq + b * QK), xd[b], acc0);
        off += k0.min * xs[b];
    }
    return hsum(_mm256_add_ps(acc0, acc1)) + off;
}

/* out[j] = x_j . row for j < nr (<= ROWS), x_j given as 16-bit blocks. always_inline with a
 * constant type specializes the block decoder per format. */
static inline __attribute__((always_inline)) void row_times(const int type, const uint8_t *row, const Acts *a,
                                                            int64_t i0, int nr, float *out) {
    int64_t nb = a->k / QK;
    __m256 acc[ROWS];
    float off[ROWS];
    for (int j = 0; j < ROWS; j++) { acc[j] = _mm256_setzero_ps(); off[j] = 0.0f; }
    for (int64_t b = 0; b < nb; b++) {
        Block k = block16(type, row, b);
        for (int j = 0; j < nr; j++) {
            acc[j] = block_fma(type, k, (const __m256i *)(a->q + (i0 + j) * a->k + b * QK), a->d[(i0 + j) * nb + b],
                               acc[j]);
            off[j] += k.min * a->s[(i0 + j) * nb + b];
        }
    }
    for (int j = 0; j < nr; j++) out[j] = hsum(acc[j]) + off[j];
}
#endif

static int known(int type) {
    return type == Q4_0 || type == Q4_1 || type == Q8_0 || type == Q4_K || type == Q6_K;
}

static int fits(int type, int64_t k) { return known(type) && k % ((type == Q4_K || type == Q6_K) ? QKK : QK) == 0; }

/* Row `wr` of W as k floats. */
static void expand_row(int type, const uint8_t *wr, int64_t k, float *o) {
#ifdef __AVX2__
    for (int64_t b = 0; b < k / QK; b++, o += QK) {
        Block q;
        switch (type) { /* constant types, so block16 specializes */
        case Q4_0: q = block16(Q4_0, wr, b); break;
        case Q4_1: q = block16(Q4_1, wr, b); break;
        case Q8_0: q = block16(Q8_0, wr, b); break;
        case Q4_K: q = block16(Q4_K, wr, b); break;
        default: q = block16(Q6_K, wr, b); break;
        }
        __m256 m = _mm256_set1_ps(q.min), s0 = _mm256_set1_ps(q.s_lo), s1 = _mm256_set1_ps(q.s_hi);
        __m256i part[4] = {_mm256_cvtepi16_epi32(_mm256_castsi256_si128(q.lo)),
                           _mm256_cvtepi16_epi32(_mm256_extracti128_si256(q.lo, 1)),
                           _mm256_cvtepi16_epi32(_mm256_castsi256_si128(q.hi)),
                           _mm256_cvtepi16_epi32(_mm256_extracti128_si256(q.hi, 1))};
        for (int i = 0; i < 4; i++)
            _mm256_storeu_ps(o + 8 * i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(part[i]), i < 2 ? s0 : s1, m));
    }
#else
    dequant_row(type, wr, k, o);
#endif
}

#include "quant_gemm.c"

/* Whether m activation rows take the 16-bit path (and so need quantized activations). */
static int uses_acts(int64_t m) {
#ifdef __AVX2__
    return m < GEMM_ROWS;
#else
    (void)m;
    return 0;
#endif
}

/* Scratch floats one thread's float GEMM needs for rows of k weights. */
static size_t gemm_scratch(int64_t k) { return sizeof(float) * (size_t)((NR + 8) * k); }

/* y[i * ldy + r] = x_i . W[r] for i < m and r0 <= r < r1: the 16-bit path on `a` (x quantized)
 * when uses_acts(m), else the float GEMM on x with `wp` (gemm_scratch(k) bytes). No threads of
 * its own. */
static void qmatmul_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, const Acts *a,
                         const float *x, int64_t ldx, int64_t m, float *y, int64_t ldy, float *wp) {
    if (!uses_acts(m)) {
        gemm_rows(type, w, row_bytes, r0, r1, x, ldx, m, a->k, y, ldy, wp, wp + NR * a->k);
        return;
    }
#ifdef __AVX2__
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *wr = w + r * row_bytes;
        if (m == 1) {
            switch (type) {
            case Q4_0: y[r] = row_dot1(Q4_0, wr, a, 0); break;
            case Q4_1: y[r] = row_dot1(Q4_1, wr, a, 0); break;
            case Q8_0: y[r] = row_dot1(Q8_0, wr, a, 0); break;
            case Q4_K: y[r] = row_dot1(Q4_K, wr, a, 0); break;
            default: y[r] = row_dot1(Q6_K, wr, a, 0); break;
            }
            continue;
        }
        for (int64_t i = 0; i < m; i += ROWS) {
            int nr = m - i < ROWS ? (int)(m - i) : ROWS;
            float out[ROWS];
            if (nr == ROWS) { /* a constant row count: the compiler unrolls and keeps acc in registers */
                switch (type) {
                case Q4_0: row_times(Q4_0, wr, a, i, ROWS, out); break;
                case Q4_1: row_times(Q4_1, wr, a, i, ROWS, out); break;
                case Q8_0: row_times(Q8_0, wr, a, i, ROWS, out); break;
                case Q4_K: row_times(Q4_K, wr, a, i, ROWS, out); break;
                default: row_times(Q6_K, wr, a, i, ROWS, out); break;
                }
            } else {
                switch (type) {
                case Q4_0: row_times(Q4_0, wr, a, i, nr, out); break;
                case Q4_1: row_times(Q4_1, wr, a, i, nr, out); break;
                case Q8_0: row_times(Q8_0, wr, a, i, nr, out); break;
                case Q4_K: row_times(Q4_K, wr, a, i, nr, out); break;
                default: row_times(Q6_K, wr, a, i, nr, out); break;
                }
            }
            for (int j = 0; j < nr; j++) y[(i + j) * ldy + r] = out[j];
        }
    }
#endif
}

static int acts_alloc(Acts *a, int64_t m, int64_t k) {
    a->k = k;
    a->q = malloc(sizeof(int16_t) * (size_t)(m * k));
    a->d = malloc(sizeof(float) * (size_t)(m * (k / QK)));
    a->s = malloc(sizeof(float) * (size_t)(m * (k / QK)));
    return a->q && a->d && a->s;
}

static void acts_free(Acts *a) { free(a->q); free(a->d); free(a->s); }

/* ------------------------------------------------------------------ entry points */

/* y[i * ldy + r] = x[i] . W[r] for i < m, r < n. Returns 0, 1 for an unknown format or a K
 * that is not whole blocks, 2 when scratch memory cannot be allocated. */
int qmatmul(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const float *x,
            int64_t m, int64_t ldx, float *y, int64_t ldy, int nthreads) {
    if (!fits(type, k)) return 1;
    Acts a = {NULL, NULL, NULL, k};
    if (uses_acts(m)) {
        if (!acts_alloc(&a, m, k)) { acts_free(&a); return 2; }
        quantize_rows(x, m, ldx, k, &a);
    }
    int err = 0;
#pragma omp parallel num_threads(nthreads)
    {
        int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        float *wp = uses_acts(m) ? NULL : malloc(gemm_scratch(k));
        if (!uses_acts(m) && !wp) {
#pragma omp atomic write
            err = 2;
        } else {
            qmatmul_rows(type, w, row_bytes, n * tid / nth, n * (tid + 1) / nth, &a, x, ldx, m, y, ldy, wp);
        }
        free(wp);
    }
    acts_free(&a);
    return err;
}

/* out[j] (k floats) = row rows[j] of W (or row j when rows is NULL) for j < count. */
int qdequant(int type, const uint8_t *w, int64_t row_bytes, int64_t k, const int64_t *rows, int64_t count,
             float *out, int nthreads) {
    if (!fits(type, k)) return 1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (count > 64)
    for (int64_t j = 0; j < count; j++) expand_row(type, w + (rows ? rows[j] : j) * row_bytes, k, out + j * k);
    return 0;
}
