/* Float32 rounded to bfloat16 as torch's `.to(torch.bfloat16)` rounds it (nearest even; a NaN
 * stays a NaN), for each library that stores bfloat16 (layers/csrc/quant_amx.c: the products'
 * activations; attention/csrc/paged_decode.c: the KV cache and the queries), both built with -I
 * on this folder, so every bfloat16 the engine writes is rounded by this one code. */
#ifndef SHARDSERVE_BF16_H
#define SHARDSERVE_BF16_H
#include <stdint.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

/* A float's bits rounded to bfloat16, to nearest even; NaN stays NaN. */
static inline uint16_t bf16_round(uint32_t u) {
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* x[0..k) rounded to bfloat16 into o (bf16_round): 16 lanes at once where the CPU has AVX-512
 * (the scalar loop does not vectorize: its NaN branch), the same bits. */
static inline void bf16_round_row(const float *x, int64_t k, uint16_t *o) {
    const uint32_t *src = (const uint32_t *)x;
    int64_t e = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512i half = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1), quiet = _mm512_set1_epi32(0x40);
    const __m512i mag = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
    for (; e + 16 <= k; e += 16) {
        __m512i u = _mm512_loadu_si512(src + e), top = _mm512_srli_epi32(u, 16);
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(half, _mm512_and_si512(top, one))), 16);
        __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, mag), inf);
        r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(top, quiet));
        _mm256_storeu_si256((__m256i *)(o + e), _mm512_cvtepi32_epi16(r));
    }
#endif
    for (; e < k; e++) o[e] = bf16_round(src[e]);
}
#endif
