/* One page's scores and weighted values over a bfloat16 KV cache, for paged_decode.c, which
 * includes this file after its float32 helpers; not compiled alone. Built where the CPU has
 * AVX512-BF16 (PAGED_BF16 set), the one place a bfloat16 cache is kept (`paged_decode_bf16`).
 *
 * Half the bytes of a float32 cache, and, where the float32 kernel spends four multiply-adds a
 * key and head at D = 64, scores take two `vdpbf16ps` (32 products each): the query rounded to
 * bfloat16 (nearest even) once per row and head, as the cache's keys were when written, and
 * both summed in float32. Values stay float32 arithmetic: each 32-bit lane of a loaded row holds
 * dims 2i and 2i + 1, widened exactly by a shift and a mask into "even" and "odd" accumulators
 * that are interleaved back once per page. The probabilities are not rounded here (on AMX tiles,
 * paged_amx.c, they are rounded to bfloat16). Each output is one fixed sequence of operations
 * over its own row's keys, whatever shares the step.
 */

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define PAGED_BF16 1
#include <immintrin.h>
#define GROUP_MAX 8 /* query heads whose values one pass sums (group_max: fewer for wider heads) */

/* scores[t] = scale * qb . k_t for the n rows of one page (qb, k bfloat16, D a multiple of 32). */
static void page_scores_bf16(const uint16_t *qb, const uint16_t *k, int64_t n, int64_t row_stride, int64_t D,
                             float scale, float *scores) {
    const int nv = (int)(D / 32);
    __m512bh qv[MAX_D / 32];
    for (int c = 0; c < nv; ++c) qv[c] = (__m512bh)_mm512_loadu_si512((const void *)(qb + 32 * c));
    int64_t t = 0;
    for (; t + 16 <= n; t += 16, k += 16 * row_stride) {
        vf acc[16];
        for (int r = 0; r < 16; ++r) {
            const uint16_t *kr = k + r * row_stride;
            __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512((const void *)kr));
            for (int c = 1; c < nv; ++c)
                a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512((const void *)(kr + 32 * c)));
            memcpy(&acc[r], &a, sizeof a);
        }
        storev(scores + t, transpose_sum(acc) * scale);
    }
    for (; t < n; ++t, k += row_stride) { /* the page's last rows: the same products, summed alone */
        __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512((const void *)k));
        for (int c = 1; c < nv; ++c)
            a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512((const void *)(k + 32 * c)));
        scores[t] = _mm512_reduce_add_ps(a) * scale;
    }
}

/* out[g] += sum_t p[g][t] * v_t over the n rows of one page, for g < ng query heads that read
 * the same KV head (v bfloat16, each out float32 [nv * 32]): a row is loaded and widened once
 * for all of them. Each head's sums are the same operations in the same order as alone. */
static inline __attribute__((always_inline)) void
values_bf16(const int ng, const int nv, const float *const *p, const uint16_t *v, int64_t n, int64_t row_stride,
            float *const *out) {
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    const __m512i top = _mm512_set1_epi32((int)0xFFFF0000u);
    __m512 ae[GROUP_MAX][MAX_D / 32], ao[GROUP_MAX][MAX_D / 32];
    for (int g = 0; g < ng; ++g)
        for (int c = 0; c < nv; ++c) { /* out's dims split into even and odd lanes */
            __m512 a = _mm512_loadu_ps(out[g] + 32 * c), b = _mm512_loadu_ps(out[g] + 32 * c + 16);
            ae[g][c] = _mm512_permutex2var_ps(a, even, b);
            ao[g][c] = _mm512_permutex2var_ps(a, odd, b);
        }
    for (int64_t t = 0; t < n; ++t, v += row_stride) {
        __m512 we[MAX_D / 32], wo[MAX_D / 32];
        for (int c = 0; c < nv; ++c) {
            __m512i x = _mm512_loadu_si512((const void *)(v + 32 * c));
            we[c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
            wo[c] = _mm512_castsi512_ps(_mm512_and_si512(x, top));
        }
        for (int g = 0; g < ng; ++g) {
            __m512 pt = _mm512_set1_ps(p[g][t]);
            for (int c = 0; c < nv; ++c) {
                ae[g][c] = _mm512_fmadd_ps(pt, we[c], ae[g][c]);
                ao[g][c] = _mm512_fmadd_ps(pt, wo[c], ao[g][c]);
            }
        }
    }
    for (int g = 0; g < ng; ++g)
        for (int c = 0; c < nv; ++c) {
            _mm512_storeu_ps(out[g] + 32 * c, _mm512_permutex2var_ps(ae[g][c], lo, ao[g][c]));
            _mm512_storeu_ps(out[g] + 32 * c + 16, _mm512_permutex2var_ps(ae[g][c], hi, ao[g][c]));
        }
}

/* The heads of a group at a time that registers hold: 8 rows of 32 dims' sums, two registers each. */
static inline int group_max(int64_t D) { return (int)(256 / D); }

/* values_bf16 with constant counts: ng <= group_max(D), D = 32 * nv for nv = 1 .. 8 (every
 * width paged_bf16_width takes). */
static void page_values_bf16(int ng, const float *const *p, const uint16_t *v, int64_t n, int64_t row_stride,
                             int64_t D, float *const *out) {
#define VB(G, NV) values_bf16(G, NV, p, v, n, row_stride, out)
#define UP_TO_8(NV)                                                                                          \
    switch (ng) {                                                                                            \
    case 8: VB(8, NV); return;                                                                               \
    case 7: VB(7, NV); return;                                                                               \
    case 6: VB(6, NV); return;                                                                               \
    case 5: VB(5, NV); return;                                                                               \
    case 4: VB(4, NV); return;                                                                               \
    case 3: VB(3, NV); return;                                                                               \
    case 2: VB(2, NV); return;                                                                               \
    default: VB(1, NV); return;                                                                              \
    }
    switch (D / 32) {
    case 1: UP_TO_8(1)
    case 2:
        switch (ng) {
        case 4: VB(4, 2); return;
        case 3: VB(3, 2); return;
        case 2: VB(2, 2); return;
        default: VB(1, 2); return;
        }
    case 3:
        if (ng == 2) VB(2, 3);
        else VB(1, 3);
        return;
    case 4:
        if (ng == 2) VB(2, 4);
        else VB(1, 4);
        return;
    case 5: VB(1, 5); return;
    case 6: VB(1, 6); return;
    case 7: VB(1, 7); return;
    default: VB(1, 8); return;
    }
#undef UP_TO_8
#undef VB
}

/* Whether paged_decode_bf16 reads heads of width D: the one answer (attention/cpu_kernel.py asks). */
int paged_bf16_width(int64_t D) { return D % 32 == 0 && D >= 32 && D <= MAX_D; }
#else
#define PAGED_BF16 0
#endif

#include "paged_amx.c" /* scores and values on AMX tiles, where this process runs them */
