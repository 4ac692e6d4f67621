/* The float32 vector helpers of the paged decode kernel (paged_decode.c, which includes this
 * file first; not compiled alone): the vector type, the transpose-and-add tree, and one page's
 * scores and weighted values over a float32 cache.
 *
 * Head dims that are multiples of 16 take a path written with GCC/clang vector extensions as
 * wide as the target's registers (16 floats with AVX-512, else 8: a wider vector type on an
 * AVX2 target is lowered through the stack and runs several times slower), in chunks of 256,
 * 128, .. 16 (latent attention's 576 = 256 + 256 + 64), so the accumulators stay in registers;
 * other dims take a plain loop.
 */

#ifdef __AVX512F__
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
#define MAX_D 256

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
