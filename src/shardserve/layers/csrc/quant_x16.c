/* Products against Q4_0, Q4_1 and Q8_0 weights laid out 16 rows at a time ("x16" layouts), the
 * path a layer's product of those formats takes at every number of activation rows. Included by
 * quant_matmul.c after quantize16; not compiled alone.
 *
 * Why one path: a request's greedy tokens must not depend on what shares its step (one row
 * alone, or beside 31 others, or as the last row of a prefill whose prefix came from the cache).
 * So each output y[i][r] = x_i . W[r] is computed by one sequence of float operations whatever
 * the number of rows m:
 *     t = 0;  for each block b of 32 columns, in order:
 *         t = fma(float(I_b), s_b * dx_b, t);   t = fma(m_b, xs_b, t)     (no min term for Q8_0)
 * where s_b, m_b are the weight block's scale and minimum (Q4_0: m_b = -8 s_b), dx_b and xs_b the
 * activation block's 16-bit step and float sum (quantize16), and I_b = sum_e q_e xq_e the block's
 * integer product. I_b is exact in int32, so how its 32 products are grouped (which lanes, how
 * many accumulators, which instructions) cannot change it; only the float steps above need a
 * fixed order, and every kernel here runs them the same way, one weight row per vector lane.
 * An AVX2 machine runs each 16-lane step as two 8-lane halves: the same numbers.
 *
 * Layout: a QuantWeight keeps its [rows, row_bytes] bytes, but each group of 16 rows (the last
 * group: L = rows % 16 rows) is stored block by block, each block of the group as
 *     d[L] (f16 scales), [m[L] (f16 minimums, Q4_1)], then the quants in chunks:
 *     4-bit: 8 chunks of 2L bytes; chunk c holds columns 4c..4c+3: byte 2j+s of it has row j's
 *            column 4c+s in its low nibble and column 4c+2+s in its high nibble;
 *     8-bit: 16 chunks of 2L bytes; chunk p holds columns 2p, 2p+1: byte 2j+s is row j's 2p+s.
 * So a chunk widens to 32 16-bit weights (rows in pairs of columns) that multiply a broadcast
 * pair of activations (vpdpwssd with AVX512-VNNI or AVX-VNNI, else vpmaddwd and an add), 16
 * rows of one block at once; the group's bytes are L times one row's, so sizes do not change.
 * loader/quantized.py (`interleave16`) writes the layout; `x16_row` reads one row back.
 */

#define GL 16     /* rows per group */

/* Byte offset of the quants within a block of an L-row group. */
static inline int64_t quants_at(int base, int64_t lanes) { return (base == Q4_1 ? 4 : 2) * lanes; }

/* Row j's quant of column e (0..31) in a block of an L-row group: 0..15, or a signed byte. */
static inline int x16_quant(int base, const uint8_t *blk, int64_t lanes, int64_t j, int e) {
    const uint8_t *qs = blk + quants_at(base, lanes);
    if (base == Q8_0) return (int8_t)qs[(e / 2) * 2 * lanes + 2 * j + e % 2];
    uint8_t byte = qs[(e / 4) * 2 * lanes + 2 * j + e % 2];
    return (e % 4) < 2 ? byte & 0xF : byte >> 4;
}

/* Row r of an x16 weight of n rows, back in its base format's bytes (row_bytes of them). */
static void x16_row(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t r, uint8_t *out) {
    int base = x16_base(type);
    int64_t g0 = r / GL * GL, lanes = n - g0 < GL ? n - g0 : GL, j = r - g0, bb = block_bytes(base);
    const uint8_t *grp = w + g0 * row_bytes;
    if (base == F32) { /* column e of row j at [e][lanes] */
        for (int64_t e = 0; e < row_bytes / 4; e++) memcpy(out + 4 * e, grp + (e * lanes + j) * 4, 4);
        return;
    }
    if (base == BF16) { /* at [e / 2][lanes][e % 2] */
        for (int64_t e = 0; e < row_bytes / 2; e++) memcpy(out + 2 * e, grp + ((e / 2) * lanes * 2 + 2 * j + e % 2) * 2, 2);
        return;
    }
    for (int64_t b = 0; b < row_bytes / bb; b++) {
        const uint8_t *blk = grp + b * lanes * bb;
        uint8_t *o = out + b * bb;
        memcpy(o, blk + 2 * j, 2);
        if (base == Q4_1) memcpy(o + 2, blk + 2 * lanes + 2 * j, 2);
        uint8_t *qs = o + (base == Q4_1 ? 4 : 2);
        if (base == Q8_0) {
            for (int e = 0; e < QK; e++) qs[e] = (uint8_t)x16_quant(base, blk, lanes, j, e);
        } else {
            for (int e = 0; e < 16; e++)
                qs[e] = (uint8_t)(x16_quant(base, blk, lanes, j, e) | x16_quant(base, blk, lanes, j, e + 16) << 4);
        }
    }
}

/* The last group, `lanes` rows, copied into 16 lanes, the missing ones zero, so the same kernel
 * runs it (its zero rows are computed and not stored). Every x16 layout is a run of `n` strips
 * of `unit` bytes a lane: a block format's d, [m] and chunks (2 bytes a lane each), a float
 * column, a bfloat16 pair of columns (4). */
static void x16_pad_lanes(const uint8_t *grp, int64_t lanes, int64_t n, int64_t unit, uint8_t *out) {
    for (int64_t e = 0; e < n; e++) {
        memcpy(out + e * GL * unit, grp + e * lanes * unit, (size_t)(unit * lanes));
        memset(out + (e * GL + lanes) * unit, 0, (size_t)(unit * (GL - lanes)));
    }
}

/* A block format's last group: per block its 2-byte parts, nb blocks. */
static void x16_pad(int base, const uint8_t *grp, int64_t lanes, int64_t nb, uint8_t *out) {
    x16_pad_lanes(grp, lanes, nb * (block_bytes(base) / 2), 2, out);
}

#include "x16_vectors.c" /* VF, VI and their operations: AVX-512, or two AVX2 halves; NXMAX */

#ifdef X16_VEC
/* Rows i0 .. i0 + nx - 1 of the activations times one 16-row group (grp, nb blocks): y[(i0 + j)
 * * ldy + lane] for the first `lanes` lanes. always_inline with constant type and nx: the row
 * loop unrolls and the accumulators stay in registers. With one or two rows the chunks' products
 * go to two accumulators a row (even and odd chunks), so consecutive multiply-adds do not wait
 * on each other; integer sums, so the result is the same. */
static inline __attribute__((always_inline)) void x16_tile(const int base, const int nx, const uint8_t *grp,
                                                           int64_t nb, const Acts *a, int64_t i0, float *y,
                                                           int64_t ldy, int lanes) {
    const int64_t k = a->k, bb = block_bytes(base) * GL, q0 = quants_at(base, GL);
    const int16_t *xq = a->q + i0 * k;
    const float *xd = a->d + i0 * (k / QK), *xs = a->s + i0 * (k / QK);
    VF t0 = vf_zero(), t1 = t0, t2 = t0, t3 = t0, t4 = t0, t5 = t0, t6 = t0, t7 = t0, t8 = t0, t9 = t0, t10 = t0,
       t11 = t0;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = grp + b * bb, *qs = blk + q0;
        const int16_t *xb = xq + b * QK;
        VI c0 = vi_zero(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0, c8 = c0, c9 = c0, c10 = c0,
           c11 = c0;
        /* second accumulators (nx <= 2; the others only name the macros' untaken branches) */
        VI e0 = c0, e1 = c0, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11;
        (void)e2, (void)e3, (void)e4, (void)e5, (void)e6, (void)e7, (void)e8, (void)e9, (void)e10, (void)e11;
        if (base == Q8_0) {
            for (int p = 0; p < 16; p++) {
                VI w = w8(qs + p * 2 * GL);
                const int16_t *xp = xb + 2 * p;
#define DP8(j)                                                                        \
    if (nx > j) {                                                                     \
        if (nx <= 2 && (p & 1)) e##j = dp(e##j, w, xp + j * k);                       \
        else c##j = dp(c##j, w, xp + j * k);                                          \
    }
                DP8(0) DP8(1) DP8(2) DP8(3) DP8(4) DP8(5) DP8(6) DP8(7) DP8(8) DP8(9) DP8(10) DP8(11)
#undef DP8
            }
        } else {
            for (int c = 0; c < 8; c++) {
                VI lo, hi;
                w4(qs + c * 2 * GL, &lo, &hi);
                const int16_t *xc = xb + 4 * c;
#define DP4(j)                                                                        \
    if (nx > j) {                                                                     \
        if (nx <= 2) { c##j = dp(c##j, lo, xc + j * k); e##j = dp(e##j, hi, xc + j * k + 2); } \
        else { c##j = dp(c##j, lo, xc + j * k); c##j = dp(c##j, hi, xc + j * k + 2); }          \
    }
                DP4(0) DP4(1) DP4(2) DP4(3) DP4(4) DP4(5) DP4(6) DP4(7) DP4(8) DP4(9) DP4(10) DP4(11)
#undef DP4
            }
        }
        if (nx <= 2) { c0 = vi_add(c0, e0); c1 = vi_add(c1, e1); }
        VF s = f16s(blk), mn = base == Q4_1 ? f16s(blk + 2 * GL) : vf_scale(s, -8.0f);
#define EPI(j)                                                                        \
    if (nx > j) {                                                                     \
        t##j = vf_fma_i(c##j, vf_scale(s, xd[j * (k / QK) + b]), t##j);               \
        if (base != Q8_0) t##j = vf_fma_c(mn, xs[j * (k / QK) + b], t##j);            \
    }
        EPI(0) EPI(1) EPI(2) EPI(3) EPI(4) EPI(5) EPI(6) EPI(7) EPI(8) EPI(9) EPI(10) EPI(11)
#undef EPI
    }
#define OUT(j) \
    if (nx > j) vf_store(y + (i0 + j) * ldy, t##j, lanes);
    OUT(0) OUT(1) OUT(2) OUT(3) OUT(4) OUT(5) OUT(6) OUT(7) OUT(8) OUT(9) OUT(10) OUT(11)
#undef OUT
}

/* x16_tile() for a->m <= NXMAX rows, the count a constant in each case. */
static inline __attribute__((always_inline)) void x16_tiles(const int base, const uint8_t *grp, int64_t nb,
                                                            const Acts *a, float *y, int64_t ldy) {
    switch ((int)a->m) {
#if NXMAX > 8
    case 12: x16_tile(base, 12, grp, nb, a, 0, y, ldy, GL); break;
    case 11: x16_tile(base, 11, grp, nb, a, 0, y, ldy, GL); break;
    case 10: x16_tile(base, 10, grp, nb, a, 0, y, ldy, GL); break;
    case 9: x16_tile(base, 9, grp, nb, a, 0, y, ldy, GL); break;
#endif
    case 8: x16_tile(base, 8, grp, nb, a, 0, y, ldy, GL); break;
    case 7: x16_tile(base, 7, grp, nb, a, 0, y, ldy, GL); break;
    case 6: x16_tile(base, 6, grp, nb, a, 0, y, ldy, GL); break;
    case 5: x16_tile(base, 5, grp, nb, a, 0, y, ldy, GL); break;
    case 4: x16_tile(base, 4, grp, nb, a, 0, y, ldy, GL); break;
    case 3: x16_tile(base, 3, grp, nb, a, 0, y, ldy, GL); break;
    case 2: x16_tile(base, 2, grp, nb, a, 0, y, ldy, GL); break;
    default: x16_tile(base, 1, grp, nb, a, 0, y, ldy, GL); break;
    }
}
#endif

/* y[i * ldy + r] = x_i . W[r] for i < a->m and r0 <= r < r1 of an x16 weight of n rows, x as
 * a's 16-bit blocks; `pad` holds 16 * row_bytes bytes (the last group, padded). */
static void x16_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t r0, int64_t r1,
                     const Acts *a, float *y, int64_t ldy, uint8_t *pad) {
    int base = x16_base(type);
    int64_t nb = row_bytes / block_bytes(base);
    for (int64_t g0 = r0 / GL * GL; g0 < r1; g0 += GL) {
        int64_t lanes = n - g0 < GL ? n - g0 : GL, lo = r0 > g0 ? r0 - g0 : 0, hi = r1 - g0 < lanes ? r1 - g0 : lanes;
        const uint8_t *grp = w + g0 * row_bytes;
        if (lanes < GL) {
            x16_pad(base, grp, lanes, nb, pad);
            grp = pad;
        }
#ifdef X16_VEC
        float out[NXMAX * GL];
        /* A claimed run starts and ends on group bounds except where a fused weight's segment
         * does not: then the group is computed whole into `out` and only rows [lo, hi) kept. */
        int whole = lo == 0 && hi == GL;
        Acts one = *a;
        for (int64_t i = 0; i < a->m; i += NXMAX) {
            one.m = a->m - i < NXMAX ? a->m - i : NXMAX;
            one.q = a->q + i * a->k;
            one.d = a->d + i * (a->k / QK);
            one.s = a->s + i * (a->k / QK);
            float *yt = whole ? y + i * ldy + g0 : out;
            int64_t ld = whole ? ldy : GL;
            switch (base) {
            case Q4_0: x16_tiles(Q4_0, grp, nb, &one, yt, ld); break;
            case Q4_1: x16_tiles(Q4_1, grp, nb, &one, yt, ld); break;
            default: x16_tiles(Q8_0, grp, nb, &one, yt, ld); break;
            }
            if (!whole)
                for (int64_t j = 0; j < one.m; j++) memcpy(y + (i + j) * ldy + g0 + lo, out + j * GL + lo,
                                                           sizeof(float) * (size_t)(hi - lo));
        }
#else
        /* No vector unit: the same operations one lane at a time. */
        int64_t k = a->k;
        for (int64_t i = 0; i < a->m; i++)
            for (int64_t j = lo; j < hi; j++) {
                float t = 0.0f;
                for (int64_t b = 0; b < nb; b++) {
                    const uint8_t *blk = grp + b * GL * block_bytes(base);
                    int32_t acc = 0;
                    for (int e = 0; e < QK; e++) acc += x16_quant(base, blk, GL, j, e) * a->q[i * k + b * QK + e];
                    float s = f16(blk + 2 * j), mn = base == Q4_1 ? f16(blk + 2 * GL + 2 * j) : s * -8.0f;
                    t = fmaf((float)acc, s * a->d[i * (k / QK) + b], t);
                    if (base != Q8_0) t = fmaf(mn, a->s[i * (k / QK) + b], t);
                }
                y[i * ldy + g0 + j] = t;
            }
#endif
    }
}

#ifndef X16_PATH
#define X16_PATH "scalar"
#endif
