/* An attention row's softmax, for paged_decode.c, which includes this file; not compiled alone. */

/* Normalizes s[0..n) in place, n >= 1, and returns its log-sum-exp; or, `inv` given, leaves the
 * exps unnormalized and sets *inv = 1 / their sum, for a values pass that multiplies as it reads
 * (the same products, so the same bits, without a pass of its own). The max starts at s[0], not
 * -inf: under -ffast-math the compiler may assume no infinities. With AVX-512, 16 lanes written
 * out (the compiler's own loop takes libmvec's 8-lane expf and a scalar one for the tail): every
 * exp on glibc's 16-lane expf, the tail's lanes masked. */
#if defined(__AVX512F__) && defined(__GLIBC__)
__m512 _ZGVeN16v_expf(__m512); /* libmvec (glibc), linked through -lm */
static float softmax(float *s, int64_t n, float *inv_out) {
    const int64_t whole = n / 16 * 16;
    const __mmask16 tail = (__mmask16)((1u << (n - whole)) - 1);
    __m512 vmx = _mm512_set1_ps(s[0]), vsum = _mm512_setzero_ps();
    for (int64_t t = 0; t < whole; t += 16) vmx = _mm512_max_ps(vmx, _mm512_loadu_ps(s + t));
    vmx = _mm512_mask_max_ps(vmx, tail, vmx, _mm512_maskz_loadu_ps(tail, s + whole));
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmx));
    for (int64_t t = 0; t < whole; t += 16) {
        __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_loadu_ps(s + t), mx));
        _mm512_storeu_ps(s + t, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    if (tail) {
        __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + whole), mx));
        _mm512_mask_storeu_ps(s + whole, tail, e);
        vsum = _mm512_mask_add_ps(vsum, tail, vsum, e);
    }
    const float sum = _mm512_reduce_add_ps(vsum);
    const __m512 inv = _mm512_set1_ps(1.f / sum);
    if (inv_out) {
        *inv_out = _mm512_cvtss_f32(inv);
        return _mm512_cvtss_f32(mx) + logf(sum);
    }
    for (int64_t t = 0; t < whole; t += 16) _mm512_storeu_ps(s + t, _mm512_mul_ps(_mm512_loadu_ps(s + t), inv));
    _mm512_mask_storeu_ps(s + whole, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, s + whole), inv));
    return _mm512_cvtss_f32(mx) + logf(sum);
}
#else
static float softmax(float *s, int64_t n, float *inv_out) {
    float mx = s[0], sum = 0.f;
    for (int64_t t = 1; t < n; ++t) mx = s[t] > mx ? s[t] : mx;
    for (int64_t t = 0; t < n; ++t) { s[t] = expf(s[t] - mx); sum += s[t]; }
    float inv = 1.f / sum;
    if (inv_out) {
        *inv_out = inv;
        return mx + logf(sum);
    }
    for (int64_t t = 0; t < n; ++t) s[t] *= inv;
    return mx + logf(sum);
}
#endif
