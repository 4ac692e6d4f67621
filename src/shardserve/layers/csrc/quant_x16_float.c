/* Products against float32 or bfloat16 rows in x16 groups (F32 | X16, BF16 | X16), for
 * quant_matmul.c, which includes this file after quant_x16.c (whose vector helpers it uses); not
 * compiled alone.
 *
 * Each group of 16 rows is stored column by column, [k][L] floats (L = 16, or rows % 16 for the
 * last), or bfloat16 in pairs of columns, [k / 2][L][2] (the pair layout AMX tiles read, see
 * quant_amx.c, which runs bfloat16 products where the CPU has AMX). One sequence of operations
 * per output whatever the number of rows, so a checkpoint's results are batch-invariant:
 * - `kind` F32 (float32 weights) and BF16F (bfloat16 weights, float32 activations): t = 0; for
 *   e = 0 .. k - 1 in order, t = fma(w_e, x_e, t), one weight row per lane. A bfloat16 weight
 *   widens to its float exactly, so BF16F is the float32 product of the same weights, bit for
 *   bit, reading half the bytes (what a one-row decode step is bound by).
 * - `kind` BF16D (AVX512-BF16, where AMX is not in use): the activations rounded to bfloat16 as
 *   for AMX (bf16_rows_of), and t = vdpbf16ps(t, W_p, x_p) for each pair of columns p in order:
 *   a pair of weights is one lane's 32 bits of the stored vector, a pair of activations one
 *   broadcast dword, and one instruction adds both products to the lane's float32 sum. Half the
 *   instructions of BF16F (no widening, two products each) with the numbers of bfloat16
 *   activations, as on AMX tiles. SHARDSERVE_FLOAT32_ACTIVATIONS=1 keeps BF16F.
 */

enum { F32K, BF16F, BF16D }; /* the kinds above: the first argument of the functions below */

#if defined(X16_VEC) && defined(__AVX512BF16__) && defined(__AVX512F__)
#define DPBF_BUILT 1
#define DPBF_PATH_ON "x16 groups on avx512-bf16 vdpbf16ps (bfloat16 activations)"
/* ng groups times nx rows of bfloat16 activations (rows ldx apart), as f32_tile arranges them */
static inline __attribute__((always_inline)) void dpbf_tile(const int ng, const int nx, const uint16_t *g0,
                                                            int64_t gstride, const uint16_t *x, int64_t ldx,
                                                            int64_t k, float *y, int64_t ldy) {
    __m512 c[4][8];
    for (int g = 0; g < ng; g++)
        for (int j = 0; j < nx; j++) c[g][j] = _mm512_setzero_ps();
    for (int64_t e = 0; e < k; e += 2) { /* the pair of columns e, e + 1 */
        __m512bh xp[8];
        for (int j = 0; j < nx; j++) {
            int32_t pair;
            memcpy(&pair, x + j * ldx + e, 4);
            xp[j] = (__m512bh)_mm512_set1_epi32(pair);
        }
        for (int g = 0; g < ng; g++) {
            __m512bh w = (__m512bh)_mm512_loadu_si512((const void *)(g0 + g * gstride + e * GL));
            for (int j = 0; j < nx; j++) c[g][j] = _mm512_dpbf16_ps(c[g][j], w, xp[j]);
        }
    }
    for (int g = 0; g < ng; g++)
        for (int j = 0; j < nx; j++) vf_store(y + j * ldy + g * GL, c[g][j], GL);
}
#else
#define DPBF_BUILT 0
#define DPBF_PATH_ON ""
#endif

#ifdef X16_VEC
/* ng groups (the first at grp, `gstride` weights apart) times nx activation rows (floats, or
 * bfloat16 for BF16D), ng * nx <= 16
 * sums, each its own chain of multiply-adds: few rows take 4 groups (chains enough to hide the
 * latency), many take 2 groups by 8 rows (half the weight loads per multiply-add). */
static inline __attribute__((always_inline)) void f32_tile(const int kind, const int ng, const int nx, const void *grp,
                                                           int64_t gstride, const void *xv, int64_t ldx, int64_t k,
                                                           float *y, int64_t ldy) {
#if DPBF_BUILT
    if (kind == BF16D) {
        dpbf_tile(ng, nx, grp, gstride, xv, ldx, k, y, ldy);
        return;
    }
#endif
    const int bf = kind == BF16F;
    const float *x = xv;
    const VF z = vf_zero();
    VF c00 = z, c01 = z, c02 = z, c03 = z, c04 = z, c05 = z, c06 = z, c07 = z;
    VF c10 = z, c11 = z, c12 = z, c13 = z, c14 = z, c15 = z, c16 = z, c17 = z;
    VF c20 = z, c21 = z, c22 = z, c23 = z, c30 = z, c31 = z, c32 = z, c33 = z;
    const int64_t es = bf ? 2 : 4; /* bytes a weight */
    const uint8_t *g0 = grp, *g1 = g0 + gstride * es, *g2 = g1 + gstride * es, *g3 = g2 + gstride * es;
    for (int64_t e = 0; e < k; e += 2) { /* columns e and e + 1, in that order (k is even) */
        /* The groups' weights of both columns, then each activation broadcast once into a
         * register for every group (folded into each multiply-add instead, the broadcasts alone
         * would keep the load ports busy). */
        VF w00 = z, w01 = z, w10 = z, w11 = z, w20 = z, w21 = z, w30 = z, w31 = z;
#define W_PAIR(gi)                                                                 \
    if (ng > gi) {                                                                 \
        if (bf) vf_load_bf16x2((const uint16_t *)(g##gi) + e * GL, &w##gi##0, &w##gi##1); \
        else { w##gi##0 = vf_load((const float *)(g##gi) + e * GL); w##gi##1 = vf_load((const float *)(g##gi) + (e + 1) * GL); } \
    }
        W_PAIR(0) W_PAIR(1) W_PAIR(2) W_PAIR(3)
#undef W_PAIR
#define F32_FMA(gi, j, o) if (ng > gi) c##gi##j = vf_fma(w##gi##o, b, c##gi##j);
#define F32_ROW8(j, o) if (nx > j) { const VF b = vf_bcast(x + j * ldx + e + o); F32_FMA(0, j, o) F32_FMA(1, j, o) }
#define F32_ROW4(j, o) if (nx > j) { const VF b = vf_bcast(x + j * ldx + e + o); F32_FMA(0, j, o) F32_FMA(1, j, o) F32_FMA(2, j, o) F32_FMA(3, j, o) }
#define F32_COLUMN8(o) F32_ROW8(0, o) F32_ROW8(1, o) F32_ROW8(2, o) F32_ROW8(3, o) F32_ROW8(4, o) F32_ROW8(5, o) F32_ROW8(6, o) F32_ROW8(7, o)
#define F32_COLUMN4(o) F32_ROW4(0, o) F32_ROW4(1, o) F32_ROW4(2, o) F32_ROW4(3, o)
        if (nx > 4) { F32_COLUMN8(0) F32_COLUMN8(1) }
        else { F32_COLUMN4(0) F32_COLUMN4(1) }
#undef F32_COLUMN4
#undef F32_COLUMN8
#undef F32_ROW4
#undef F32_ROW8
#undef F32_FMA
    }
#define F32_OUT(gi, j) \
    if (ng > gi && nx > j) vf_store(y + j * ldy + gi * GL, c##gi##j, GL);
    F32_OUT(0, 0) F32_OUT(0, 1) F32_OUT(0, 2) F32_OUT(0, 3) F32_OUT(0, 4) F32_OUT(0, 5) F32_OUT(0, 6) F32_OUT(0, 7)
    F32_OUT(1, 0) F32_OUT(1, 1) F32_OUT(1, 2) F32_OUT(1, 3) F32_OUT(1, 4) F32_OUT(1, 5) F32_OUT(1, 6) F32_OUT(1, 7)
    F32_OUT(2, 0) F32_OUT(2, 1) F32_OUT(2, 2) F32_OUT(2, 3) F32_OUT(3, 0) F32_OUT(3, 1) F32_OUT(3, 2) F32_OUT(3, 3)
#undef F32_OUT
}

/* f32_tile() with constant counts: nx <= 4 with ng <= 4, or nx <= 8 with ng <= 2 (kind a
 * constant at each call). */
static inline __attribute__((always_inline)) void f32_tiles(const int kind, int ng, int nx, const void *grp,
                                                            int64_t gstride, const void *x, int64_t ldx, int64_t k,
                                                            float *y, int64_t ldy) {
#define NX_OF(G)                                                                 \
    switch (nx) {                                                                \
    case 4: f32_tile(kind, G, 4, grp, gstride, x, ldx, k, y, ldy); break;              \
    case 3: f32_tile(kind, G, 3, grp, gstride, x, ldx, k, y, ldy); break;              \
    case 2: f32_tile(kind, G, 2, grp, gstride, x, ldx, k, y, ldy); break;              \
    default: f32_tile(kind, G, 1, grp, gstride, x, ldx, k, y, ldy); break;             \
    }
#define NX8_OF(G)                                                                \
    switch (nx) {                                                                \
    case 8: f32_tile(kind, G, 8, grp, gstride, x, ldx, k, y, ldy); break;              \
    case 7: f32_tile(kind, G, 7, grp, gstride, x, ldx, k, y, ldy); break;              \
    case 6: f32_tile(kind, G, 6, grp, gstride, x, ldx, k, y, ldy); break;              \
    default: f32_tile(kind, G, 5, grp, gstride, x, ldx, k, y, ldy); break;             \
    }
    if (nx > 4) {
        if (ng == 2) { NX8_OF(2) } else { NX8_OF(1) }
        return;
    }
    switch (ng) {
    case 4: NX_OF(4) break;
    case 3: NX_OF(3) break;
    case 2: NX_OF(2) break;
    default: NX_OF(1) break;
    }
#undef NX8_OF
#undef NX_OF
}
#endif

/* A float layout's last group: n strips of 4 bytes a lane ([k][L] floats, [k / 2][L][2] bfloat16). */
static void x16_pad_float(const uint8_t *grp, int64_t lanes, int64_t n, uint8_t *out) {
    x16_pad_lanes(grp, lanes, n, 4, out);
}

/* Weight e of lane l in a [k][16] group, as a float (the path without vector units). */
static inline float wval(int bf, const uint8_t *grp, int64_t e, int64_t l) {
    if (bf) { /* pairs of columns: [e / 2][l][e % 2] */
        uint16_t h;
        memcpy(&h, grp + 2 * ((e / 2) * 2 * GL + 2 * l + e % 2), 2);
        return bf16(h);
    }
    float f;
    memcpy(&f, grp + 4 * (e * GL + l), 4);
    return f;
}

/* Rows [lo, hi) of the group at g0 (part-claimed, or the last, part-filled one: lanes < 16)
 * times all m activation rows, through `out`; `pad` holds 16 * k floats. */
static inline __attribute__((always_inline)) void f32x16_edge(const int kind, const uint8_t *w, int64_t n, int64_t g0,
                                                              int64_t lo, int64_t hi, const void *xv, int64_t ldx,
                                                              int64_t m, int64_t k, float *y, int64_t ldy, float *pad) {
    const int bf = kind != F32K;
    const int64_t es = bf ? 2 : 4, xs = kind == BF16D ? 2 : 4, lanes = n - g0 < GL ? n - g0 : GL;
    const float *x = xv;
    (void)x, (void)xs;
    const uint8_t *grp = w + g0 * k * es;
    if (lanes < GL) { /* the last group, [k][lanes] (bf16: [k / 2][lanes][2]), padded to 16 lanes */
        x16_pad_float(grp, lanes, bf ? k / 2 : k, (uint8_t *)pad);
        grp = (const uint8_t *)pad;
    }
    float out[4 * GL];
    for (int64_t i = 0; i < m; i += 4) {
        int nx = m - i < 4 ? (int)(m - i) : 4;
#ifdef X16_VEC
        f32_tiles(kind, 1, nx, grp, GL * k, (const uint8_t *)xv + i * ldx * xs, ldx, k, out, GL);
#else
        for (int j = 0; j < nx; j++)
            for (int l = 0; l < GL; l++) {
                float t = 0.0f;
                for (int64_t e = 0; e < k; e++) t = fmaf(wval(bf, grp, e, l), x[(i + j) * ldx + e], t);
                out[j * GL + l] = t;
            }
#endif
        for (int j = 0; j < nx; j++) memcpy(y + (i + j) * ldy + g0 + lo, out + j * GL + lo, sizeof(float) * (size_t)(hi - lo));
    }
}

/* Weight bytes a thread passes over all its activation rows at a time (a panel: f32x16_rows,
 * amx_rows, amx_silu_run): each tile of activation rows, in L1, meets every group of the panel
 * while the panel stays in L2 (2 MB a core on the AMX Xeons), and the groups stream from it in
 * order, which the prefetchers follow; the activations' tiles, at their row stride, they follow
 * less well. */
#define PANEL_BYTES (768 * 1024)

/* Weight rows of a panel, `row_bytes` each: whole grains of rows, at least one. */
static inline int64_t panel_rows(int64_t row_bytes, int64_t grain) {
    const int64_t rows = PANEL_BYTES / row_bytes / grain * grain;
    return rows > grain ? rows : grain;
}

/* y[i * ldy + r] = x_i . W[r] for i < m, r0 <= r < r1, W float32 (kind F32K) or bfloat16 in
 * x16 groups (n rows of k), x float32 rows ldx apart (bfloat16 for BF16D, whose path exists only
 * where DPBF_BUILT); `pad` holds 16 * k floats. All m rows (qmatmul_rows does not cut them into
 * row blocks): the whole groups panel by panel (panel_rows), each tile of rows against the
 * panel's groups in runs of up to 4 (2 for 8 rows); a part-filled or part-claimed group at
 * either end alone (f32x16_edge). */
static inline __attribute__((always_inline)) void f32x16_rows(const int kind, const uint8_t *w, int64_t n, int64_t r0,
                                                              int64_t r1, const void *xv, int64_t ldx, int64_t m,
                                                              int64_t k, float *y, int64_t ldy, float *pad) {
    const int bf = kind != F32K;
    const int64_t es = bf ? 2 : 4, xs = kind == BF16D ? 2 : 4; /* bytes a weight, an activation */
    const float *x = xv; /* the float paths' activations */
    (void)x, (void)xs;
    const int64_t a = (r0 + GL - 1) / GL * GL, b = r1 / GL * GL; /* whole groups [a, b): r1 <= n */
    if (a >= b) { /* within one group, or two part-claimed ones */
        for (int64_t g0 = r0 / GL * GL; g0 < r1; g0 += GL)
            f32x16_edge(kind, w, n, g0, r0 > g0 ? r0 - g0 : 0, r1 - g0 < GL ? r1 - g0 : GL, xv, ldx, m, k, y, ldy, pad);
        return;
    }
    if (r0 < a) f32x16_edge(kind, w, n, a - GL, r0 - (a - GL), GL, xv, ldx, m, k, y, ldy, pad);
    const int rows = m >= 8 ? 8 : 4, most = 16 / rows;
    const int64_t panel = panel_rows(k * es, 4 * GL);
    for (int64_t p0 = a; p0 < b; p0 += panel) {
        const int64_t p1 = p0 + panel < b ? p0 + panel : b;
#ifdef X16_VEC
        for (int64_t i = 0; i < m; i += rows)
            for (int64_t g0 = p0; g0 < p1;) {
                const int ng = (p1 - g0) / GL < most ? (int)((p1 - g0) / GL) : most;
                f32_tiles(kind, ng, m - i < rows ? (int)(m - i) : rows, w + g0 * k * es, GL * k,
                          (const uint8_t *)xv + i * ldx * xs, ldx, k, y + i * ldy + g0, ldy);
                g0 += ng * GL;
            }
#else
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = p0; j < p1; j++) {
                float t = 0.0f;
                const uint8_t *g = w + (j / GL) * GL * k * es;
                for (int64_t e = 0; e < k; e++) t = fmaf(wval(bf, g, e, j % GL), x[i * ldx + e], t);
                y[i * ldy + j] = t;
            }
#endif
    }
    if (b < r1) f32x16_edge(kind, w, n, b, 0, r1 - b, xv, ldx, m, k, y, ldy, pad);
}
