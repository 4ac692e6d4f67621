/* Decode attention over a paged KV cache, for the CPU, in float32.
 *
 * One query token per sequence attends to that sequence's first `context_lens[b]` cached
 * tokens, read in place from the pages named by its block table: no gather, no padding.
 * Work is split by sequence, so a page's K/V block is fetched from memory once for every
 * query head that reads it (GQA); the threads of torch's OpenMP pool share the sequences.
 * Head dims that are multiples of 16 take a path written with GCC/clang vector extensions as
 * wide as the target's registers (16 floats with AVX-512, else 8: a wider vector type on an
 * AVX2 target is lowered through the stack and runs several times slower), in chunks of 256,
 * 128, .. 16 (latent attention's 576 = 256 + 256 + 64), so the accumulators stay in registers;
 * other dims take a plain loop.
 *
 * Layouts (row-major): q [B, q_stride] with heads [H, D] at the start of each row;
 * k_cache, v_cache [slots, Hkv, D]; block_tables [B, max_pages]; out [B, H, D].
 * kv_of_q[h] is the kv head that query head h reads (uneven groups allowed).
 * lse [B, H], when not NULL, gets log(sum_t exp(scale * q . k_t)) of each row, so that partial
 * attentions over disjoint key sets (context parallelism) can be merged. A sequence with no
 * context is legal: its out rows are 0 and its lse rows -inf.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef __AVX512F__
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
#define MAX_D 256

/* The vector width chosen for this build (compiled for the host CPU): logged when the library
 * loads, shown by `shardserve env`. */
const char *kernel_paths(void) { return VW == 16 ? "16 float lanes (avx512)" : "8 float lanes"; }

static inline vf loadv(const float *p) { vf x; memcpy(&x, p, sizeof x); return x; }
static inline void storev(float *p, vf x) { memcpy(p, &x, sizeof x); }

/* Sum of x and y after each picks its lanes from the pair (GCC >= 12 and clang). */
#define FOLD(x, y, LO, HI) (__builtin_shufflevector(x, y, LO) + __builtin_shufflevector(x, y, HI))

/* Lane t of the result is the sum of the VW lanes of a[t]: a transpose-and-add tree (for 16
 * lanes 30 shuffles and 15 adds for 16 dot products) instead of a horizontal sum for each. */
#if VW == 16
#define L8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define H8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define L4 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27
#define H4 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31
#define L2 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29
#define H2 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31
#define L1 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define H1 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
static inline vf transpose_sum(const vf a[VW]) {
    vf b[8], c[4], d[2];
    for (int k = 0; k < 8; ++k) b[k] = FOLD(a[2 * k], a[2 * k + 1], L8, H8);
    for (int k = 0; k < 4; ++k) c[k] = FOLD(b[2 * k], b[2 * k + 1], L4, H4);
    for (int k = 0; k < 2; ++k) d[k] = FOLD(c[2 * k], c[2 * k + 1], L2, H2);
    return FOLD(d[0], d[1], L1, H1);
}
#else
#define L4 0, 1, 2, 3, 8, 9, 10, 11
#define H4 4, 5, 6, 7, 12, 13, 14, 15
#define L2 0, 1, 4, 5, 8, 9, 12, 13
#define H2 2, 3, 6, 7, 10, 11, 14, 15
#define L1 0, 2, 4, 6, 8, 10, 12, 14
#define H1 1, 3, 5, 7, 9, 11, 13, 15
static inline vf transpose_sum(const vf a[VW]) {
    vf c[4], d[2];
    for (int k = 0; k < 4; ++k) c[k] = FOLD(a[2 * k], a[2 * k + 1], L4, H4);
    for (int k = 0; k < 2; ++k) d[k] = FOLD(c[2 * k], c[2 * k + 1], L2, H2);
    return FOLD(d[0], d[1], L1, H1);
}
#endif

/* The vector paths take the number of VW-float chunks per head as a compile-time constant
 * (via the switches below), so accumulators stay in registers instead of a stack array. */
static inline __attribute__((always_inline)) void
scores_vec(const float *q, const float *k, int64_t n, int64_t row_stride, float scale, float *scores,
           const int nv, int add) {
    vf qv[MAX_D / VW], acc[VW];
    int64_t t = 0;
    for (int c = 0; c < nv; ++c) qv[c] = loadv(q + VW * c) * scale;
    for (; t + VW <= n; t += VW, k += VW * row_stride) {
        for (int r = 0; r < VW; ++r) {
            const float *kr = k + r * row_stride;
            acc[r] = qv[0] * loadv(kr);
            for (int c = 1; c < nv; ++c) acc[r] += qv[c] * loadv(kr + VW * c);
        }
        vf sum = transpose_sum(acc);
        storev(scores + t, add ? loadv(scores + t) + sum : sum);
    }
    for (; t < n; ++t, k += row_stride) {
        vf a = qv[0] * loadv(k);
        for (int c = 1; c < nv; ++c) a += qv[c] * loadv(k + VW * c);
        float s = 0.f;
        for (int i = 0; i < VW; ++i) s += a[i];
        scores[t] = add ? scores[t] + s : s;
    }
}

/* Two rows per step into two accumulator sets, so neighbouring rows' multiply-adds overlap. */
static inline __attribute__((always_inline)) void
values_vec(const float *p, const float *v, int64_t n, int64_t row_stride, float *out, const int nv) {
    vf acc[MAX_D / VW], acc2[MAX_D / VW];
    for (int c = 0; c < nv; ++c) { acc[c] = loadv(out + VW * c); acc2[c] = (vf){0}; }
    int64_t t = 0;
    for (; t + 2 <= n; t += 2, v += 2 * row_stride) {
        vf p0 = (vf){0} + p[t], p1 = (vf){0} + p[t + 1];
        for (int c = 0; c < nv; ++c) {
            acc[c] += p0 * loadv(v + VW * c);
            acc2[c] += p1 * loadv(v + row_stride + VW * c);
        }
    }
    if (t < n) {
        vf p0 = (vf){0} + p[t];
        for (int c = 0; c < nv; ++c) acc[c] += p0 * loadv(v + VW * c);
    }
    for (int c = 0; c < nv; ++c) storev(out + VW * c, acc[c] + acc2[c]);
}

/* The largest vector chunk (256, 128, .. 16 floats) of `rest` floats, rest a multiple of 16. */
static inline int64_t chunk_of(int64_t rest) {
    int64_t c = 256;
    while (c > rest) c /= 2;
    return c;
}

/* scores[t] (+)= scale * q . k_t over one chunk of c dims; the switch makes nv a constant. */
static void scores_chunk(const float *q, const float *k, int64_t n, int64_t row_stride, float scale, float *scores,
                         int64_t c, int add) {
    switch (c) {
    case 256: scores_vec(q, k, n, row_stride, scale, scores, 256 / VW, add); return;
    case 128: scores_vec(q, k, n, row_stride, scale, scores, 128 / VW, add); return;
    case 64: scores_vec(q, k, n, row_stride, scale, scores, 64 / VW, add); return;
    case 32: scores_vec(q, k, n, row_stride, scale, scores, 32 / VW, add); return;
    default: scores_vec(q, k, n, row_stride, scale, scores, 16 / VW, add); return;
    }
}

static void values_chunk(const float *p, const float *v, int64_t n, int64_t row_stride, float *out, int64_t c) {
    switch (c) {
    case 256: values_vec(p, v, n, row_stride, out, 256 / VW); return;
    case 128: values_vec(p, v, n, row_stride, out, 128 / VW); return;
    case 64: values_vec(p, v, n, row_stride, out, 64 / VW); return;
    case 32: values_vec(p, v, n, row_stride, out, 32 / VW); return;
    default: values_vec(p, v, n, row_stride, out, 16 / VW); return;
    }
}

/* scores[t] = scale * q . k_t for the n rows of one page, rows `row_stride` floats apart. */
static void page_scores(const float *q, const float *k, int64_t n, int64_t row_stride, int64_t D,
                        float scale, float *scores) {
    if (D % 16 == 0) {
        for (int64_t off = 0, c; off < D; off += c) {
            c = chunk_of(D - off);
            scores_chunk(q + off, k + off, n, row_stride, scale, scores, c, off > 0);
        }
        return;
    }
    for (int64_t t = 0; t < n; ++t, k += row_stride) {
        float s = 0.f;
        for (int64_t i = 0; i < D; ++i) s += q[i] * k[i];
        scores[t] = s * scale;
    }
}

/* out += sum_t p[t] * v_t over the n rows of one page. */
static void page_values(const float *p, const float *v, int64_t n, int64_t row_stride, int64_t D, float *out) {
    if (D % 16 == 0) {
        for (int64_t off = 0, c; off < D; off += c) {
            c = chunk_of(D - off);
            values_chunk(p, v + off, n, row_stride, out + off, c);
        }
        return;
    }
    for (int64_t t = 0; t < n; ++t, v += row_stride)
        for (int64_t i = 0; i < D; ++i) out[i] += p[t] * v[i];
}

/* Normalizes s[0..n) in place, n >= 1, and returns its log-sum-exp. The max starts at s[0], not
 * -inf: under -ffast-math the compiler may assume no infinities. */
static float softmax(float *s, int64_t n) {
    float mx = s[0], sum = 0.f;
    for (int64_t t = 1; t < n; ++t) mx = s[t] > mx ? s[t] : mx;
    for (int64_t t = 0; t < n; ++t) { s[t] = expf(s[t] - mx); sum += s[t]; }
    float inv = 1.f / sum;
    for (int64_t t = 0; t < n; ++t) s[t] *= inv;
    return mx + logf(sum);
}

/* Prefetch rows [r0, r1) of page `page`'s block, the part of each row this item reads. */
static inline void prefetch_rows(const float *page, int64_t r0, int64_t r1, int64_t stride, int64_t offset,
                                 int64_t span) {
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t i = 0; i < span; i += 16) __builtin_prefetch(page + r * stride + offset + i);
}

/* Rows [b0, b1) (at most ROW_BLOCK, one block table: a prefill chunk's tokens, or one decode)
 * for the query heads whose kv head is in [kv0, kv1): scores, softmax, weighted values. Each row
 * is computed exactly as alone (the same calls per page, in the same order); the rows only take
 * turns on each page, so a page of K or V is read from memory once for all of them. Pages sit at
 * random places in the pool, beyond what the hardware prefetcher predicts, so while a page is
 * used the next one is prefetched, a slice of rows before each head of the longest row: one burst
 * per page would fill the miss queue and stall. scores holds (b1 - b0) * H * max_len floats. */
static void block_item(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                       const int64_t *table, const int64_t *lens, int64_t b0, int64_t b1, const int64_t *kv_of_q,
                       float *out, float *lse, int64_t kv0, int64_t kv1, int64_t hpart, int64_t hparts, int64_t H,
                       int64_t Hkv, int64_t D, int64_t page_size, float scale, float *scores, int64_t max_len) {
    /* This item's query heads: those reading kv heads [kv0, kv1), and of them the hpart-th of
     * hparts even slices (hparts > 1 only with one kv head per item). */
    unsigned char take[H];
    int64_t group = 0, seen = 0;
    for (int64_t h = 0; h < H; ++h) group += kv_of_q[h] >= kv0 && kv_of_q[h] < kv1;
    for (int64_t h = 0; h < H; ++h) {
        take[h] = kv_of_q[h] >= kv0 && kv_of_q[h] < kv1;
        if (take[h]) take[h] = seen++ * hparts / group == hpart;
    }
    int64_t longest = 0, lb = b0; /* the longest row prefetches: it reads every page */
    for (int64_t b = b0; b < b1; ++b)
        if (lens[b] > longest) { longest = lens[b]; lb = b; }
    for (int values = 0; values < 2; ++values) {
        const float *cache = values ? v_cache : k_cache;
        int64_t stride = Hkv * D, block = page_size * stride, npages = (longest + page_size - 1) / page_size;
        int64_t heads = 0;
        for (int64_t h = 0; h < H; ++h) heads += take[h];
        for (int64_t pg = 0, t0 = 0; pg < npages; ++pg, t0 += page_size) {
            const float *page = cache + table[pg] * block, *next = pg + 1 < npages ? cache + table[pg + 1] * block : 0;
            for (int64_t b = b0; b < b1; ++b) {
                int64_t len = lens[b], n = len - t0 < page_size ? len - t0 : page_size;
                float *sc = scores + (b - b0) * H * max_len;
                if (n <= 0) continue;
                for (int64_t h = 0, j = 0; h < H; ++h) {
                    if (!take[h]) continue;
                    if (next && b == lb)
                        prefetch_rows(next, j * page_size / heads, (j + 1) * page_size / heads, stride, kv0 * D,
                                      (kv1 - kv0) * D);
                    ++j;
                    const float *rows = page + kv_of_q[h] * D;
                    if (values)
                        page_values(sc + h * len + t0, rows, n, stride, D, out + b * H * D + h * D);
                    else
                        page_scores(q + b * q_stride + h * D, rows, n, stride, D, scale, sc + h * len + t0);
                }
            }
        }
        if (values) break;
        for (int64_t b = b0; b < b1; ++b) {
            int64_t len = lens[b];
            for (int64_t h = 0; h < H; ++h) {
                if (!take[h]) continue;
                memset(out + b * H * D + h * D, 0, sizeof(float) * D);
                /* No keys: the sum of exps is 0. Stored on its own branch, as a constant, since
                 * under -ffast-math computing it (log of 0, 1/0) is not guaranteed to give -inf. */
                float l = len > 0 ? softmax(scores + (b - b0) * H * max_len + h * len, len) : -INFINITY;
                if (lse) lse[b * H + h] = l;
            }
        }
    }
}

#define ROW_BLOCK 8 /* rows of one block table taken together */

/* The first row of each block of rows sharing a block table, and the end: returns the count. */
static int64_t row_blocks(const int64_t *block_tables, int64_t max_pages, int64_t B, int64_t *starts) {
    int64_t n = 0;
    for (int64_t b = 0; b < B; ++b)
        if (b == 0 || b - starts[n - 1] == ROW_BLOCK ||
            memcmp(block_tables + b * max_pages, block_tables + starts[n - 1] * max_pages,
                   sizeof(int64_t) * (size_t)max_pages) != 0)
            starts[n++] = b;
    starts[n] = B;
    return n;
}

/* Returns 0, or -1 when a scores buffer could not be allocated. lse may be NULL. The scores buffer
 * has one spare float so that max_len == 0 (only empty sequences) still mallocs a nonzero size. */
int paged_decode_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                     const int64_t *block_tables, int64_t max_pages, const int64_t *context_lens,
                     const int64_t *kv_of_q, float *out, float *lse, int64_t B, int64_t H, int64_t Hkv,
                     int64_t D, int64_t page_size, float scale, int num_threads) {
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; ++b) max_len = context_lens[b] > max_len ? context_lens[b] : max_len;
    /* Rows of one block table (a prefill chunk's tokens) go together, up to ROW_BLOCK a block. */
    int64_t *starts = malloc(sizeof(int64_t) * (size_t)(B + 1));
    if (!starts) return -1;
    int64_t nblocks = row_blocks(block_tables, max_pages, B, starts), rows = 1; /* the largest block's */
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
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(rows * max_len * H + 1));
        if (!scores) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < nblocks * per_seq * hparts; ++item) {
            if (!scores) continue;
            int64_t blk = item / (per_seq * hparts), part = item / hparts % per_seq, b0 = starts[blk];
            int64_t kv0 = per_seq == 1 ? 0 : part, kv1 = per_seq == 1 ? Hkv : part + 1;
            block_item(q, q_stride, k_cache, v_cache, block_tables + b0 * max_pages, context_lens, b0, starts[blk + 1],
                       kv_of_q, out, lse, kv0, kv1, item % hparts, hparts, H, Hkv, D, page_size, scale, scores,
                       max_len);
        }
        free(scores);
    }
    free(starts);
    return failed ? -1 : 0;
}
