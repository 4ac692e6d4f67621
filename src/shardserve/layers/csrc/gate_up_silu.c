/* A gated MLP's gate/up product with its SiLU, for bfloat16 weights on vdpbf16ps: decode_loop.c
 * includes this file after quant_matmul.c and cpu_ops.c, whose parts it joins.
 *
 * act[i, c] = bf16(silu(x_i . W[c]) * (x_i . W[I + c])) for c < I, where W [2I, k] holds the gate
 * rows then the up rows. Apart, the product writes its 2I floats a row and SiLU reads them back
 * (at a prefill chunk's thousands of rows, far more than the caches hold). Here each tile
 * multiplies gate group j and up group j together (two x16 groups I rows apart, where a plain
 * product's tile takes two neighbours), and its epilogue applies SiLU to the 16 columns and
 * rounds them to bfloat16 for the down product (qmatmul_bf16) as soon as they are summed.
 *
 * The same bits as the product then silu_mul_bf16: each output is the same chain of vdpbf16ps
 * whatever its tile (quant_x16_float.c), SiLU is the one compiled `silu_rows`, and the rounding
 * is bf16_round, as bf16_rows_of rounds. */

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
        for (int64_t r = 0; r < mb; r++) {
            uint16_t *out = act + (i0 + r) * ldact + g;
            for (int l = 0; l < GL; l++) {
                uint32_t bits;
                memcpy(&bits, o + r * GL + l, 4);
                out[l] = bf16_round(bits);
            }
        }
    }
}
#endif

/* act (m rows ldact apart, bfloat16) as above, from x (m float32 rows ldx apart) and W (BF16 | X16,
 * n = 2I rows of k). Returns 0; 1 for a k the format does not take; 2 out of memory; 3, doing
 * nothing, where this is not the product's path (not vdpbf16ps, or I not whole groups): the
 * caller then runs the product and silu_mul_bf16. */
int qmatmul_bf16_silu(const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, int64_t ldx, uint16_t *act,
                      int64_t ldact, int nthreads) {
    const int type = X16 | BF16;
    if (!fits(type, k)) return 1;
#if DPBF_BUILT
    const int64_t inter = n / 2;
    if (product_path(type, m) != BF16_DP || n % (2 * GL)) return 3;
    Acts a;
    if (!acts_alloc(&a, m, k, 1 << BF16_DP)) { acts_free(&a); return 2; }
    int err = 0;
    int64_t next = 0;
#pragma omp parallel num_threads(nthreads)
    {
        int nth = omp_get_num_threads(), tid = omp_get_thread_num();
        acts_rows(x, ldx, m * tid / nth, m * (tid + 1) / nth, &a);
#pragma omp barrier
        float *tile = malloc(sizeof(float) * 3 * GL * ROW_BLOCK); /* [rows][32] sums, then [rows][16] SiLU */
        if (!tile) {
#pragma omp atomic write
            err = 2;
        } else {
            for (int64_t r0, r1; (r0 = claim_rows(&next, inter, GL, nth, &r1)) >= 0;)
                for (int64_t i0 = 0; i0 < m; i0 += ROW_BLOCK)
                    silu_run((const uint16_t *)w, inter, k, r0, r1, &a, i0, m - i0 < ROW_BLOCK ? m - i0 : ROW_BLOCK,
                             act, ldact, tile, tile + 2 * GL * ROW_BLOCK);
        }
        free(tile);
    }
    acts_free(&a);
    return err;
#else
    (void)w, (void)n, (void)x, (void)m, (void)ldx, (void)act, (void)ldact, (void)nthreads;
    return 3;
#endif
}
