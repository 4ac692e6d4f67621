/* The x16 kernels' vector helpers (quant_x16.c includes this file; not compiled alone): VF, 16
 * float lanes, and VI, 16 int32 lanes (or 32 int16 ones), as one AVX-512 register or as two AVX2
 * halves, with the loads, widenings, dot products and stores the kernels use. X16_VEC says they
 * exist; X16_PATH names them for kernel_paths(). NXMAX is the activation rows of a register tile:
 * each row holds an integer and a float accumulator, so 12 fit AVX-512's 32 registers beside the
 * widened weights; two AVX2 halves each, 8 rows already fill AVX2's 16. More rows a tile widen
 * each weight chunk fewer times per product. */

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* ---- 16 lanes in one register */
typedef __m512i VI;
typedef __m512 VF;
static inline VF vf_zero(void) { return _mm512_setzero_ps(); }
static inline VF vf_load(const float *p) { return _mm512_loadu_ps(p); }
/* 16 lanes' pairs of bfloat16 (lane l: p[2l], p[2l + 1]) as two float vectors: each bfloat16
 * is the top half of its float, so exact */
static inline void vf_load_bf16x2(const uint16_t *p, VF *w0, VF *w1) {
    __m512i v = _mm512_loadu_si512((const void *)p);
    *w0 = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *w1 = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
}
static inline VF vf_fma_b(VF w, const float *x, VF t) { return _mm512_fmadd_ps(w, _mm512_set1_ps(*x), t); }
static inline VF vf_bcast(const float *x) { return _mm512_set1_ps(*x); }
static inline VF vf_fma(VF a, VF b, VF t) { return _mm512_fmadd_ps(a, b, t); }
static inline VI vi_zero(void) { return _mm512_setzero_si512(); }
static inline VI vi_add(VI a, VI b) { return _mm512_add_epi32(a, b); }
static inline void w4(const uint8_t *chunk, VI *lo, VI *hi) {
    __m256i v = _mm256_loadu_si256((const __m256i *)chunk), m4 = _mm256_set1_epi8(0x0F);
    *lo = _mm512_cvtepu8_epi16(_mm256_and_si256(v, m4));
    *hi = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
}
static inline VI w8(const uint8_t *chunk) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)chunk)); }
/* acc += w . the pair of activations at x2 broadcast to every lane. With VNNI the pair is read by
 * vpdpwssd itself ({1to16}): from the intrinsics GCC emits a separate broadcast for each and
 * copies accumulators between registers around them, slower than this (the same integers either
 * way; the README has the measurements). */
typedef int32_t __attribute__((may_alias)) pair16; /* two int16 read as one operand */
static inline VI dp(VI acc, VI w, const int16_t *x2) {
#ifdef __AVX512VNNI__
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const pair16 *)x2));
    return acc;
#else
    int32_t pair;
    memcpy(&pair, x2, 4);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, _mm512_set1_epi32(pair)));
#endif
}
static inline VF f16s(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline VF vf_scale(VF v, float c) { return _mm512_mul_ps(v, _mm512_set1_ps(c)); }
/* t = fma(float(acc), sd, t) */
static inline VF vf_fma_i(VI acc, VF sd, VF t) { return _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), sd, t); }
static inline VF vf_fma_c(VF m, float c, VF t) { return _mm512_fmadd_ps(m, _mm512_set1_ps(c), t); }
static inline void vf_store(float *y, VF t, int lanes) {
    if (lanes == GL) _mm512_storeu_ps(y, t);
    else _mm512_mask_storeu_ps(y, (__mmask16)((1u << lanes) - 1), t);
}
#define X16_PATH "avx512" X16_DP
#define X16_VEC 1 /* the vector helpers above exist */
#define NXMAX 12
#ifdef __AVX512VNNI__
#define X16_DP " vnni (vpdpwssd zmm)"
#else
#define X16_DP " (vpmaddwd zmm)"
#endif

#elif defined(__AVX2__) && defined(__F16C__)
/* ---- 16 lanes as two 8-lane halves: the same arithmetic per lane */
typedef struct { __m256i a, b; } VI;
typedef struct { __m256 a, b; } VF;
static inline VF vf_zero(void) { return (VF){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline VF vf_load(const float *p) { return (VF){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void vf_load_bf16x2(const uint16_t *p, VF *w0, VF *w1) {
    __m256i a = _mm256_loadu_si256((const __m256i *)p), b = _mm256_loadu_si256((const __m256i *)(p + 16));
    __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
    *w0 = (VF){_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16))};
    *w1 = (VF){_mm256_castsi256_ps(_mm256_and_si256(a, hi)), _mm256_castsi256_ps(_mm256_and_si256(b, hi))};
}
static inline VF vf_fma_b(VF w, const float *x, VF t) {
    __m256 b = _mm256_set1_ps(*x);
    return (VF){_mm256_fmadd_ps(w.a, b, t.a), _mm256_fmadd_ps(w.b, b, t.b)};
}
static inline VF vf_bcast(const float *x) { const __m256 b = _mm256_set1_ps(*x); return (VF){b, b}; }
static inline VF vf_fma(VF a, VF b, VF t) { return (VF){_mm256_fmadd_ps(a.a, b.a, t.a), _mm256_fmadd_ps(a.b, b.b, t.b)}; }
static inline VI vi_zero(void) { return (VI){_mm256_setzero_si256(), _mm256_setzero_si256()}; }
static inline VI vi_add(VI x, VI y) { return (VI){_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)}; }
static inline void w4(const uint8_t *chunk, VI *lo, VI *hi) {
    __m256i v = _mm256_loadu_si256((const __m256i *)chunk), m4 = _mm256_set1_epi8(0x0F);
    __m256i l = _mm256_and_si256(v, m4), h = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    *lo = (VI){_mm256_cvtepu8_epi16(_mm256_castsi256_si128(l)), _mm256_cvtepu8_epi16(_mm256_extracti128_si256(l, 1))};
    *hi = (VI){_mm256_cvtepu8_epi16(_mm256_castsi256_si128(h)), _mm256_cvtepu8_epi16(_mm256_extracti128_si256(h, 1))};
}
static inline VI w8(const uint8_t *chunk) {
    __m256i v = _mm256_loadu_si256((const __m256i *)chunk);
    return (VI){_mm256_cvtepi8_epi16(_mm256_castsi256_si128(v)), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1))};
}
static inline __m256i dp8(__m256i acc, __m256i w, __m256i x) {
#ifdef __AVXVNNI__
    return _mm256_dpwssd_avx_epi32(acc, w, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
#endif
}
static inline VI dp(VI acc, VI w, const int16_t *x2) {
    int32_t pair;
    memcpy(&pair, x2, 4);
    __m256i x = _mm256_set1_epi32(pair);
    return (VI){dp8(acc.a, w.a, x), dp8(acc.b, w.b, x)};
}
static inline VF f16s(const uint8_t *p) {
    return (VF){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)))};
}
static inline VF vf_scale(VF v, float c) {
    __m256 s = _mm256_set1_ps(c);
    return (VF){_mm256_mul_ps(v.a, s), _mm256_mul_ps(v.b, s)};
}
static inline VF vf_fma_i(VI acc, VF sd, VF t) {
    return (VF){_mm256_fmadd_ps(_mm256_cvtepi32_ps(acc.a), sd.a, t.a), _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc.b), sd.b, t.b)};
}
static inline VF vf_fma_c(VF m, float c, VF t) {
    __m256 s = _mm256_set1_ps(c);
    return (VF){_mm256_fmadd_ps(m.a, s, t.a), _mm256_fmadd_ps(m.b, s, t.b)};
}
static inline void vf_store(float *y, VF t, int lanes) {
    float tmp[GL];
    _mm256_storeu_ps(tmp, t.a);
    _mm256_storeu_ps(tmp + 8, t.b);
    memcpy(y, tmp, sizeof(float) * (size_t)lanes);
}
#define X16_PATH "avx2" X16_DP
#define X16_VEC 1
#define NXMAX 8
#ifdef __AVXVNNI__
#define X16_DP " avx-vnni (vpdpwssd ymm)"
#else
#define X16_DP " (vpmaddwd ymm)"
#endif
#endif
