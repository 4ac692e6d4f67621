/* A product's activations, part of quant_matmul.c (which includes this file): rows rounded to
 * 16-bit fixed point per block of 32 for the 16-bit paths, and the buffers (`Acts`) every path
 * reads them from. */

/* xq = round(x / d) with d = max|x| / 32767 per block of 32; xd = d; xs = the block's float sum,
 * added in one fixed order on every machine (the 16 sums x[i] + x[i + 16], then halves: 8, 4, 2,
 * 1), so AVX-512, AVX2 and plain C builds give the same bits (the attribute keeps -ffast-math
 * from regrouping those additions). Rounding is to nearest even. */
__attribute__((optimize("no-associative-math"))) static void quantize16(const float *x, int64_t k, int16_t *xq, float *xd, float *xs) {
    for (int64_t b = 0; b < k / QK; b++, x += QK, xq += QK) {
#if defined(__AVX512F__)
        __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        __m512 p = _mm512_add_ps(lo, hi);
        __m256 p8 = _mm256_add_ps(_mm512_castps512_ps256(p),  /* the upper half, with AVX512F alone */
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1)));
#elif defined(__AVX2__)
        __m256 a0 = _mm256_loadu_ps(x), a1 = _mm256_loadu_ps(x + 8), a2 = _mm256_loadu_ps(x + 16),
               a3 = _mm256_loadu_ps(x + 24);
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, a0), _mm256_andnot_ps(sign, a1)),
                                  _mm256_max_ps(_mm256_andnot_ps(sign, a2), _mm256_andnot_ps(sign, a3)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        __m256 p8 = _mm256_add_ps(_mm256_add_ps(a0, a2), _mm256_add_ps(a1, a3));
#endif
#if defined(__AVX2__)
        __m128 p4 = _mm_add_ps(_mm256_castps256_ps128(p8), _mm256_extractf128_ps(p8, 1));
        __m128 p2 = _mm_add_ps(p4, _mm_movehl_ps(p4, p4));
        float sum = _mm_cvtss_f32(_mm_add_ss(p2, _mm_movehdup_ps(p2)));
#else
        float amax = 0.0f, p[16];
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(x[i]));
        for (int i = 0; i < 16; i++) p[i] = x[i] + x[i + 16];
        for (int w = 8; w >= 1; w /= 2)
            for (int i = 0; i < w; i++) p[i] = p[i] + p[i + w];
        float sum = p[0];
#endif
        /* A subnormal step would make 1/d infinite: such a block (all below ~1e-34) is zero. */
        float d = amax / 32767.0f, inv = d >= FLT_MIN ? 1.0f / d : 0.0f;
#if defined(__AVX512F__)
        __m512 vi = _mm512_set1_ps(inv);
        _mm256_storeu_si256((__m256i *)xq, _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(lo, vi))));
        _mm256_storeu_si256((__m256i *)(xq + 16), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(hi, vi))));
#elif defined(__AVX2__)
        __m256 vi = _mm256_set1_ps(inv);
        __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(a0, vi)), q1 = _mm256_cvtps_epi32(_mm256_mul_ps(a1, vi));
        __m256i q2 = _mm256_cvtps_epi32(_mm256_mul_ps(a2, vi)), q3 = _mm256_cvtps_epi32(_mm256_mul_ps(a3, vi));
        /* packs works within 128-bit lanes: the permute puts the 16 values back in order */
        _mm256_storeu_si256((__m256i *)xq, _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8));
        _mm256_storeu_si256((__m256i *)(xq + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(q2, q3), 0xD8));
#else
        for (int i = 0; i < QK; i++) xq[i] = (int16_t)lrintf(x[i] * inv);
#endif
        xd[b] = d;
        xs[b] = sum;
    }
}

/* A product's activations as its kernels read them: quantized to 16 bits (q, d, s) for the
 * 16-bit path, packed into the float GEMM's panels (p; see quant_gemm.c) for PANELS; a step
 * whose weights take both paths holds both. */
typedef struct {
    int16_t *q;
    float *d, *s;
    float *p;
    int64_t k, m; /* row length, rows; rows are k apart in q, k / 32 apart in d and s */
    uint16_t *b;  /* bfloat16 for AMX tiles and vdpbf16ps: rows of k rounded up to 32, 16 rows at least */
    int64_t ldb;  /* 0: b's rows are amx_row(k) apart, 16 rows at least (acts_alloc; the decode loop reuses a
                   * buffer for every k); else a caller's bfloat16 rows this far apart (qmatmul_bf16) */
    int8_t *h;    /* AMX-INT8: q split as 256 h + l, in tiles (i8_split, quant_amx_i8.c); with d and s, */
    uint8_t *l;   /* readable up to m rounded up to 16 */
} Acts;

static inline int64_t amx_row(int64_t k) { return (k + 31) / 32 * 32; }
static inline int64_t acts_ldb(const Acts *a) { return a->ldb ? a->ldb : amx_row(a->k); }

static void quantize_rows(const float *x, int64_t ldx, int64_t r0, int64_t r1, const Acts *a) {
    int64_t k = a->k;
    for (int64_t i = r0; i < r1; i++) {
        quantize16(x + i * ldx, k, a->q + i * k, a->d + i * (k / QK), a->s + i * (k / QK));
    }
}
