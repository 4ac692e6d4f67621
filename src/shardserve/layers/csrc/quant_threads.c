/* quant_matmul.c's entry points (it includes this file last): how the threads share a product,
 * and qmatmul, qmatmul_bf16, qdequant. */

/* Threads claim runs of weight rows from a shared counter rather than taking fixed halves:
 * where other processes share the cores, a thread the OS preempts mid-product leaves its
 * remaining rows to the others instead of holding them all at the next barrier. Runs are guided:
 * each takes 1 / (2 nth) of the rows still unclaimed, so the first are long (for the memory
 * prefetchers of a one-row product) and the last short (the threads reach the barrier together),
 * at least 32 rows, in whole grains (claim_grain: the kernel's block of weight rows; AMX over
 * many rows makes a grain a thread's even share). Against
 * fixed quarters of a share, the threads of a many-stream decode step wait far less at its
 * barriers.
 * Returns the run's first row (its end in *end), or -1 when all `total` rows are claimed; *next
 * is zeroed before the threads start. */
static inline int64_t claim_rows(int64_t *next, int64_t total, int64_t g, int nth, int64_t *end) {
    int64_t s = __atomic_load_n(next, __ATOMIC_RELAXED), e;
    do {
        if (s >= total) return -1;
        int64_t c = (total - s) / (2 * nth);
        c = ((c < 32 ? 32 : c) + g - 1) / g * g;
        e = s + c < total ? s + c : total;
    } while (!__atomic_compare_exchange_n(next, &s, e, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    *end = e;
    return s;
}

/* Claims the next of `total` chunks from *next (zeroed before the threads start), or -1. */
static inline int64_t claim(int64_t *next, int64_t total) {
    int64_t c = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
    return c < total ? c : -1;
}

/* The threads' part of qmatmul and qmatmul_bf16. With x, each thread first readies its share of
 * a's rows from it (acts_rows); without, `a` holds them already. Then the threads claim runs of
 * W's rows, each with its own scratch. Returns 0, or 2 when scratch cannot be allocated. */
static int claimed_products(int type, const uint8_t *w, int64_t row_bytes, int64_t n, const Acts *a, const float *x,
                            int64_t ldx, float *y, int64_t ldy, int nthreads) {
    const int64_t m = a->m, k = a->k;
    const int paths = 1 << product_path(type, m), scratch = needs_scratch(paths);
    int err = 0;
    int64_t next = 0;
#pragma omp parallel num_threads(nthreads)
    {
        int nth = omp_get_num_threads(), tid = omp_get_thread_num();
        if (x) { /* the same for every thread: all or none reach the barrier */
            acts_rows(x, ldx, m * tid / nth, m * (tid + 1) / nth, a); /* the threads' shares of the rows */
#pragma omp barrier
        }
        float *wp = scratch ? malloc(gemm_scratch(k, paths)) : NULL;
        if (scratch && !wp) {
#pragma omp atomic write
            err = 2;
        } else {
            for (int64_t r0, r1; (r0 = claim_rows(&next, n, claim_grain(type, m, n, nth), nth, &r1)) >= 0;)
                qmatmul_rows(type, w, row_bytes, n, r0, r1, a, x, ldx, m, y, ldy, wp);
        }
        free(wp);
    }
    return err;
}

/* y[i * ldy + r] = x[i] . W[r] for i < m, r < n. Returns 0, 1 for an unknown format or a K
 * that is not whole blocks, 2 when scratch memory cannot be allocated. */
int qmatmul(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const float *x,
            int64_t m, int64_t ldx, float *y, int64_t ldy, int nthreads) {
    if (!fits(type, k)) return 1;
    Acts a;
    if (!acts_alloc(&a, m, k, 1 << product_path(type, m))) { acts_free(&a); return 2; }
    int err = claimed_products(type, w, row_bytes, n, &a, x, ldx, y, ldy, nthreads);
    acts_free(&a);
    return err;
}

/* qmatmul for BF16 | X16 weights with activations already bfloat16: xb, m rows ldxb apart, rounded
 * as acts_rows rounds (bf16_rows_of; silu_mul_bf16 and qmatmul_bf16_silu hand them on so), which
 * skips a pass over the activations. On vdpbf16ps, and on AMX tiles where k is whole chunks of 32
 * columns (a tile reads 32 a row: past k it would read the next row's values). Returns 3, doing
 * nothing, elsewhere (float32 activations; AMX with another k), and the caller passes floats. */
int qmatmul_bf16(const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const uint16_t *xb, int64_t m,
                 int64_t ldxb, float *y, int64_t ldy, int nthreads) {
    const int type = X16 | BF16, path = product_path(type, m);
    if (!fits(type, k)) return 1;
    if (path != BF16_DP && !(path == BF16_AMX && k % 32 == 0)) return 3;
    Acts a = {NULL, NULL, NULL, NULL, k, m, (uint16_t *)xb, ldxb, NULL, NULL};
    return claimed_products(type, w, row_bytes, n, &a, NULL, 0, y, ldy, nthreads);
}

/* out[j] (k floats) = row rows[j] of W (or row j when rows is NULL) for j < count; W has n rows. */
int qdequant(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const int64_t *rows,
             int64_t count, float *out, int nthreads) {
    if (!fits(type, k)) return 1;
    if (!is_x16(type)) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (count > 64)
        for (int64_t j = 0; j < count; j++) expand_row(type, w + (rows ? rows[j] : j) * row_bytes, k, out + j * k);
        return 0;
    }
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (count > 64) reduction(| : failed)
    {
        uint8_t *row = malloc((size_t)row_bytes); /* the row back in its base format */
        failed = !row;
#pragma omp for schedule(static)
        for (int64_t j = 0; j < count; j++) {
            if (!row) continue;
            x16_row(type, w, row_bytes, n, rows ? rows[j] : j, row);
            expand_row(x16_base(type), row, k, out + j * k);
        }
        free(row);
    }
    return failed ? 2 : 0;
}
