/* A product's activation buffers (Acts, quant_acts.c) filled, cut and freed, for quant_matmul.c,
 * which includes this file once the paths are named (product_path); not compiled alone. */

/* Buffers for m rows of up to k, for the paths in `paths` (bits 1 << ACTS16, X16_GROUPS or X16_AMX,
 * 1 << PANELS, 1 << BF16_AMX or BF16_DP; the others read x itself). Returns 0 when out of memory. */
static int acts_alloc(Acts *a, int64_t m, int64_t k, int paths) {
    *a = (Acts){NULL, NULL, NULL, NULL, k, m, NULL, 0, NULL, NULL};
    if (paths & (1 << PANELS)) {
        a->p = malloc(sizeof(float) * (size_t)((m + PW - 1) / PW * PW * k));
        if (!a->p) return 0;
    }
    if (paths & ((1 << BF16_AMX) | (1 << BF16_DP))) { /* AMX: whole tiles of 16 rows (those past m read, not kept) */
        a->b = malloc(sizeof(uint16_t) * (size_t)((m + 15) / 16 * 16 * amx_row(k)));
        if (!a->b) return 0;
    }
    if (!(paths & ((1 << ACTS16) | (1 << X16_GROUPS) | (1 << X16_AMX)))) return 1;
    /* X16_AMX reads whole tiles of 16 rows: those past m are read (zeros here, for k), not kept */
    const int64_t mt = paths & (1 << X16_AMX) ? (m + 15) / 16 * 16 : m, nb = k / QK;
    a->q = malloc(sizeof(int16_t) * (size_t)(m * k));
    a->d = malloc(sizeof(float) * (size_t)(mt * nb));
    a->s = malloc(sizeof(float) * (size_t)(mt * nb));
    if (!a->q || !a->d || !a->s) return 0;
    if (!(paths & (1 << X16_AMX))) return 1;
    memset(a->d + m * nb, 0, sizeof(float) * (size_t)((mt - m) * nb));
    memset(a->s + m * nb, 0, sizeof(float) * (size_t)((mt - m) * nb));
    a->h = malloc((size_t)(mt * k));
    a->l = malloc((size_t)(mt * k));
    if (!a->h || !a->l) return 0;
    memset(a->h + (mt - 16) * k, 0, (size_t)(16 * k)); /* the last tile, whole (its rows interleave) */
    memset(a->l + (mt - 16) * k, 0, (size_t)(16 * k));
    return 1;
}

static void acts_free(Acts *a) { free(a->q); free(a->d); free(a->s); free(a->p); free(a->b); free(a->h); free(a->l); }


/* Rows [r0, r1) of x into the same rows of `a`: quantized or packed, whichever `a` holds. */
static void acts_rows(const float *x, int64_t ldx, int64_t r0, int64_t r1, const Acts *a) {
    if (a->q) quantize_rows(x, ldx, r0, r1, a);
#if AMX_I8_BUILT
    if (a->h) i8_split(a, r0, r1);
#endif
    if (a->b) bf16_rows_of(x, ldx, r0, r1, a->k, amx_row(a->k), a->b);
    if (a->p) pack_rows(x, ldx, r0, r1, a);
}

/* Rows [i0, i0 + m) of `a` (the x16 paths' buffers: 16-bit or bfloat16 rows). */
static Acts acts_part(const Acts *a, int64_t i0, int64_t m) {
    Acts part = *a;
    part.m = m;
    if (a->q) part.q = a->q + i0 * a->k, part.d = a->d + i0 * (a->k / QK), part.s = a->s + i0 * (a->k / QK);
    if (a->b) part.b = a->b + i0 * acts_ldb(a);
    return part;
}
