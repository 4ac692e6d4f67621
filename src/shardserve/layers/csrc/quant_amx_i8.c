/* Products against Q4_0, Q4_1 and Q8_0 weights in x16 groups on AMX-INT8 tiles, for
 * quant_matmul.c, which includes this file after quant_amx.c; not compiled alone.
 *
 * The numbers are x16_tile's (quant_x16.c), so a request's tokens do not depend on which of the
 * two paths its step took: per weight block of 32 columns the integer product I_b = sum_e q_e xq_e
 * is exact, and the float steps after it are x16_tile's, in its order. The tiles multiply bytes
 * and the activations are 16-bit, so each is split as xq = 256 hi + lo (hi = xq >> 8 a signed
 * byte, lo = xq & 255 an unsigned one), and per block, for a tile of 16 activation rows against a
 * group of 16 weight rows,
 *     S_hi = TDPBSSD(hi, w),  S_lo = TDPBUSD(lo, w),  I_b = 256 S_hi + S_lo   (exact in int32;
 * w: 0..15 for the 4-bit formats, a signed byte for Q8_0). The sums leave the tiles after every
 * block for the float steps, which run on the vector unit while the tiles take the next block.
 *
 * A tile's B operand holds 4 columns of a weight row in each 32-bit lane, which the x16 chunks do
 * not, so each panel of a claimed run's groups is first unpacked into that form (`i8_unpack`: one
 * byte a weight, the scales widened to floats), then every tile of activation rows passes over
 * the panel's groups, as amx_rows does. From I8_ROWS activation rows on: below, most of a tile's
 * rows would be padding, and x16_tile runs the few rows faster.
 */

#define I8_ROWS 16 /* activation rows from which the x16 block products take the tiles */

#if AMX_I8_BUILT

/* Tiles 0, 1: S_hi, S_lo of even blocks, 2, 3 of odd blocks; 4, 5: hi and lo of 16 activation
 * rows (32 bytes each); 6: a group's block (8 rows of 16 lanes x 4 columns). */
static const TileConfig i8_config = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 32, 32, 64},
    .rows = {16, 16, 16, 16, 16, 16, 8},
};

/* One block of a group as the tiles read it: w[r][4 l + c] is lane l's column 4 r + c. */
typedef struct {
    int8_t w[8][64];
    float s[GL], mn[GL]; /* the scales; minimums (Q4_0: -8 s; unused for Q8_0) */
} I8Block;

/* The probe's product: -3 x 5 (signed) and 200 x 5 (unsigned) over 32 columns. */
static int i8_product(void) {
    int8_t hi[16 * 32], w[8 * 64];
    uint8_t lo[16 * 32];
    int32_t sh[16 * 16], sl[16 * 16];
    memset(hi, -3, sizeof hi);
    memset(lo, 200, sizeof lo);
    memset(w, 5, sizeof w);
    _tile_loadconfig(&i8_config);
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(4, hi, 32);
    _tile_loadd(5, lo, 32);
    _tile_loadd(6, w, 64);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbusd(1, 5, 6);
    _tile_stored(0, sh, 64);
    _tile_stored(1, sl, 64);
    _tile_release();
    for (int i = 0; i < 16 * 16; i++)
        if (sh[i] != -480 || sl[i] != 32000) return 0;
    return 1;
}

static int i8_on; /* set once, when the library loads */
static const char *i8_why = ""; /* why not, for kernel_paths() */
__attribute__((constructor)) static void i8_init(void) {
    i8_why = amx_permitted();
    if (!i8_why) i8_why = amx_probe(i8_product, "the AMX-INT8 probe's tile product came out wrong");
    i8_on = !i8_why;
}
static inline int i8_ready(void) { return i8_on; }

/* The nb blocks of a 16-lane group (x16 layout) as I8Blocks. */
static void i8_unpack(const int base, const uint8_t *grp, int64_t nb, I8Block *out) {
    const int64_t bb = block_bytes(base) * GL, q0 = quants_at(base, GL);
    const __m512i low = _mm512_set1_epi32(0x0F0F), high = _mm512_set1_epi32(0x0F0F0000);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = grp + b * bb, *qs = blk + q0;
        I8Block *o = out + b;
        const __m512 s = f16s(blk);
        _mm512_store_ps(o->s, s);
        _mm512_store_ps(o->mn, base == Q4_1 ? f16s(blk + 2 * GL) : vf_scale(s, -8.0f));
        for (int r = 0; r < 8; r++) {
            __m512i v;
            if (base == Q8_0) { /* chunks 2r, 2r + 1: each lane's columns 4r, 4r + 1, then 4r + 2, 4r + 3 */
                __m512i c0 = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(qs + 2 * r * 2 * GL)));
                __m512i c1 = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(qs + (2 * r + 1) * 2 * GL)));
                v = _mm512_or_si512(c0, _mm512_slli_epi32(c1, 16));
            } else { /* chunk r: low nibbles are columns 4r, 4r + 1, high ones 4r + 2, 4r + 3 */
                __m512i c = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(qs + r * 2 * GL)));
                v = _mm512_or_si512(_mm512_and_si512(c, low), _mm512_and_si512(_mm512_slli_epi32(c, 12), high));
            }
            _mm512_store_si512(o->w[r], v);
        }
    }
}

/* Where block b of the tile of activation rows [i0, i0 + 16) starts in a's hi and lo: 16 rows of
 * its 32 columns, 32 bytes apart. */
static inline int64_t i8_at(int64_t i0, int64_t b, int64_t nb) { return (i0 / 16 * nb + b) * 16 * QK; }

/* Block `blk` against the activation tile (hi, lo: 16 rows 32 bytes apart) into tiles 0, 1 (odd: 2, 3). */
static inline __attribute__((always_inline)) void i8_issue(int odd, const int8_t *hi, const uint8_t *lo,
                                                           const I8Block *blk) {
    if (odd) {
        _tile_zero(2);
        _tile_zero(3);
    } else {
        _tile_zero(0);
        _tile_zero(1);
    }
    _tile_loadd(4, hi, QK);
    _tile_loadd(5, lo, QK);
    _tile_loadd(6, blk->w, 64);
    if (odd) {
        _tile_dpbssd(2, 4, 6);
        _tile_dpbusd(3, 5, 6);
    } else {
        _tile_dpbssd(0, 4, 6);
        _tile_dpbusd(1, 5, 6);
    }
}

/* x16_tile's float steps of one block for 16 rows: t = fma(float(I), s dx, t), then (not Q8_0)
 * t = fma(mn, xs, t); dx and xs of row r at xd[r nb], xs[r nb]. */
static inline __attribute__((always_inline)) void i8_steps(const int base, __m512 *t, const int32_t *sh,
                                                           const int32_t *sl, const I8Block *blk, const float *xd,
                                                           const float *xs, int64_t nb) {
    const __m512 s = _mm512_load_ps(blk->s), mn = _mm512_load_ps(blk->mn);
#pragma GCC unroll 16 /* t stays in registers */
    for (int r = 0; r < 16; r++) {
        __m512i i = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sh + 16 * r), 8),
                                     _mm512_load_si512(sl + 16 * r));
        t[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(s, _mm512_set1_ps(xd[r * nb])), t[r]);
        if (base != Q8_0) t[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[r * nb]), t[r]);
    }
}

/* Activation rows [i0, i0 + 16) times one unpacked group: its lanes in `keep` stored to y (rows
 * below m). Block b + 1's tile products are issued before block b's float steps, into the other
 * pair of accumulators, so the two units overlap. */
static inline __attribute__((always_inline)) void i8_tile(const int base, const I8Block *blks, int64_t nb,
                                                          const Acts *a, int64_t i0, float *y, int64_t ldy,
                                                          __mmask16 keep) {
    const int8_t *hi = a->h + i8_at(i0, 0, nb);
    const uint8_t *lo = a->l + i8_at(i0, 0, nb);
    const float *xd = a->d + i0 * nb, *xs = a->s + i0 * nb;
    int32_t sh[16 * 16] __attribute__((aligned(64))), sl[16 * 16] __attribute__((aligned(64)));
    __m512 t[16];
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++) t[r] = _mm512_setzero_ps();
    i8_issue(0, hi, lo, blks);
    for (int64_t b = 0; b < nb; b++) {
        if (b & 1) { /* taken out before the next block is issued: the tiles run in order */
            _tile_stored(2, sh, 64);
            _tile_stored(3, sl, 64);
        } else {
            _tile_stored(0, sh, 64);
            _tile_stored(1, sl, 64);
        }
        if (b + 1 < nb) i8_issue(!(b & 1), hi + (b + 1) * 16 * QK, lo + (b + 1) * 16 * QK, blks + b + 1);
        i8_steps(base, t, sh, sl, blks + b, xd + b, xs + b, nb);
    }
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++)
        if (i0 + r < a->m) _mm512_mask_storeu_ps(y + (i0 + r) * ldy, keep, t[r]);
}

/* Bytes of scratch i8_rows needs after a block format's padded group (gemm_scratch). */
static size_t i8_scratch(int64_t k) {
    const size_t group = sizeof(I8Block) * (size_t)(k / QK);
    return (group > PANEL_BYTES ? group : PANEL_BYTES) + 64;
}

/* y[i * ldy + r] = x_i . W[r] for i < a->m, r0 <= r < r1: W an x16 weight of a block format (n
 * rows), x as a's split rows (hi, lo; d, s), readable up to m rounded up to 16 (acts_alloc).
 * `pad` holds 16 * row_bytes bytes and then i8_scratch(k). All m rows, panel by panel. */
static void i8_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t r0, int64_t r1, const Acts *a,
                    float *y, int64_t ldy, uint8_t *pad) {
    const int base = x16_base(type);
    const int64_t nb = a->k / QK, panel = panel_rows(nb * (int64_t)sizeof(I8Block) / GL, GL);
    I8Block *blks = (I8Block *)(((uintptr_t)(pad + 16 * row_bytes) + 63) & ~(uintptr_t)63);
    for (int64_t p0 = r0 / GL * GL; p0 < r1; p0 += panel) {
        const int64_t p1 = p0 + panel < r1 ? p0 + panel : r1; /* groups [p0, p1 rounded up) */
        for (int64_t g0 = p0; g0 < p1; g0 += GL) {
            const int64_t lanes = n - g0 < GL ? n - g0 : GL;
            const uint8_t *grp = w + g0 * row_bytes;
            if (lanes < GL) {
                x16_pad(base, grp, lanes, nb, pad);
                grp = pad;
            }
            i8_unpack(base, grp, nb, blks + (g0 - p0) / GL * nb);
        }
        _tile_loadconfig(&i8_config);
        for (int64_t i0 = 0; i0 < a->m; i0 += 16)
            for (int64_t g0 = p0; g0 < p1; g0 += GL) {
                const int64_t lanes = n - g0 < GL ? n - g0 : GL, lo = r0 > g0 ? r0 - g0 : 0;
                const int64_t hi = r1 - g0 < lanes ? r1 - g0 : lanes;
                const __mmask16 keep = (__mmask16)(((1u << hi) - 1) & ~((1u << lo) - 1));
                const I8Block *g = blks + (g0 - p0) / GL * nb;
                switch (base) {
                case Q4_0: i8_tile(Q4_0, g, nb, a, i0, y + g0, ldy, keep); break;
                case Q4_1: i8_tile(Q4_1, g, nb, a, i0, y + g0, ldy, keep); break;
                default: i8_tile(Q8_0, g, nb, a, i0, y + g0, ldy, keep); break;
                }
            }
        _tile_release();
    }
}

/* Rows [r0, r1) of a's 16-bit activations split into hi and lo (see the top of this file), each
 * tile's block whole in one place (i8_at): a tile loads 512 bytes in a row, not 16 rows k apart. */
static void i8_split(const Acts *a, int64_t r0, int64_t r1) {
    const int64_t nb = a->k / QK;
    for (int64_t i = r0; i < r1; i++)
        for (int64_t b = 0; b < nb; b++) {
            __m512i q = _mm512_loadu_si512((const void *)(a->q + i * a->k + b * QK));
            const int64_t at = i8_at(i / 16 * 16, b, nb) + i % 16 * QK;
            _mm256_storeu_si256((__m256i *)(a->h + at), _mm512_cvtepi16_epi8(_mm512_srai_epi16(q, 8)));
            _mm256_storeu_si256((__m256i *)(a->l + at), _mm512_cvtepi16_epi8(q));
        }
}

#define I8_TEXT(x) #x
#define I8_ROWS_TEXT(x) I8_TEXT(x) /* I8_ROWS's value as text */
#define I8_PATH_ON "; from " I8_ROWS_TEXT(I8_ROWS) " rows on amx-int8 tiles (the same numbers)"
#else /* the product paths' AMX-INT8 calls are compiled out (quant_matmul.c) */
static inline int i8_ready(void) { return 0; }
static const char *i8_why = "this build has no AMX-INT8 (the compiler or the CPU lacks it)";
static size_t i8_scratch(int64_t k) { (void)k; return 0; }
#define I8_PATH_ON ""
#endif
