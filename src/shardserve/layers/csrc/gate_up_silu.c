/* A gated MLP's gate/up product with its SiLU, for bfloat16 weights on vdpbf16ps or AMX tiles:
 * decode_loop.c includes this file after quant_matmul.c and cpu_ops.c, whose parts it joins.
 *
 * act[i, c] = bf16(silu(x_i . W[c]) * (x_i . W[I + c])) for c < I, where W [2I, k] holds the gate
 * rows then the up rows. Apart, the product writes its 2I floats a row and SiLU reads them back
 * (at a prefill chunk's thousands of rows, far more than the caches hold). Here each tile
 * multiplies gate group j and up group j together (two x16 groups I rows apart, where a plain
 * product's tile takes two neighbours), and its epilogue applies SiLU to the 16 columns and
 * rounds them to bfloat16 for the down product (qmatmul_bf16) as soon as they are summed.
 *
 * The same bits as the product then silu_mul_bf16: each output is the same chain of vdpbf16ps
 * (quant_x16_float.c) or tile products (amx_block) whatever its tile, SiLU is the one compiled
 * `silu_rows`, and the rounding is bf16_round_row, as bf16_rows_of rounds. */

/* Rows [0, mb) of `o` (16 floats apart) rounded to bfloat16 into columns [g, g + 16) of act. */
static void act_round(const float *o, int64_t mb, uint16_t *act, int64_t ldact, int64_t g) {
    for (int64_t r = 0; r < mb; r++) bf16_round_row(o + r * GL, GL, act + r * ldact + g);
}

#if DPBF_BUILT
/* One claimed run [r0, r1) of gate rows (whole groups) over rows i0.. of `a` (mb of them). */
static void silu_run(const uint16_t *w, int64_t inter, int64_t k, int64_t r0, int64_t r1, const Acts *a, int64_t i0,
                     int64_t mb, uint16_t *act, int64_t ldact, float *tile, float *o) {
    const Acts part = acts_part(a, i0, mb);
    const int64_t ldb = acts_ldb(&part);
    for (int64_t g = r0; g < r1; g += GL) {
        for (int64_t i = 0; i < mb; i += 8) /* gate in the tile's columns 0-15, up in 16-31 */
            f32_tiles(BF16D, 2, mb - i < 8 ? (int)(mb - i) : 8, w + g * k, inter * k, part.b + i * ldb, ldb, k,
                      tile + i * 2 * GL, 2 * GL);
        silu_rows(tile, tile + GL, 2 * GL, o, GL, mb, GL);
        act_round(o, mb, act + i0 * ldact, ldact, g);
    }
}
#endif

#if AMX_BUILT
/* The epilogue of one amx_silu_run step: SiLU of the gate columns times the up columns of `out`
 * (the step's tiles, as stored: gate then up of activation tile 0, then of tile 1), rounded into
 * columns [g, g + 16) of rows i0.. of act; na activation tiles, m rows in all. */
static void amx_silu_epilogue(float (*out)[16 * 16], int na, int64_t i0, int64_t m, int64_t g, uint16_t *act,
                              int64_t ldact) {
    float o[16 * 16];
    for (int at = 0; at < na; at++) {
        const int64_t rows = m - i0 - 16 * at < 16 ? m - i0 - 16 * at : 16;
        silu_rows(out[2 * at], out[2 * at + 1], GL, o, GL, rows, GL);
        act_round(o, rows, act + (i0 + 16 * at) * ldact, ldact, g);
    }
}

/* silu_run on AMX tiles: rows [0, m) of xb (lda apart, k whole chunks of 32; the last,
 * part-filled tile read from `last` (amx_last_tile) where given, else in place: acts_alloc's rows
 * are readable up to m rounded up to 16), each 32 rows by gate group j and up group j,
 * panel by panel of gate groups and sweep by sweep of rows as amx_rows takes a plain product's (a
 * panel row is a gate row and its up row). A step's epilogue runs after the next step's tile
 * products are issued, so the vector unit's SiLU overlaps the tiles' work (its tiles were stored
 * before). */
static void amx_silu_run(const uint8_t *w, int64_t inter, int64_t k, int64_t r0, int64_t r1, const uint16_t *xb,
                         int64_t lda, const uint16_t *last, int64_t m, uint16_t *act, int64_t ldact) {
    const int64_t nc = k / 32, panel = panel_rows(2 * 2 * k, 2 * GL);
    float out[2][4][16 * 16]; /* two steps' tiles: the one summing and the one in its epilogue */
    int64_t prev_i0 = -1, prev_g = 0;
    int prev_na = 0, s = 0;
    amx_configure();
    for (int64_t p0 = r0; p0 < r1; p0 += panel) {
        const int64_t p1 = p0 + panel < r1 ? p0 + panel : r1;
        for (int64_t s0 = 0; s0 < m; s0 += sweep_rows(m)) {
            const int64_t s1 = s0 + sweep_rows(m) < m ? s0 + sweep_rows(m) : m;
            for (int64_t g = p0; g < p1; g += GL) {
                const uint8_t *grp[2] = {w + g * k * 2, w + (inter + g) * k * 2};
                /* a gate and an up group a step: AHEAD / 2 steps ahead */
                const uint8_t *next[2] = {grp[0] + AHEAD / 2 * GL * k * 2, grp[1] + AHEAD / 2 * GL * k * 2};
                const int fetch = amx_prefetching(s0, m) && g + (AHEAD / 2 + 1) * GL <= p1;
                for (int64_t i0 = s0; i0 < s1; i0 += 32, s ^= 1) {
                    const int na = m - i0 > 16 ? 2 : 1;
                    int64_t ld0, ld1;
                    const uint16_t *a0 = amx_acts(xb, lda, i0, m, last, &ld0, k),
                                   *a1 = amx_acts(xb, lda, i0 + 16, m, last, &ld1, k);
                    amx_block(a0, ld0, a1, ld1, na, grp, NULL, 2, nc, nc, fetch && i0 == s0 ? next : NULL);
                    if (prev_i0 >= 0) amx_silu_epilogue(out[s ^ 1], prev_na, prev_i0, m, prev_g, act, ldact);
                    _tile_stored(0, out[s][0], 64);
                    _tile_stored(1, out[s][1], 64);
                    if (na > 1) {
                        _tile_stored(2, out[s][2], 64);
                        _tile_stored(3, out[s][3], 64);
                    }
                    prev_i0 = i0, prev_g = g, prev_na = na;
                }
            }
        }
    }
    if (prev_i0 >= 0) amx_silu_epilogue(out[s ^ 1], prev_na, prev_i0, m, prev_g, act, ldact);
    _tile_release();
}
#endif

/* act (m rows ldact apart, bfloat16) as above, from x (m float32 rows ldx apart) or, x NULL, xb
 * (m rows ldx apart already rounded to bfloat16: rms_norm_bf16), and W (BF16 | X16, n = 2I rows of
 * k). Returns 0; 1 for a k the format does not take; 2 out of memory; 3, doing
 * nothing, where this is not the product's path (neither vdpbf16ps nor AMX with k whole chunks
 * of 32; or I not whole groups): the caller then runs the product and silu_mul_bf16. */
int qmatmul_bf16_silu(const uint8_t *w, int64_t n, int64_t k, const float *x, const uint16_t *xb, int64_t m,
                      int64_t ldx, uint16_t *act, int64_t ldact, int nthreads) {
    const int type = X16 | BF16, path = product_path(type, m);
    if (!fits(type, k)) return 1;
    if (n % (2 * GL) || !((DPBF_BUILT && path == BF16_DP) || (AMX_BUILT && path == BF16_AMX && k % 32 == 0))) return 3;
    const int64_t inter = n / 2;
    Acts a = {NULL, NULL, NULL, NULL, k, m, (uint16_t *)xb, ldx, NULL, NULL};
    uint16_t *last = NULL; /* xb's last, part-filled tile for AMX (its rows past m are not ours to read) */
    if (!xb && !acts_alloc(&a, m, k, 1 << path)) { acts_free(&a); return 2; } /* AMX: readable to 16 rows */
    if (xb && path == BF16_AMX && m % 16) {
        if (!(last = malloc(sizeof(uint16_t) * 16 * (size_t)k))) return 2;
#if AMX_BUILT
        amx_last_tile(xb, ldx, m, k, last);
#endif
    }
    int err = 0;
    int64_t next = 0;
#pragma omp parallel num_threads(nthreads)
    {
        int nth = omp_get_num_threads(), tid = omp_get_thread_num();
        if (x) { /* the same for every thread: all or none reach the barrier */
            acts_rows(x, ldx, m * tid / nth, m * (tid + 1) / nth, &a);
#pragma omp barrier
        }
        float *tile = path == BF16_DP ? malloc(sizeof(float) * 3 * GL * ROW_BLOCK) : NULL; /* [rows][32] sums, then [rows][16] SiLU */
        if (path == BF16_DP && !tile) {
#pragma omp atomic write
            err = 2;
        } else {
            const int64_t grain = claim_grain(type, m, inter, nth); /* whole groups; AMX's even shares */
            for (int64_t r0, r1; (r0 = claim_rows(&next, inter, grain, nth, &r1)) >= 0;) {
#if AMX_BUILT
                if (path == BF16_AMX) {
                    amx_silu_run(w, inter, k, r0, r1, a.b, acts_ldb(&a), last, m, act, ldact);
                    continue;
                }
#endif
#if DPBF_BUILT
                for (int64_t i0 = 0; i0 < m; i0 += ROW_BLOCK) {
                    const int64_t mb = m - i0 < ROW_BLOCK ? m - i0 : ROW_BLOCK;
                    silu_run((const uint16_t *)w, inter, k, r0, r1, &a, i0, mb, act, ldact, tile,
                             tile + 2 * GL * ROW_BLOCK);
                }
#endif
            }
        }
        free(tile);
    }
    if (!xb) acts_free(&a);
    free(last);
    return err;
}
