/* A step's logits, row by row, for the sampler (engine/), in one pass of each row and on every
 * thread: a decode step of many streams reads [rows, vocab] floats, megabytes that a numpy pass
 * reads on one thread. decode_loop.c includes this file; not compiled alone.
 *
 *   rows_finite:  whether each row's values are all finite (no NaN, no infinity);
 *   rows_argmax:  each row's first index of its largest value, a NaN counting as the largest (the
 *                 first NaN), as numpy's and torch's argmax.
 * NaN and infinity are told from their bits (an all-ones exponent): the library is compiled with
 * -ffast-math, under which float tests for them may be folded away.
 */

#define EXP_ONES 0x7f800000u

/* Index of the first NaN of x[0, n), or -1. */
static int64_t first_nan(const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t b;
        memcpy(&b, x + i, 4);
        if ((b & 0x7fffffffu) > EXP_ONES) return i;
    }
    return -1;
}

#ifdef __AVX512F__
static inline __mmask16 lanes(int64_t left) { return left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1); }

/* The largest of |x|'s bits over x[0, n): at least EXP_ONES where some value is not finite. Four
 * chains, so that the loads, not one chain's latency, set the pace. */
static uint32_t max_abs_bits(const float *x, int64_t n) {
    const __m512i abs = _mm512_set1_epi32(0x7fffffff);
    __m512i m0 = _mm512_setzero_si512(), m1 = m0, m2 = m0, m3 = m0;
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        m0 = _mm512_max_epu32(m0, _mm512_and_si512(_mm512_loadu_si512(x + i), abs));
        m1 = _mm512_max_epu32(m1, _mm512_and_si512(_mm512_loadu_si512(x + i + 16), abs));
        m2 = _mm512_max_epu32(m2, _mm512_and_si512(_mm512_loadu_si512(x + i + 32), abs));
        m3 = _mm512_max_epu32(m3, _mm512_and_si512(_mm512_loadu_si512(x + i + 48), abs));
    }
    for (; i < n; i += 16)
        m0 = _mm512_max_epu32(m0, _mm512_and_si512(_mm512_maskz_loadu_epi32(lanes(n - i), x + i), abs));
    return _mm512_reduce_max_epu32(_mm512_max_epu32(_mm512_max_epu32(m0, m1), _mm512_max_epu32(m2, m3)));
}

static int row_finite(const float *x, int64_t n) { return max_abs_bits(x, n) < EXP_ONES; }

/* Two passes over the row (the second from L2): its largest value and largest |bits| (four
 * chains each), then the first index holding that value; with a NaN, the first NaN. */
static int64_t row_argmax(const float *x, int64_t n) {
    const __m512i abs = _mm512_set1_epi32(0x7fffffff);
    const __m512 lowest = _mm512_set1_ps(-INFINITY);
    __m512 v[4] = {lowest, lowest, lowest, lowest};
    __m512i b[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    int64_t i = 0;
    for (; i + 64 <= n; i += 64)
        for (int c = 0; c < 4; c++) {
            const __m512 a = _mm512_loadu_ps(x + i + 16 * c);
            v[c] = _mm512_max_ps(v[c], a);
            b[c] = _mm512_max_epu32(b[c], _mm512_and_si512(_mm512_castps_si512(a), abs));
        }
    for (; i < n; i += 16) {
        const __mmask16 m = lanes(n - i);
        v[0] = _mm512_max_ps(v[0], _mm512_mask_loadu_ps(lowest, m, x + i));
        b[0] = _mm512_max_epu32(b[0], _mm512_and_si512(_mm512_maskz_loadu_epi32(m, x + i), abs));
    }
    const __m512i bits = _mm512_max_epu32(_mm512_max_epu32(b[0], b[1]), _mm512_max_epu32(b[2], b[3]));
    if (_mm512_reduce_max_epu32(bits) > EXP_ONES) /* a NaN: the first one */
        return first_nan(x, n);
    const __m512 top = _mm512_set1_ps(
        _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(v[0], v[1]), _mm512_max_ps(v[2], v[3]))));
    for (i = 0; i < n; i += 16) {
        const __mmask16 eq = _mm512_mask_cmp_ps_mask(lanes(n - i), _mm512_loadu_ps(x + i), top, _CMP_EQ_OQ);
        if (eq) return i + __builtin_ctz(eq);
    }
    return 0; /* not reached: the largest value is in the row */
}
#else
static int row_finite(const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t b;
        memcpy(&b, x + i, 4);
        if ((b & EXP_ONES) == EXP_ONES) return 0;
    }
    return 1;
}

static int64_t row_argmax(const float *x, int64_t n) {
    const int64_t nan = first_nan(x, n);
    if (nan >= 0) return nan;
    int64_t at = 0;
    for (int64_t i = 1; i < n; i++)
        if (x[i] > x[at]) at = i;
    return at;
}
#endif

/* Rows of `n` values, `ld` apart: out[i] = 1 where row i is all finite, else 0. */
void rows_finite(const float *x, int64_t rows, int64_t n, int64_t ld, uint8_t *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 1)
    for (int64_t i = 0; i < rows; i++) out[i] = (uint8_t)row_finite(x + i * ld, n);
}

/* Rows of `n` values (n >= 1), `ld` apart: out[i] = row i's argmax (see the top of the file). */
void rows_argmax(const float *x, int64_t rows, int64_t n, int64_t ld, int64_t *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 1)
    for (int64_t i = 0; i < rows; i++) out[i] = row_argmax(x + i * ld, n);
}
