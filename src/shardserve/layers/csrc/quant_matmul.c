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
 * SmolLM2-135M then drifts off its float answers. 16 bits keep them, and still run faster than
 * widening every weight to a float.)
 *
 * A layer's Q4_0, Q4_1 and Q8_0 weights are held interleaved 16 rows at a time (quant_x16.c) and
 * take that 16-bit path at every number of rows: one arithmetic whatever the batch (batch-
 * invariant results), and faster than the paths below at every size measured. For the other
 * formats (and the native layouts), from a few activation rows on (prefill, many streams; see
 * product_path) the weight is expanded to floats instead and multiplied by a register-blocked
 * float GEMM (exact to float rounding; quant_gemm.c).
 *
 * Plain float32 rows (type F32) take the same entry points (the float GEMMs); the layers hold
 * them in the x16 layout (quant_x16.c), so float checkpoints share the decode loop.
 *
 * `qmatmul` threads over the rows of W (torch's OpenMP pool; quant_threads.c, included last).
 * `qmatmul_rows` is the same work for a range of rows, for callers inside a parallel region of
 * their own (decode_loop.c).
 * `qdequant` expands chosen rows to floats (embedding look-ups).
 *
 * Without AVX2 a row is expanded by the plain loops of quant_formats.c (the readable statement
 * of each format) and multiplied in float.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "quant_formats.c"
#include "quant_acts.c" /* the activations' 16-bit rounding and buffers */
#include "quant_x16.c"
#include "quant_x16_float.c"
#include "quant_amx.c"
#include "quant_amx_i8.c"

/* ------------------------------------------------------------------ one weight row . up to 8 rows */


#ifdef __AVX2__
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
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

/* out[j] = x_j . row for j < nr (<= QROWS), x_j given as 16-bit blocks: each weight block is
 * decoded once for all nr rows. always_inline with a constant type and nr specializes the block
 * decoder per format and unrolls the rows; the accumulators are named variables (see
 * panel_micro in quant_gemm.c). */
#define QROWS 8
static inline __attribute__((always_inline)) void row_times(const int type, const int nr, const uint8_t *row,
                                                            const Acts *a, int64_t i0, float *out) {
    int64_t nb = a->k / QK, k = a->k;
    const __m256 z = _mm256_setzero_ps();
    __m256 c0 = z, c1 = z, c2 = z, c3 = z, c4 = z, c5 = z, c6 = z, c7 = z;
    float o0 = 0.0f, o1 = 0.0f, o2 = 0.0f, o3 = 0.0f, o4 = 0.0f, o5 = 0.0f, o6 = 0.0f, o7 = 0.0f;
    const int16_t *xq = a->q + i0 * k;
    const float *xd = a->d + i0 * nb, *xs = a->s + i0 * nb;
    for (int64_t b = 0; b < nb; b++) {
        Block w = block16(type, row, b);
#define ROW_FMA(j)                                                                                    \
    if (nr > j) {                                                                                     \
        c##j = block_fma(type, w, (const __m256i *)(xq + j * k + b * QK), xd[j * nb + b], c##j);      \
        o##j += w.min * xs[j * nb + b];                                                               \
    }
        ROW_FMA(0) ROW_FMA(1) ROW_FMA(2) ROW_FMA(3) ROW_FMA(4) ROW_FMA(5) ROW_FMA(6) ROW_FMA(7)
#undef ROW_FMA
    }
#define ROW_OUT(j) \
    if (nr > j) out[j] = hsum(c##j) + o##j;
    ROW_OUT(0) ROW_OUT(1) ROW_OUT(2) ROW_OUT(3) ROW_OUT(4) ROW_OUT(5) ROW_OUT(6) ROW_OUT(7)
#undef ROW_OUT
}

/* row_times() for nr rows, nr a constant in each case. */
static inline __attribute__((always_inline)) void rows_of(const int type, int nr, const uint8_t *row, const Acts *a,
                                                          int64_t i0, float *out) {
    switch (nr) {
    case 8: row_times(type, 8, row, a, i0, out); break;
    case 7: row_times(type, 7, row, a, i0, out); break;
    case 6: row_times(type, 6, row, a, i0, out); break;
    case 5: row_times(type, 5, row, a, i0, out); break;
    case 4: row_times(type, 4, row, a, i0, out); break;
    case 3: row_times(type, 3, row, a, i0, out); break;
    case 2: row_times(type, 2, row, a, i0, out); break;
    default: row_times(type, 1, row, a, i0, out); break;
    }
}
#endif

#include "quant_gemm.c"

/* How a product of m activation rows runs, by the weight's type: x16 layouts always on their
 * groups (X16_GROUPS, or from I8_ROWS rows X16_AMX where the CPU has AMX-INT8: the same
 * numbers); otherwise (crossovers measured on
 * SmolLM2's decode steps): the 16-bit path (ACTS16) while decoding a block costs less than
 * expanding the weight to floats (below 10 rows for 4-bit blocks, below 13 for Q8_0, whose
 * bytes widen directly); then the float GEMM on activation panels (plain F32 rows from the
 * first row), and from STRIP_ROWS on weight strips. Without AVX2 every block format takes the
 * float GEMMs. */
enum { ACTS16, PANELS, STRIPS, X16_GROUPS, F32_X16, BF16_AMX, BF16_DP, X16_AMX };

static int product_path(int type, int64_t m) {
    if (type == (X16 | BF16)) /* every m: quant_amx.c says which and why */
        return amx_ready() ? BF16_AMX : dpbf_ready() ? BF16_DP : F32_X16;
    if (type == (X16 | F32)) return F32_X16; /* every m: see quant_x16_float.c */
    if (is_x16(type)) return i8_ready() && m >= I8_ROWS ? X16_AMX : X16_GROUPS; /* the same numbers */
    if (m >= STRIP_ROWS) return STRIPS;
    if (type == F32 || type == BF16) return PANELS;
#ifdef __AVX2__
    if (m < (type == Q8_0 ? 13 : 10)) return ACTS16;
#endif
    return PANELS;
}

#define SHARE_ROWS 256 /* activation rows from which threads take even shares (claim_grain) */

/* Rows of W a thread claims at a time in whole blocks of its kernel: 6 (panels) or 16. */
static int64_t claim_grain(int type, int64_t m, int64_t total, int nth) {
    int path = product_path(type, m);
    /* F32_X16, BF16_DP: a tile of 4 groups below 8 rows (4 chains a row), of 2 groups by 8 rows
     * from 8 (f32x16_rows); BF16_AMX: 2 groups a tile pass. The grain is one tile: a longer one
     * only lengthens the last claims, which the other threads wait for at the barrier. Over
     * SHARE_ROWS activation rows or more, the paths that take all the rows at once (AMX, F32_X16,
     * BF16_DP, X16_AMX): a thread's even share of the weight rows, one claim each, since every
     * claim passes over all the activation rows (amx_rows, f32x16_rows, i8_rows), which outgrow
     * L2. */
    if ((path == F32_X16 || path == BF16_DP || path == BF16_AMX || path == X16_AMX) && m >= SHARE_ROWS)
        return ((total + nth - 1) / nth + 63) / 64 * 64;
    if (path == F32_X16 || path == BF16_DP) return m >= 8 ? 32 : 64;
    return path == PANELS ? NW : path == BF16_AMX ? 32 : 16;
}

/* Scratch bytes one thread's products on `paths` need for rows of k weights: a float GEMM's,
 * also >= the 16 rows of an x16 weight's padded last group (at most 4 bytes a weight); then
 * X16_AMX's unpacked panel. */
static size_t gemm_scratch(int64_t k, int paths) {
    return sizeof(float) * (size_t)((NR + 8) * k + 16 * 32) + (paths & (1 << X16_AMX) ? i8_scratch(k) : 0);
}
/* (>= NW * k floats; AMX: >= 16 * k + 16 * (k rounded up to 32) bfloat16, amx_rows) */

#include "quant_acts_buffers.c" /* acts_alloc, acts_rows, acts_part, acts_free */

/* qmatmul_rows on one path for all m rows. */
static void path_rows(int path, int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t r0, int64_t r1,
                      const Acts *a, const float *x, int64_t ldx, int64_t m, float *y, int64_t ldy, float *wp) {
    switch (path) {
    case X16_GROUPS: x16_rows(type, w, row_bytes, n, r0, r1, a, y, ldy, (uint8_t *)wp); return;
#if AMX_I8_BUILT
    case X16_AMX: i8_rows(type, w, row_bytes, n, r0, r1, a, y, ldy, (uint8_t *)wp); return;
#endif
    case F32_X16:
        if (type == (X16 | BF16)) f32x16_rows(BF16F, w, n, r0, r1, x, ldx, m, a->k, y, ldy, wp);
        else f32x16_rows(F32K, w, n, r0, r1, x, ldx, m, a->k, y, ldy, wp);
        return;
#if DPBF_BUILT
    case BF16_DP: f32x16_rows(BF16D, w, n, r0, r1, a->b, acts_ldb(a), m, a->k, y, ldy, wp); return;
#endif
#if AMX_BUILT
    case BF16_AMX: amx_rows(w, n, r0, r1, a->b, acts_ldb(a), a->ldb == 0, m, a->k, y, ldy, wp); return;
#endif
    case PANELS: panel_gemm(type, w, row_bytes, r0, r1, a, y, ldy, wp); return;
    case STRIPS: strip_gemm(type, w, row_bytes, r0, r1, x, ldx, m, a->k, y, ldy, wp, wp + NR * a->k); return;
    default: break;
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
        for (int64_t i = 0; i < m; i += QROWS) {
            int nr = m - i < QROWS ? (int)(m - i) : QROWS;
            float out[QROWS];
            switch (type) {
            case Q4_0: rows_of(Q4_0, nr, wr, a, i, out); break;
            case Q4_1: rows_of(Q4_1, nr, wr, a, i, out); break;
            case Q8_0: rows_of(Q8_0, nr, wr, a, i, out); break;
            case Q4_K: rows_of(Q4_K, nr, wr, a, i, out); break;
            default: rows_of(Q6_K, nr, wr, a, i, out); break;
            }
            for (int j = 0; j < nr; j++) y[(i + j) * ldy + r] = out[j];
        }
    }
#endif
}

/* Activation rows the block formats' x16 path takes at a time. Its kernel passes each tile of
 * weight groups over every activation row given; a prefill chunk's rows (thousands, at 2 bytes a
 * column) outgrow L2 and would come from L3 again for every tile. A block of ROW_BLOCK rows stays
 * in L2 while all of a claimed run's groups pass over it. The float and bfloat16 paths instead
 * take all the rows, panel by panel of weight groups (amx_rows, f32x16_rows). An output's
 * operations are the same either way. */
#define ROW_BLOCK 256

/* y[i * ldy + r] = x_i . W[r] for i < m and r0 <= r < r1, by product_path: the 16-bit path on
 * `a` (x quantized), F32 rows against x, or a float GEMM with `wp` (gemm_scratch(k) bytes) on a's
 * panels or on x itself (strips); the block formats' x16 path in blocks of ROW_BLOCK rows. No threads of its own. */
static void qmatmul_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t r0, int64_t r1,
                         const Acts *a, const float *x, int64_t ldx, int64_t m, float *y, int64_t ldy, float *wp) {
    int path = product_path(type, m);
    if (path != X16_GROUPS) {
        path_rows(path, type, w, row_bytes, n, r0, r1, a, x, ldx, m, y, ldy, wp);
        return;
    }
    for (int64_t i0 = 0; i0 < m; i0 += ROW_BLOCK) {
        int64_t mb = m - i0 < ROW_BLOCK ? m - i0 : ROW_BLOCK;
        Acts part = acts_part(a, i0, mb);
        path_rows(path, type, w, row_bytes, n, r0, r1, &part, x ? x + i0 * ldx : NULL, ldx, mb, y + i0 * ldy, ldy,
                  wp);
    }
}

/* Whether products on these paths need gemm_scratch (a float GEMM's, or x16's padded group). */
static int needs_scratch(int paths) {
    return (paths & ((1 << PANELS) | (1 << STRIPS) | (1 << X16_GROUPS) | (1 << F32_X16) | (1 << BF16_AMX) |
                     (1 << BF16_DP) | (1 << X16_AMX))) != 0;
}

#include "quant_threads.c" /* the entry points */
