/* Products against bfloat16 rows in x16 groups on AMX tiles, for quant_matmul.c, which includes
 * this file after quant_x16_float.c; not compiled alone.
 *
 * Where the CPU has AMX-BF16 and Linux grants the tile state (`amx_ready`, probed once when the
 * library loads), every product of a BF16 | X16 weight runs here, at every number of rows: the
 * activations rounded to bfloat16 (nearest even), one tile of 16 activation rows times one group
 * (the group's [k / 2][16][2] pairs are a tile's B operand as stored), the tile products summed
 * in column order into one float32 accumulator tile. An output depends only on its own
 * activation row and weight row, so a request's result does not change with what shares its step.
 * Elsewhere (no AMX, or SHARDSERVE_NO_AMX=1) the same weights take quant_x16_float.c's paths:
 * bfloat16 activations on vdpbf16ps where the CPU has AVX512-BF16 (summed in another order than
 * the tiles', so the numbers may differ in the last bits), else float32 activations, whose
 * numbers differ from these by bfloat16 rounding of the activations. This file also holds the
 * choice among the three (`bf16_path`), made once when the library loads.
 *
 * The tile state belongs to the thread and other libraries (oneDNN) use it too, so each call
 * loads its configuration and releases the tiles when done.
 */

#include "bf16.h" /* bf16_round, bf16_round_row: shared with the attention library */

/* Rows [r0, r1) of x as bfloat16 (nearest even), zero from column k to the row's end `kb`. */
static void bf16_rows_of(const float *x, int64_t ldx, int64_t r0, int64_t r1, int64_t k, int64_t kb, uint16_t *out) {
    for (int64_t i = r0; i < r1; i++) {
        bf16_round_row(x + i * ldx, k, out + i * kb);
        for (int64_t e = k; e < kb; e++) out[i * kb + e] = 0;
    }
}

#include "amx.h" /* AMX_BUILT, amx_decide, the tile configuration and its probe */

#if AMX_BUILT
static int amx_on; /* set once, when the library loads */
static const char *amx_why = ""; /* why not, for kernel_paths() */
__attribute__((constructor)) static void amx_init(void) { amx_on = !(amx_why = amx_decide()); }

static inline int amx_ready(void) { return amx_on; }

/* The group of 16 rows from row `base` as tiles read it: in place, or (the last, part-filled
 * group) copied into `pad` (16 * k bfloat16) with zero lanes; where k is not whole chunks of 32
 * columns, its last chunk copied into `tail` with zero pair-rows past column k. */
static const uint8_t *amx_group(const uint8_t *w, int64_t n, int64_t base, int64_t k, uint8_t *pad, uint16_t *tail) {
    int64_t lanes = n - base < GL ? n - base : GL, full = k / 32;
    const uint8_t *grp = w + base * k * 2;
    if (lanes < GL) {
        x16_pad_float(grp, lanes, k / 2, pad);
        grp = pad;
    }
    if (full * 32 < k) {
        memset(tail, 0, 16 * 32 * sizeof(uint16_t));
        memcpy(tail, grp + full * 16 * 64, (size_t)((k - full * 32) / 2 * 64));
    }
    return grp;
}

/* Accumulator tiles 0-3 = activation tiles a0, and a1 where na = 2 (16 rows lda0, lda1
 * bfloat16 apart) times groups grp[0], and grp[1] where ng = 2, over nc chunks of 32 columns in
 * column order; from chunk `full` on, a group is read from tail[g] (see amx_group). Tile g + 2 at
 * holds activation tile `at` times group g. Each sum is the same chain of tile products whatever
 * shares its tile. Where `next` is given, the same chunks of the groups next[0], next[1] (either
 * may be NULL) are prefetched as these are multiplied: a panel's first pass reads its groups from
 * memory, faster than the hardware's prefetchers fetch them ahead across pages. */
static inline __attribute__((always_inline)) void amx_block(const uint16_t *a0, int64_t lda0, const uint16_t *a1,
                                                            int64_t lda1, int na, const uint8_t *const *grp,
                                                            uint16_t (*tail)[16 * 32], int ng, int64_t nc,
                                                            int64_t full, const uint8_t *const *next) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < nc; c++) {
        for (int g = 0; next && g < 2; g++)
            if (next[g])
                for (int l = 0; l < 16; l++) __builtin_prefetch(next[g] + c * 16 * 64 + 64 * l, 0, 2);
        _tile_loadd(4, a0 + c * 32, lda0 * 2);
        _tile_loadd(6, c < full ? (const void *)(grp[0] + c * 16 * 64) : (const void *)tail[0], 64);
        _tile_dpbf16ps(0, 4, 6);
        if (ng > 1) {
            _tile_loadd(7, c < full ? (const void *)(grp[1] + c * 16 * 64) : (const void *)tail[1], 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (na > 1) {
            _tile_loadd(5, a1 + c * 32, lda1 * 2);
            _tile_dpbf16ps(2, 5, 6);
            if (ng > 1) _tile_dpbf16ps(3, 5, 7);
        }
    }
}

#define AHEAD 4 /* groups from the one multiplied to the one prefetched on a panel's first pass (amx_block) */

/* Whether a sweep of m activation rows from row s0 prefetches weight groups: the panel's first
 * (its groups come from memory), from 17 rows (at one row the prefetches slowed the decode). */
static inline int amx_prefetching(int64_t s0, int64_t m) { return s0 == 0 && m > 16; }

/* Activation rows that pass over a group while it is at hand: every row of a decode step's few
 * (the group's one read from memory then feeds them all, so the stream of weights never waits
 * for a second pass from L2), else a pair of tiles at a time, each pair over a whole panel. */
static inline int64_t sweep_rows(int64_t m) { return m <= 64 ? m : 32; }
/* The activation tile of rows [i, i + 16) of xb (rows lda apart): in place, or for the last,
 * part-filled tile of m rows, `last` (16 rows of kb, the rows past m zero) where the caller filled
 * one (NULL: xb's rows are readable up to m rounded up to 16). */
static inline const uint16_t *amx_acts(const uint16_t *xb, int64_t lda, int64_t i, int64_t m, const uint16_t *last,
                                       int64_t *ld, int64_t kb) {
    if (i + 16 <= m || !last) {
        *ld = lda;
        return xb + i * lda;
    }
    *ld = kb;
    return last;
}

/* Fills `last` as amx_acts reads it: rows m16 = m rounded down to 16 .. m of xb, then zeros. */
static void amx_last_tile(const uint16_t *xb, int64_t lda, int64_t m, int64_t kb, uint16_t *last) {
    const int64_t m16 = m / 16 * 16;
    for (int64_t i = m16; i < m; i++) memcpy(last + (i - m16) * kb, xb + i * lda, sizeof(uint16_t) * (size_t)kb);
    memset(last + (m - m16) * kb, 0, sizeof(uint16_t) * (size_t)((16 - (m - m16)) * kb));
}

/* Tiles 0-3 (amx_block's) into rows [i0, i0 + 32) of y, columns [g0, g0 + 32): a tile whose 16
 * rows and 16 lanes are all kept straight to y, the others through `out`, their kept part copied
 * (rows below m; columns in [r0, r1) and below n). */
static inline void amx_store(float *y, int64_t ldy, int64_t i0, int64_t m, int64_t g0, int ng, int na, int64_t n,
                             int64_t r0, int64_t r1, float (*out)[16 * 16]) {
    const int whole = ng == 2, full0 = whole && m - i0 >= 16, full1 = whole && m - i0 >= 32;
    float *y0 = y + i0 * ldy + g0, *y1 = y0 + 16 * ldy;
    if (full0) {
        _tile_stored(0, y0, ldy * 4);
        _tile_stored(1, y0 + GL, ldy * 4);
    } else {
        _tile_stored(0, out[0], 64);
        if (ng > 1) _tile_stored(1, out[1], 64);
    }
    if (full1) {
        _tile_stored(2, y1, ldy * 4);
        _tile_stored(3, y1 + GL, ldy * 4);
    } else if (na > 1) {
        _tile_stored(2, out[2], 64);
        if (ng > 1) _tile_stored(3, out[3], 64);
    }
    for (int t = 0; t < 2 * na; t++) {
        int g = t % 2, at = t / 2;
        if (g >= ng || (at ? full1 : full0)) continue;
        int64_t base = g0 + g * GL, lanes = n - base < GL ? n - base : GL;
        int64_t lo = r0 > base ? r0 - base : 0, hi = r1 - base < lanes ? r1 - base : lanes;
        for (int64_t j = 0; j < 16 && i0 + at * 16 + j < m; j++)
            memcpy(y + (i0 + at * 16 + j) * ldy + base + lo, out[t] + j * 16 + lo, sizeof(float) * (size_t)(hi - lo));
    }
}

/* y[i * ldy + r] = x_i . W[r] for i < m, r0 <= r < r1: W bfloat16 in x16 groups (n rows of k),
 * x as `xb`, m rows of kb = k rounded up to 32, lda apart, zero past column k; where `padded`,
 * rows up to m rounded up to 16 are readable (acts_alloc's own buffers: their sums are not kept),
 * else the last, part-filled tile is read from a copy, so that no row past m is read. `pad` holds
 * at least 16 * k + 16 * kb bfloat16 (gemm_scratch): a part-filled group, then that copy.
 * All m rows are taken here (qmatmul_rows does not cut them into row blocks): panel by panel
 * (panel_rows: whole pairs of groups), each sweep of activation rows (sweep_rows) against every
 * group of it. An output's chain of tile products is the same in any order of the loops. */
static void amx_rows(const uint8_t *w, int64_t n, int64_t r0, int64_t r1, const uint16_t *xb, int64_t lda, int padded,
                     int64_t m, int64_t k, float *y, int64_t ldy, float *pad) {
    const int64_t kb = (k + 31) / 32 * 32, nc = kb / 32, full = k / 32; /* chunks of 32 columns; full: whole */
    const int64_t panel = panel_rows(2 * k, 2 * GL);
    uint16_t tail[2][16 * 32]; /* a group's last, part-filled chunk, zero beyond column k */
    uint16_t *last = padded || m % 16 == 0 ? NULL : (uint16_t *)pad + 16 * k;
    float out[4][16 * 16];
    if (last) amx_last_tile(xb, lda, m, kb, last);
    amx_configure();
    for (int64_t p0 = r0; p0 < r1; p0 += panel) {
        const int64_t p1 = p0 + panel < r1 ? p0 + panel : r1;
        for (int64_t s0 = 0; s0 < m; s0 += sweep_rows(m)) {
            const int64_t s1 = s0 + sweep_rows(m) < m ? s0 + sweep_rows(m) : m;
            for (int64_t g0 = p0 / GL * GL; g0 < p1;) {
                /* one group, or two where both are whole and in the panel whole */
                const int ng = (g0 + 2 * GL <= p1 && g0 + 2 * GL <= n && g0 >= p0) ? 2 : 1;
                const uint8_t *grp[2], *next[2] = {NULL, NULL};
                for (int g = 0; g < ng; g++) grp[g] = amx_group(w, n, g0 + g * GL, k, (uint8_t *)pad, tail[g]);
                for (int g = 0; amx_prefetching(s0, m) && g < 2; g++) /* the groups AHEAD on */
                    if (g0 + (AHEAD + g + 1) * GL <= (p1 < n ? p1 : n)) next[g] = w + (g0 + (AHEAD + g) * GL) * k * 2;
                for (int64_t i0 = s0; i0 < s1; i0 += 32) {
                    const int na = m - i0 > 16 ? 2 : 1; /* activation tiles */
                    int64_t ld0, ld1;
                    const uint16_t *a0 = amx_acts(xb, lda, i0, m, last, &ld0, kb),
                                   *a1 = amx_acts(xb, lda, i0 + 16, m, last, &ld1, kb);
                    amx_block(a0, ld0, a1, ld1, na, grp, tail, ng, nc, full, i0 == s0 ? next : NULL);
                    amx_store(y, ldy, i0, m, g0, ng, na, n, p0, p1, out);
                }
                g0 += ng * GL;
            }
        }
    }
    _tile_release();
}

#define AMX_PATH_ON "amx tiles (bfloat16 activations)"
#else /* the product paths' AMX calls are compiled out (quant_matmul.c) */
static inline int amx_ready(void) { return 0; }
static const char *amx_why = "this build has no AMX-BF16 (the compiler or the CPU lacks it)";
#define AMX_PATH_ON ""
#endif

/* Where AMX is not in use, bfloat16 products run on vdpbf16ps (quant_x16_float.c) where the
 * build has AVX512-BF16, unless float32 activations were asked for. */
static int dpbf_on; /* set once, when the library loads */
__attribute__((constructor)) static void dpbf_init(void) { dpbf_on = DPBF_BUILT && !float32_activations_asked(); }
static inline int dpbf_ready(void) { return dpbf_on && !amx_ready(); }

/* How bfloat16 products run in this process (for tests and `shardserve env`): 1 on AMX tiles,
 * 2 on vdpbf16ps (both with bfloat16 activations), 0 against float32 activations. */
int bf16_path(void) { return amx_ready() ? 1 : dpbf_ready() ? 2 : 0; }
