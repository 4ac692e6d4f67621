/* One page's scores and weighted values over a bfloat16 KV cache, for paged_decode.c, which
 * includes this file after its float32 helpers; not compiled alone. Built where the CPU has
 * AVX512-BF16 (PAGED_BF16 set), the one place a bfloat16 cache is kept (`paged_decode_bf16`).
 *
 * Half the bytes of a float32 cache, and, where the float32 kernel spends four multiply-adds a
 * key and head at D = 64, scores take two `vdpbf16ps` (32 products each): the query rounded to
 * bfloat16 (nearest even) once per row and head, as the cache's keys were when written, and
 * both summed in float32. Values stay float32 arithmetic: each 32-bit lane of a loaded row holds
 * dims 2i and 2i + 1, widened exactly by a shift and a mask into "even" and "odd" accumulators
 * that are interleaved back once per page. The probabilities are never rounded. Each output is
 * one fixed sequence of operations over its own row's keys, whatever shares the step.
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

#if AMX_BUILT
static int amx_on; /* set once, when the library loads (amx.h) */
__attribute__((constructor)) static void amx_init(void) { amx_on = amx_decide() == NULL; }

/* Scores on AMX tiles for an item's query rows, where this process runs AMX (amx.h: decided alike
 * for the products) and pages are whole tiles of 16 keys: for one KV head, a tile of 16 cached
 * keys (the page's rows as stored, 32 dims a tile row) times a tile of 16 query columns (the
 * item's rows and heads that read this KV head, their rounded queries laid out as pairs), one
 * tile product a chunk of 32 dims, summed in dim order in float32. A score is one fixed chain
 * whatever else shares its tiles, and every row on this path (prefill and decode alike) takes
 * it. The columns' pairs for chunk c of column tile j: qt + (j * nch + c) * 512. */
static void amx_query_tiles(const uint16_t *qb, int64_t D, const int64_t *cols, int64_t ncols, uint16_t *qt) {
    const int64_t nch = D / 32;
    memset(qt, 0, sizeof(uint16_t) * 512 * (size_t)(((ncols + 15) / 16) * nch));
    for (int64_t n = 0; n < ncols; ++n) {
        const uint16_t *q = qb + cols[n] * D;
        for (int64_t c = 0; c < nch; ++c)
            for (int p = 0; p < 16; ++p) {
                uint16_t *t = qt + ((n / 16) * nch + c) * 512 + p * 32 + (n % 16) * 2;
                t[0] = q[32 * c + 2 * p];
                t[1] = q[32 * c + 2 * p + 1];
            }
    }
}

/* The 16 x 16 scores of keys [t, t + 16) of `page` (rows `stride` bfloat16 apart, this KV head's
 * D at the start) against column tile `qt` (nch chunks), into `c` (16 keys x 16 columns). */
static inline void amx_key_tile(const uint16_t *keys, int64_t stride, const uint16_t *qt, int64_t nch, float *c) {
    _tile_zero(0);
    for (int64_t ch = 0; ch < nch; ++ch) {
        _tile_loadd(4, keys + 32 * ch, stride * 2);
        _tile_loadd(6, qt + ch * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
    }
    _tile_stored(0, c, 64);
}

/* block_item's scores (paged_decode.c) on AMX tiles, one KV head at a time: its columns (the
 * item's rows and heads that read it) laid out once, then the pages in table order, 16 keys a
 * tile. Keys past a row's length in a tile are computed and not kept (a page holds whole tiles:
 * page_size is a multiple of 16 on this path). qt: the column tiles' scratch. */
static void amx_item_scores(const uint16_t *qb, const uint16_t *k_cache, const int64_t *table, const int64_t *lens,
                            int64_t b0, int64_t b1, const unsigned char *take, const int64_t *kv_of_q, int64_t kv0,
                            int64_t kv1, int64_t H, int64_t Hkv, int64_t D, int64_t page_size, float scale,
                            float *scores, int64_t max_len, uint16_t *qt) {
    const int64_t stride = Hkv * D, nch = D / 32;
    int64_t longest = 0, cols[(b1 - b0) * H]; /* a column: (b - b0) * H + h, its query's index in qb */
    float c[16 * 16];
    const __m512i key_rows = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 16, 0);
    for (int64_t b = b0; b < b1; ++b) longest = lens[b] > longest ? lens[b] : longest;
    const int64_t npages = (longest + page_size - 1) / page_size;
    amx_configure();
    for (int64_t kv = kv0; kv < kv1; ++kv) {
        int64_t ncols = 0;
        for (int64_t b = b0; b < b1; ++b)
            for (int64_t h = 0; h < H; ++h)
                if (take[h] && kv_of_q[h] == kv && lens[b] > 0) cols[ncols++] = (b - b0) * H + h;
        if (!ncols) continue;
        amx_query_tiles(qb, D, cols, ncols, qt);
        for (int64_t pg = 0, t0 = 0; pg < npages; ++pg, t0 += page_size) {
            const uint16_t *page = k_cache + (table[pg] * page_size * stride + kv * D);
            if (pg + 1 < npages) /* the next page's rows of this head, while this one is multiplied */
                prefetch_rows((const char *)(k_cache + table[pg + 1] * page_size * stride), 0, page_size, stride * 2,
                              kv * D * 2, D * 2);
            for (int64_t t = t0; t < t0 + page_size && t < longest; t += 16)
                for (int64_t j = 0; j * 16 < ncols; ++j) {
                    amx_key_tile(page + (t - t0) * stride, stride, qt + j * nch * 512, nch, c);
                    for (int64_t n = j * 16; n < ncols && n < j * 16 + 16; ++n) { /* column n's 16 keys */
                        const int64_t b = b0 + cols[n] / H, h = cols[n] % H, len = lens[b];
                        if (t >= len) continue;
                        const __mmask16 keep = len - t >= 16 ? 0xFFFF : (__mmask16)((1u << (len - t)) - 1);
                        const __m512 col = _mm512_i32gather_ps(key_rows, c + n % 16, 4);
                        _mm512_mask_storeu_ps(scores + (b - b0) * H * max_len + h * len + t, keep,
                                              _mm512_mul_ps(col, _mm512_set1_ps(scale)));
                    }
                }
        }
    }
    _tile_release();
}
#else
static const int amx_on = 0;
#endif

/* Whether paged_decode_bf16 reads heads of width D: the one answer (attention/cpu_kernel.py asks). */
int paged_bf16_width(int64_t D) { return D % 32 == 0 && D >= 32 && D <= MAX_D; }
#else
#define PAGED_BF16 0
#endif
