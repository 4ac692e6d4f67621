/* A step's logits, row by row, for the sampler (engine/), each row read from memory once and the
 * rows shared by every thread: a decode step of many streams reads [rows, vocab] floats, megabytes
 * that a numpy pass reads on one thread. decode_loop.c includes this file; not compiled alone.
 * Built where the CPU has AVX-512 (elsewhere the sampler keeps numpy's and torch's passes, which
 * are vectorized):
 *
 *   rows_finite:  whether each row's values are all finite (no NaN, no infinity);
 *   rows_argmax:  each row's first index of its largest value, a NaN counting as the largest (the
 *                 first NaN), as numpy's and torch's argmax.
 * Every test is on the values' bits, in integers: the library is compiled with -ffast-math, under
 * which float tests for NaN and infinity, and float compares of infinities, may be folded away.
 * A float's bits, its sign folded in (order_key), order as the floats do.
 */
#ifdef __AVX512F__
#define EXP_ONES 0x7f800000 /* |bits| above: a NaN; equal: an infinity */

static inline __mmask16 lanes(int64_t left) { return left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1); }

/* 16 values' bits as int32 keys that order as the values do (not NaNs): a negative value's
 * magnitude bits flipped, and -0.0 made +0.0, so that the two zeros tie as the floats do. */
static inline __m512i order_key(__m512i bits) {
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(bits, _mm512_set1_epi32(INT32_MIN)),
                                 _mm512_setzero_si512());
    return _mm512_xor_si512(bits, _mm512_and_si512(_mm512_srai_epi32(bits, 31), _mm512_set1_epi32(0x7fffffff)));
}

/* The largest |bits| of x[0, n): above EXP_ONES where there is a NaN, at least where there is an
 * infinity. Four chains, so that the loads, not one chain's latency, set the pace; a masked
 * load reads nothing past the row. */
static uint32_t max_abs_bits(const float *x, int64_t n) {
    const __m512i abs = _mm512_set1_epi32(0x7fffffff);
    __m512i m[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    int64_t i = 0;
    for (; i + 64 <= n; i += 64)
        for (int c = 0; c < 4; c++)
            m[c] = _mm512_max_epu32(m[c], _mm512_and_si512(_mm512_loadu_si512(x + i + 16 * c), abs));
    for (; i < n; i += 16)
        m[0] = _mm512_max_epu32(m[0], _mm512_and_si512(_mm512_maskz_loadu_epi32(lanes(n - i), x + i), abs));
    return _mm512_reduce_max_epu32(_mm512_max_epu32(_mm512_max_epu32(m[0], m[1]), _mm512_max_epu32(m[2], m[3])));
}

/* The first index of x[0, n) whose |bits| are above EXP_ONES (a NaN), or -1. */
static int64_t first_nan(const float *x, int64_t n) {
    const __m512i abs = _mm512_set1_epi32(0x7fffffff), exp = _mm512_set1_epi32(EXP_ONES);
    for (int64_t i = 0; i < n; i += 16) {
        const __m512i a = _mm512_and_si512(_mm512_maskz_loadu_epi32(lanes(n - i), x + i), abs);
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(a, exp);
        if (nan) return i + __builtin_ctz(nan);
    }
    return -1;
}

/* Three passes over the row (the later two from L2): whether it holds a NaN (max_abs_bits, as
 * rows_finite), its largest order key (four chains), then the first index holding that key; a
 * row with a NaN, its first NaN. (Folding the first pass into the second was no faster.) */
static int64_t row_argmax(const float *x, int64_t n) {
    if (max_abs_bits(x, n) > EXP_ONES) return first_nan(x, n);
    const __m512i lowest = _mm512_set1_epi32(INT32_MIN);
    __m512i k[4] = {lowest, lowest, lowest, lowest};
    int64_t i = 0;
    for (; i + 64 <= n; i += 64)
        for (int c = 0; c < 4; c++) k[c] = _mm512_max_epi32(k[c], order_key(_mm512_loadu_si512(x + i + 16 * c)));
    for (; i < n; i += 16) /* masked-off lanes stay the lowest key */
        k[0] = _mm512_max_epi32(k[0], _mm512_mask_mov_epi32(lowest, lanes(n - i),
                                                            order_key(_mm512_maskz_loadu_epi32(lanes(n - i), x + i))));
    const __m512i top = _mm512_set1_epi32(
        _mm512_reduce_max_epi32(_mm512_max_epi32(_mm512_max_epi32(k[0], k[1]), _mm512_max_epi32(k[2], k[3]))));
    for (i = 0; i < n; i += 16) {
        const __mmask16 m = lanes(n - i);
        const __mmask16 eq = _mm512_mask_cmpeq_epi32_mask(m, order_key(_mm512_maskz_loadu_epi32(m, x + i)), top);
        if (eq) return i + __builtin_ctz(eq);
    }
    return 0; /* not reached: the largest key is in the row */
}

/* Rows of `n` values, `ld` apart: out[i] = 1 where row i is all finite, else 0. */
void rows_finite(const float *x, int64_t rows, int64_t n, int64_t ld, uint8_t *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 1)
    for (int64_t i = 0; i < rows; i++) out[i] = max_abs_bits(x + i * ld, n) < EXP_ONES;
}

/* Rows of `n` values (n >= 1), `ld` apart: out[i] = row i's argmax (see the top of the file). */
void rows_argmax(const float *x, int64_t rows, int64_t n, int64_t ld, int64_t *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 1)
    for (int64_t i = 0; i < rows; i++) out[i] = row_argmax(x + i * ld, n);
}
#undef EXP_ONES
#endif
