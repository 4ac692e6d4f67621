/* Decode attention over a paged KV cache, for the CPU: float32 arithmetic.
 *
 * One query token per sequence attends to that sequence's first `context_lens[b]` cached
 * tokens, read in place from the pages named by its block table: no gather, no padding.
 * Work is split by sequence, so a page's K/V block is fetched from memory once for every
 * query head that reads it (GQA); the threads of torch's OpenMP pool share the sequences.
 * One page's arithmetic is paged_vec.c's (a float32 cache) or paged_bf16.c's (bfloat16).
 *
 * Layouts (row-major): q [B, q_stride] with heads [H, D] at the start of each row;
 * k_cache, v_cache [slots, Hkv, D] float32 (`paged_decode_f32`) or bfloat16 (`paged_decode_bf16`,
 * built where the CPU has AVX512-BF16: see paged_bf16.c); block_tables [B, max_pages]; out [B, H, D].
 * kv_of_q[h] is the kv head that query head h reads (uneven groups allowed).
 * skips [B], when not NULL, masks each row's first skips[b] keys (a sliding window's start
 * inside the row's first page: the caller starts its block table at that page).
 * softcap, when > 0, bounds each score s (after the scale) to softcap * tanh(s / softcap) before the
 * softmax (Gemma 2's attention logit softcapping).
 * lse [B, H], when not NULL, gets log(sum_t exp(scale * q . k_t)) of each row, so that partial
 * attentions over disjoint key sets (context parallelism) can be merged. A sequence with no
 * context is legal: its out rows are 0 and its lse rows -inf.
 */
#define _DEFAULT_SOURCE /* syscall() (amx.h) under -std=c11: before any header */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "paged_vec.c"

/* The vector width chosen for this build (compiled for the host CPU): logged when the library
 * loads, shown by `shardserve env`. */
const char *kernel_paths(void); /* at the end, once paged_bf16.c has said what it built */

#include "softmax.c"

#include "bf16.h" /* bf16_round_row: the cache writes (kv_write) and the queries */

/* Prefetch rows [r0, r1) of page `page`'s block, the part of each row this item reads (bytes),
 * into L2 (prefetcht1), not L1: a prefetch into L1 holds one of L1's few miss buffers until its
 * line arrives, so a page's lines in flight are capped by them and the kernel reads memory at a
 * fraction of what the machine gives; L2 keeps several times as many misses in flight, and the
 * loads then find the lines a few cycles away (the README has the measurements). */
static inline void prefetch_rows(const char *page, int64_t r0, int64_t r1, int64_t stride, int64_t offset,
                                 int64_t span) {
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t i = 0; i < span; i += 64) __builtin_prefetch(page + r * stride + offset + i, 0, 2);
}

#include "amx.h" /* whether this process runs AMX tiles: decided as for the products */
#include "paged_bf16.c"

/* The item's scores (rows [b0, b1), its heads) normalized in place, or, `invs` given, left as
 * exps with 1 / their sum at invs[(b - b0) * H + h] (softmax); its out rows zeroed for the values
 * to add into; lse as paged_decode says. */
static void item_softmax(const unsigned char *take, const int64_t *lens, const int64_t *skips, int64_t b0, int64_t b1,
                         float *out, float *lse, int64_t H, int64_t D, float *scores, int64_t max_len, float *invs,
                         float softcap) {
    for (int64_t b = b0; b < b1; ++b) {
        /* Under a sliding window the first `skip` keys (before the window, on its first page)
         * get probability 0: the values pass adds nothing of them. */
        int64_t len = lens[b], skip = skips ? skips[b] : 0;
        for (int64_t h = 0; h < H; ++h) {
            if (!take[h]) continue;
            memset(out + b * H * D + h * D, 0, sizeof(float) * D);
            float *s = scores + (b - b0) * H * max_len + h * len;
            memset(s, 0, sizeof(float) * (size_t)skip);
            if (softcap > 0)
                for (int64_t t = skip; t < len; ++t) s[t] = softcap * tanhf(s[t] / softcap);
            /* No keys: the sum of exps is 0. Stored on its own branch, as a constant, since
             * under -ffast-math computing it (log of 0, 1/0) is not guaranteed to give -inf. */
            float l = len > skip ? softmax(s + skip, len - skip, invs ? invs + (b - b0) * H + h : NULL) : -INFINITY;
            if (lse) lse[b * H + h] = l;
        }
    }
}


/* Rows [b0, b1) (at most row_block's, one block table: a prefill chunk's tokens, or one decode)
 * for the query heads whose kv head is in [kv0, kv1): scores, softmax, weighted values. Each row
 * is computed exactly as alone (the same calls per page, in the same order); the rows only take
 * turns on each page, so a page of K or V is read from memory once for all of them. Pages sit at
 * random places in the pool, beyond what the hardware prefetcher predicts, so while a page is
 * used the next one is prefetched, a slice of rows before each head of the longest row: one burst
 * per page would fill the miss queue and stall. scores holds (b1 - b0) * H * max_len floats. */
static void block_item(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache, int bf,
                       const int64_t *table, const int64_t *lens, const int64_t *skips, int64_t b0, int64_t b1,
                       const int64_t *kv_of_q, float *out, float *lse, int64_t kv0, int64_t kv1, int64_t hpart,
                       int64_t hparts, int64_t H, int64_t Hkv, int64_t D, int64_t page_size, float scale, float softcap,
                       float *scores, int64_t max_len, uint16_t *qb, int amx, uint16_t *qt, uint16_t *vp) {
    /* This item's query heads: those reading kv heads [kv0, kv1), and of them the hpart-th of
     * hparts even slices (hparts > 1 only with one kv head per item). */
    unsigned char take[H];
    int64_t group = 0, seen = 0;
    for (int64_t h = 0; h < H; ++h) group += kv_of_q[h] >= kv0 && kv_of_q[h] < kv1;
    for (int64_t h = 0; h < H; ++h) {
        take[h] = kv_of_q[h] >= kv0 && kv_of_q[h] < kv1;
        if (take[h]) take[h] = seen++ * hparts / group == hpart;
    }
#if PAGED_BF16
    if (bf) /* the item's query rows, rounded as the cache's keys were: once, not once a page */
        for (int64_t b = b0; b < b1; ++b)
            for (int64_t h = 0; h < H; ++h)
                if (take[h])
                    bf16_round_row(q + b * q_stride + h * D, D, qb + ((b - b0) * H + h) * D);
#else
    (void)qb;
#endif
    int64_t longest = 0, lb = b0; /* the longest row prefetches: it reads every page */
    for (int64_t b = b0; b < b1; ++b)
        if (lens[b] > longest) { longest = lens[b]; lb = b; }
#if PAGED_BF16 && AMX_BUILT
    if (amx) { /* paged_amx.c: every pass on tiles */
        amx_item_scores(qb, k_cache, table, lens, b0, b1, longest, take, kv_of_q, kv0, kv1, H, Hkv, D, page_size,
                        scale, scores, max_len, qt);
        float invs[(b1 - b0) * H]; /* the values pass normalizes as it rounds */
        item_softmax(take, lens, skips, b0, b1, out, lse, H, D, scores, max_len, invs, softcap);
        amx_item_values(scores, invs, v_cache, table, lens, b0, b1, longest, take, kv_of_q, kv0, kv1, H, Hkv, D,
                        page_size, out, max_len, vp, qt);
        return;
    }
#else
    (void)amx, (void)qt, (void)vp;
#endif
    const int64_t es = bf ? 2 : 4; /* bytes a cached value */
    const int64_t stride = Hkv * D, block = page_size * stride * es, npages = (longest + page_size - 1) / page_size;
    int64_t heads = 0;
    for (int64_t h = 0; h < H; ++h) heads += take[h];
    /* The first page of the keys and of the values: the loop below prefetches a page ahead from
     * the second on, and the values' first page is in L2 by the time the scores are done. */
    if (longest > 0)
        for (int c = 0; c < 2; ++c)
            prefetch_rows((const char *)(c ? v_cache : k_cache) + table[0] * block, 0,
                          longest < page_size ? longest : page_size, stride * es, kv0 * D * es, (kv1 - kv0) * D * es);
    for (int values = 0; values < 2; ++values) {
        const char *cache = values ? v_cache : k_cache;
        for (int64_t pg = 0, t0 = 0; pg < npages; ++pg, t0 += page_size) {
            const char *page = cache + table[pg] * block, *next = pg + 1 < npages ? cache + table[pg + 1] * block : 0;
            for (int64_t b = b0; b < b1; ++b) {
                int64_t len = lens[b], n = len - t0 < page_size ? len - t0 : page_size;
                float *sc = scores + (b - b0) * H * max_len;
                if (n <= 0) continue;
#if PAGED_BF16
                const float *ps[GROUP_MAX]; /* a bfloat16 page's values: the heads gathered so far */
                float *os[GROUP_MAX];
                int ng = 0;
#endif
                for (int64_t h = 0, j = 0; h < H; ++h) {
                    if (!take[h]) continue;
                    if (next && b == lb)
                        prefetch_rows(next, j * page_size / heads, (j + 1) * page_size / heads, stride * es,
                                      kv0 * D * es, (kv1 - kv0) * D * es);
                    ++j;
                    const char *rows = page + kv_of_q[h] * D * es;
                    float *o = out + b * H * D + h * D, *s = sc + h * len + t0;
#if PAGED_BF16
                    if (bf && values) { /* gathered with the next taken heads reading this KV head: one row load */
                        ps[ng] = s;
                        os[ng++] = o;
                        if (ng == group_max(D) || h + 1 == H || !take[h + 1] || kv_of_q[h + 1] != kv_of_q[h]) {
                            page_values_bf16(ng, ps, (const uint16_t *)rows, n, stride, D, os);
                            ng = 0;
                        }
                        continue;
                    }
                    if (bf) {
                        page_scores_bf16(qb + ((b - b0) * H + h) * D, (const uint16_t *)rows, n, stride, D, scale, s);
                        continue;
                    }
#endif
                    if (values) page_values(s, (const float *)rows, n, stride, D, o);
                    else page_scores(q + b * q_stride + h * D, (const float *)rows, n, stride, D, scale, s);
                }
            }
        }
        if (values) break;
        item_softmax(take, lens, skips, b0, b1, out, lse, H, D, scores, max_len, NULL, softcap);
    }
}

/* Rows of one block table taken together: 16 (a KV head's query columns then fill whole AMX
 * tiles of 16 at any GQA ratio), or 8 where each thread's scores buffer (rows x H x max_len floats)
 * would pass 16 MiB: long contexts, many heads. A row's numbers do not depend on its block. */
static int64_t row_block(int64_t H, int64_t max_len) { return 16 * H * max_len * 4 <= (16 << 20) ? 16 : 8; }

/* The first row of each block of rows sharing a block table (at most `most` rows), and the end:
 * returns the count. */
static int64_t row_blocks(const int64_t *block_tables, int64_t max_pages, int64_t B, int64_t most, int64_t *starts) {
    int64_t n = 0;
    for (int64_t b = 0; b < B; ++b)
        if (b == 0 || b - starts[n - 1] == most ||
            memcmp(block_tables + b * max_pages, block_tables + starts[n - 1] * max_pages,
                   sizeof(int64_t) * (size_t)max_pages) != 0)
            starts[n++] = b;
    starts[n] = B;
    return n;
}

/* Returns 0, or -1 when a scores buffer could not be allocated. lse may be NULL. The scores buffer
 * has one spare float so that max_len == 0 (only empty sequences) still mallocs a nonzero size;
 * behind it, with a bfloat16 cache, the item's rounded queries. */
static int paged_decode(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache, int bf,
                        const int64_t *block_tables, int64_t max_pages, const int64_t *context_lens,
                        const int64_t *skips, const int64_t *kv_of_q, float *out, float *lse, int64_t B, int64_t H,
                        int64_t Hkv, int64_t D, int64_t page_size, float scale, float softcap, int num_threads) {
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; ++b) max_len = context_lens[b] > max_len ? context_lens[b] : max_len;
    /* Rows of one block table (a prefill chunk's tokens) go together, up to row_block's a block. */
    int64_t *starts = malloc(sizeof(int64_t) * (size_t)(B + 1));
    if (!starts) return -1;
    int64_t nblocks = row_blocks(block_tables, max_pages, B, row_block(H, max_len), starts);
    int64_t rows = 1; /* the largest block's */
    for (int64_t i = 0; i < nblocks; ++i) rows = starts[i + 1] - starts[i] > rows ? starts[i + 1] - starts[i] : rows;
    /* A whole block per item reads its pages contiguously; with fewer blocks than threads x 2,
     * items are (block, kv head) so every thread has work, and with still too few (one kv head
     * for many query heads: latent attention at batch 1), (block, kv head, slice of its heads).
     * Each head's arithmetic is the same whichever item computes it. */
    int64_t per_seq = nblocks < 2 * num_threads ? Hkv : 1, hparts = 1;
    if (per_seq == Hkv && nblocks > 0 && num_threads > 1 && nblocks * Hkv < 2 * num_threads) {
        hparts = (2 * num_threads + nblocks * Hkv - 1) / (nblocks * Hkv);
        if (hparts > H / Hkv) hparts = H / Hkv > 0 ? H / Hkv : 1;
    }
    /* Scores and values on AMX tiles for a bfloat16 cache where this process runs them and pages
     * are whole tiles of 16 keys; behind the rounded queries `qt` holds the item's column tiles
     * (then a tile of probabilities), and then one KV head's values as tiles. */
    const int amx = bf && amx_on && page_size % 16 == 0;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        size_t nscores = (size_t)(rows * max_len * H + 1), nq = bf ? (size_t)(rows * H * D) : 0;
        size_t nqt = amx ? (size_t)((rows * H + 15) / 16 * (D / 32) * 512) : 0;
        size_t nvp = amx ? (size_t)((max_len + 31) / 32 * 32 * D) : 0; /* one KV head's values as tiles */
        float *scores = malloc(sizeof(float) * nscores + sizeof(uint16_t) * (nq + nqt + nvp));
        if (!scores) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < nblocks * per_seq * hparts; ++item) {
            if (!scores) continue;
            int64_t blk = item / (per_seq * hparts), part = item / hparts % per_seq, b0 = starts[blk];
            int64_t kv0 = per_seq == 1 ? 0 : part, kv1 = per_seq == 1 ? Hkv : part + 1;
            block_item(q, q_stride, k_cache, v_cache, bf, block_tables + b0 * max_pages, context_lens, skips, b0,
                       starts[blk + 1], kv_of_q, out, lse, kv0, kv1, item % hparts, hparts, H, Hkv, D, page_size, scale,
                       softcap, scores, max_len, (uint16_t *)(scores + nscores), amx, (uint16_t *)(scores + nscores) + nq,
                       (uint16_t *)(scores + nscores) + nq + nqt);
        }
        free(scores);
    }
    free(starts);
    return failed ? -1 : 0;
}

/* The entry points, one a cache dtype (the same arguments; paged_decode_bf16 built where the CPU
 * has AVX512-BF16, for D a multiple of 32 up to MAX_D: the caller checks). */
#define ENTRY(NAME, BF)                                                                                      \
    int NAME(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,                     \
             const int64_t *block_tables, int64_t max_pages, const int64_t *context_lens,                    \
             const int64_t *skips, const int64_t *kv_of_q, float *out, float *lse, int64_t B, int64_t H,       \
             int64_t Hkv, int64_t D, int64_t page_size, float scale, float softcap, int num_threads) {       \
        return paged_decode(q, q_stride, k_cache, v_cache, BF, block_tables, max_pages, context_lens, skips,   \
                            kv_of_q, out, lse, B, H, Hkv, D, page_size, scale, softcap, num_threads);        \
    }
ENTRY(paged_decode_f32, 0)
#if PAGED_BF16
ENTRY(paged_decode_bf16, 1)
#endif

/* Rows i < n of src (float32, `width` values each, rows ldx apart) into cache rows slots[i]:
 * float32 as they are, or bfloat16 (bf: bf16_round_row, nearest even, as torch's `.to(torch.bfloat16)`
 * rounds; a NaN stays a NaN) as `index_copy_(0, slots, src.to(cache dtype))` would, in one pass
 * and on every thread: a prefill chunk writes thousands of rows a layer. Returns -1, writing
 * nothing, where a slot is outside the cache's nslots rows. */
int kv_write(const float *src, int64_t ldx, int64_t n, int64_t width, void *cache, int64_t nslots, int bf,
             const int64_t *slots, int num_threads) {
    for (int64_t i = 0; i < n; ++i)
        if (slots[i] < 0 || slots[i] >= nslots) return -1; /* nothing written */
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n >= 64)
    for (int64_t i = 0; i < n; ++i) {
        const float *x = src + i * ldx;
        if (!bf) {
            memcpy((float *)cache + slots[i] * width, x, sizeof(float) * (size_t)width);
            continue;
        }
        uint16_t *o = (uint16_t *)cache + slots[i] * width;
        bf16_round_row(x, width, o);
    }
    return 0;
}

const char *kernel_paths(void) {
    if (PAGED_BF16 && amx_on)
        return "16 float lanes (avx512); bfloat16 KV cache: scores and values on amx tiles (probabilities rounded to "
               "bfloat16; pages of whole 16s of tokens), else avx512-bf16 vdpbf16ps";
    if (PAGED_BF16) return "16 float lanes (avx512); bfloat16 KV cache on avx512-bf16 vdpbf16ps";
    return VW == 16 ? "16 float lanes (avx512); float32 KV cache only (no AVX512-BF16)"
                    : "8 float lanes; float32 KV cache only (no AVX512-BF16)";
}
