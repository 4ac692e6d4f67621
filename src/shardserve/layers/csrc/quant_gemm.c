/* The float GEMMs of quant_matmul.c (which includes this file after `expand_row`): products of
 * more than a few activation rows (product_path) against block-quantized or float32 weights,
 * float32 throughout (exact to float rounding). Not compiled alone. One register block
 * (panel_micro: 12 accumulators fed per step by two vector loads of a k-major 16-wide panel and
 * six broadcasts from rows as they lie), used two ways round:
 *
 * - Up to STRIP_ROWS rows (decode of many streams): the activations are packed once per product
 *   into panels of 16 rows, k-major (p[e * 16 + i] = x[i0 + i][e]); the weight is expanded 6 rows
 *   at a time, row-major (float32 weights are read where they lie), and a 16 x 6 block of the
 *   output is computed per panel. The weight needs no transpose: at a few dozen rows, expanding
 *   and transposing it cost a large share of the multiply-adds' time.
 * - From STRIP_ROWS (prefill): 16 weight rows at a time are expanded and packed k-major
 *   (wp[e * 16 + j] = W[n0 + j][e]) and a 6 x 16 block of the output is computed from x's rows
 *   as they lie. Its cost per weight row is paid over many rows, and the side streamed from
 *   memory is the broadcast one (6 floats a step, not 16), so a long prefill runs faster on
 *   strips than on panels. */
#define STRIP_ROWS 128 /* from here weight strips, below activation panels (measured crossover) */
#define PW 16 /* activation rows per panel */
#define NW 6  /* weight rows per panel block */

/* ------------------------------------------------------------------ few rows: panels */

#ifdef __AVX2__
/* r[i] (row i of an 8 x 8 block) -> r[e] (column e). */
static inline void transpose8(__m256 r[8]) {
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20); r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20); r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31); r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31); r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}
#endif

/* dst[e * PW + j] = src[j * lds + e] for j < 8, e < k (a multiple of 8): 8 rows into 8 lanes of a
 * k-major 16-wide panel or strip, by 8 x 8 register transposes (a float at a time, the stores
 * 64 bytes apart were a visible part of a many-row decode step in pack_rows). */
static void rows8_kmajor(const float *src, int64_t lds, int64_t k, float *dst) {
#ifdef __AVX2__
    for (int64_t e0 = 0; e0 < k; e0 += 8) {
        __m256 r[8];
        for (int j = 0; j < 8; j++) r[j] = _mm256_loadu_ps(src + j * lds + e0);
        transpose8(r);
        for (int e = 0; e < 8; e++) _mm256_storeu_ps(dst + (e0 + e) * PW, r[e]);
    }
#else
    for (int64_t e = 0; e < k; e++)
        for (int j = 0; j < 8; j++) dst[e * PW + j] = src[j * lds + e];
#endif
}

/* Row i of x into its place in a's panels. */
static void pack_row(const float *x, int64_t ldx, int64_t i, const Acts *a) {
    int64_t k = a->k;
    float *dst = a->p + (i / PW) * PW * k + i % PW;
    for (int64_t e = 0; e < k; e++) dst[e * PW] = x ? x[i * ldx + e] : 0.0f;
}

/* Rows [r0, r1) of x into their places in a's panels; the rows after the last (r1 == a->m) up
 * to the panel's end are zeroed, so the multiply-adds of a part-filled panel read numbers. */
static void pack_rows(const float *x, int64_t ldx, int64_t r0, int64_t r1, const Acts *a) {
    int64_t i = r0, k = a->k;
    for (; i < r1 && i % 8; i++) pack_row(x, ldx, i, a);
    for (; i + 8 <= r1; i += 8) rows8_kmajor(x + i * ldx, ldx, k, a->p + (i / PW) * PW * k + i % PW); /* whole 8s */
    for (; i < r1; i++) pack_row(x, ldx, i, a);
    if (r1 == a->m)
        for (int64_t j = a->m; j % PW; j++) pack_row(NULL, 0, j, a);
}

/* out[j * PW + i] = panel row i . weight row j (w + j * ldw) for j < nr, i < lanes (16 or 8).
 * The accumulators are named variables, not an array: gcc kept an array's elements in
 * registers only in some of the functions it inlined this into, and elsewhere stored all twelve
 * to the stack on every step (the same product slower or not depending on unrelated code). */
static inline __attribute__((always_inline)) void panel_micro(const int lanes, const int nr, const float *w,
                                                              int64_t ldw, const float *p, int64_t k, float *out) {
#ifdef __AVX2__
    const __m256 z = _mm256_setzero_ps();
    __m256 c00 = z, c01 = z, c10 = z, c11 = z, c20 = z, c21 = z, c30 = z, c31 = z, c40 = z, c41 = z, c50 = z, c51 = z;
    const float *w0 = w, *w1 = w0 + ldw, *w2 = w1 + ldw, *w3 = w2 + ldw, *w4 = w3 + ldw, *w5 = w4 + ldw;
    for (int64_t e = 0; e < k; e++) {
        __m256 a0 = _mm256_loadu_ps(p + e * PW), a1 = lanes > 8 ? _mm256_loadu_ps(p + e * PW + 8) : z;
#define PANEL_FMA(j)                                                  \
    if (nr > j) {                                                     \
        __m256 b = _mm256_broadcast_ss(w##j + e);                     \
        c##j##0 = _mm256_fmadd_ps(b, a0, c##j##0);                    \
        if (lanes > 8) c##j##1 = _mm256_fmadd_ps(b, a1, c##j##1);     \
    }
        PANEL_FMA(0) PANEL_FMA(1) PANEL_FMA(2) PANEL_FMA(3) PANEL_FMA(4) PANEL_FMA(5)
#undef PANEL_FMA
    }
#define PANEL_OUT(j)                                                      \
    if (nr > j) {                                                         \
        _mm256_storeu_ps(out + j * PW, c##j##0);                          \
        if (lanes > 8) _mm256_storeu_ps(out + j * PW + 8, c##j##1);       \
    }
    PANEL_OUT(0) PANEL_OUT(1) PANEL_OUT(2) PANEL_OUT(3) PANEL_OUT(4) PANEL_OUT(5)
#undef PANEL_OUT
#else
    for (int j = 0; j < nr; j++)
        for (int i = 0; i < lanes; i++) {
            float t = 0.0f;
            for (int64_t e = 0; e < k; e++) t += p[e * PW + i] * w[j * ldw + e];
            out[j * PW + i] = t;
        }
#endif
}

/* panel_micro() with constant lanes and row counts: unrolled, accumulators in registers. */
static void panel_tile(int lanes, int nr, const float *w, int64_t ldw, const float *p, int64_t k, float *out) {
#define ROWS_OF(L)                                          \
    switch (nr) {                                           \
    case 6: panel_micro(L, 6, w, ldw, p, k, out); break;    \
    case 5: panel_micro(L, 5, w, ldw, p, k, out); break;    \
    case 4: panel_micro(L, 4, w, ldw, p, k, out); break;    \
    case 3: panel_micro(L, 3, w, ldw, p, k, out); break;    \
    case 2: panel_micro(L, 2, w, ldw, p, k, out); break;    \
    default: panel_micro(L, 1, w, ldw, p, k, out); break;   \
    }
    if (lanes > 8) { ROWS_OF(16) } else { ROWS_OF(8) }
#undef ROWS_OF
}

/* y[i * ldy + r] = x_i . W[r] for i < a->m, r0 <= r < r1, x given as a's panels; tmp holds NW * k
 * floats. */
static void panel_gemm(int type, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, const Acts *a,
                       float *y, int64_t ldy, float *tmp) {
    int64_t k = a->k, m = a->m;
    for (int64_t n0 = r0; n0 < r1; n0 += NW) {
        int nr = r1 - n0 < NW ? (int)(r1 - n0) : NW;
        const float *wt = tmp;
        int64_t ldw = k;
        if (type == F32) {
            wt = (const float *)(w + n0 * row_bytes);
            ldw = row_bytes / (int64_t)sizeof(float);
        } else {
            for (int j = 0; j < nr; j++) expand_row(type, w + (n0 + j) * row_bytes, k, tmp + j * k);
        }
        for (int64_t i0 = 0; i0 < m; i0 += PW) {
            int mr = m - i0 < PW ? (int)(m - i0) : PW;
            float out[NW * PW];
            panel_tile(mr > 8 ? 16 : 8, nr, wt, ldw, a->p + i0 * k, k, out);
            for (int i = 0; i < mr; i++)
                for (int j = 0; j < nr; j++) y[(i0 + i) * ldy + n0 + j] = out[j * PW + i];
        }
    }
}

/* ------------------------------------------------------------------ many rows: weight strips */

/* The panels' register block with the roles swapped: 6 rows of x broadcast (MR), a strip of 16
 * weight rows (NR) loaded k-major as a panel is. */
#define MR NW
#define NR PW

/* wp[e * NR + j] = W[n0 + j][e] for j < nn (0 for nn <= j < NR); tmp holds 8 * k floats. */
static void pack_strip(int type, const uint8_t *w, int64_t row_bytes, int64_t n0, int nn, int64_t k, float *wp,
                      float *tmp) {
    for (int g = 0; g < NR; g += 8) {
        for (int j = 0; j < 8; j++) {
            if (g + j < nn) expand_row(type, w + (n0 + g + j) * row_bytes, k, tmp + j * k);
            else memset(tmp + j * k, 0, sizeof(float) * (size_t)k);
        }
        rows8_kmajor(tmp, k, k, wp + g);
    }
}

/* y[i * ldy + r] = x_i . W[r] for i < m, r0 <= r < r1; wp holds NR * k floats, tmp 8 * k. */
static void strip_gemm(int type, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, const float *x,
                      int64_t ldx, int64_t m, int64_t k, float *y, int64_t ldy, float *wp, float *tmp) {
    for (int64_t n0 = r0; n0 < r1; n0 += NR) {
        int nn = r1 - n0 < NR ? (int)(r1 - n0) : NR;
        pack_strip(type, w, row_bytes, n0, nn, k, wp, tmp);
        for (int64_t i0 = 0; i0 < m; i0 += MR) {
            int mr = m - i0 < MR ? (int)(m - i0) : MR;
            float out[MR * NR];
            const float *xi = x + i0 * ldx;
            panel_tile(NR, mr, xi, ldx, wp, k, out);
            for (int i = 0; i < mr; i++)
                for (int j = 0; j < nn; j++) y[(i0 + i) * ldy + n0 + j] = out[i * NR + j];
        }
    }
}

