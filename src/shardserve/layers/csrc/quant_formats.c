/* The weight formats the CPU kernels read, included by quant_matmul.c (not compiled alone):
 * what each block format's bytes mean, stated twice: plainly (`dequant_row`, the reference and
 * the path without AVX2) and as 16-bit integers in AVX2 registers (`block16`, what the
 * products and `expand_row` use). F32 (GGML's type 0) is plain float rows, BF16 (GGML's type
 * 30) plain bfloat16 rows: the top 16 bits of a float32, so widening one is exact. */

enum { F32 = 0, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14, BF16 = 30 };
#define X16 0x100 /* type flag: Q4_0, Q4_1, Q8_0, F32 or BF16 rows interleaved 16 at a time (quant_x16.c) */
static inline int x16_base(int type) { return type & 0xFF; }
static inline int is_x16(int type) { return (type & X16) != 0; }
#define QK 32   /* activation block */
#define QKK 256 /* K-quant super-block */

static inline float bf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 0) {
        if (man == 0) { bits = sign; }
        else { /* subnormal: normalise */
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 1024));
            bits = sign | (uint32_t)(127 - 15 - e) << 23 | (man & 1023) << 13;
        }
    } else if (exp == 31) { bits = sign | 0x7f800000u | man << 13; }
    else { bits = sign | (exp + 127 - 15) << 23 | man << 13; }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* Q4_K packs eight 6-bit (scale, min) pairs into 12 bytes. */
static inline void k4_scale_min(const uint8_t *q, int j, int *sc, int *m) {
    if (j < 4) { *sc = q[j] & 63; *m = q[j + 4] & 63; }
    else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Bytes of one block of Q4_0, Q4_1 or Q8_0 (of one weight for F32 and BF16). */
static inline int64_t block_bytes(int type) {
    return type == Q4_0 ? 18 : type == Q4_1 ? 20 : type == Q8_0 ? 34 : type == BF16 ? 2 : 4;
}

/* ------------------------------------------------------------------ dequantize one row */

__attribute__((unused)) static void dequant_row(int type, const uint8_t *w, int64_t k, float *y) {
    if (type == F32) {
        memcpy(y, w, sizeof(float) * (size_t)k);
    } else if (type == BF16) {
        for (int64_t e = 0; e < k; e++) {
            uint16_t h;
            memcpy(&h, w + 2 * e, 2);
            y[e] = bf16(h);
        }
    } else if (type == Q4_0 || type == Q4_1 || type == Q8_0) {
        int64_t bytes = block_bytes(type);
        for (int64_t b = 0; b < k / QK; b++, w += bytes, y += QK) {
            float d = f16(w);
            if (type == Q8_0) {
                for (int i = 0; i < QK; i++) y[i] = d * (int8_t)w[2 + i];
                continue;
            }
            float m = type == Q4_1 ? f16(w + 2) : -8.0f * d;
            const uint8_t *qs = w + (type == Q4_1 ? 4 : 2);
            for (int i = 0; i < 16; i++) {
                y[i] = d * (qs[i] & 0xF) + m;
                y[i + 16] = d * (qs[i] >> 4) + m;
            }
        }
    } else if (type == Q4_K) {
        for (int64_t b = 0; b < k / QKK; b++, w += 144) {
            float d = f16(w), dmin = f16(w + 2);
            const uint8_t *sc = w + 4, *qs = w + 16;
            for (int j = 0; j < 8; j += 2, qs += 32) {
                int s0, m0, s1, m1;
                k4_scale_min(sc, j, &s0, &m0);
                k4_scale_min(sc, j + 1, &s1, &m1);
                for (int i = 0; i < 32; i++) *y++ = d * s0 * (qs[i] & 0xF) - dmin * m0;
                for (int i = 0; i < 32; i++) *y++ = d * s1 * (qs[i] >> 4) - dmin * m1;
            }
        }
    } else { /* Q6_K: ql[128] qh[64] scales[16] d */
        for (int64_t b = 0; b < k / QKK; b++, w += 210) {
            const uint8_t *ql = w, *qh = w + 128;
            const int8_t *sc = (const int8_t *)(w + 192);
            float d = f16(w + 208);
            for (int half = 0; half < 2; half++, ql += 64, qh += 32, sc += 8, y += 128) {
                for (int l = 0; l < 32; l++) {
                    int is = l / 16;
                    y[l] = d * sc[is] * (((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32);
                    y[l + 32] = d * sc[is + 2] * (((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
                    y[l + 64] = d * sc[is + 4] * (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                    y[l + 96] = d * sc[is + 6] * (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
                }
            }
        }
    }
}

#ifdef __AVX2__
/* Block b (32 weights) of a row as 16-bit integers: lo = weights 0..15, hi = 16..31; the
 * block's weights are s_lo * lo + min and s_hi * hi + min (s_lo == s_hi except in Q6_K, whose
 * scales cover 16 weights). */
typedef struct {
    __m256i lo, hi;
    float s_lo, s_hi, min;
} Block;

static inline __attribute__((always_inline)) Block block16(const int type, const uint8_t *row, int64_t b) {
    Block k;
    const __m128i m4 = _mm_set1_epi8(0x0F);
    if (type == Q4_0 || type == Q4_1) {
        const uint8_t *blk = row + b * (type == Q4_1 ? 20 : 18);
        __m128i t = _mm_loadu_si128((const __m128i *)(blk + (type == Q4_1 ? 4 : 2)));
        k.lo = _mm256_cvtepu8_epi16(_mm_and_si128(t, m4));
        k.hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(t, 4), m4));
        k.s_lo = k.s_hi = f16(blk);
        k.min = type == Q4_1 ? f16(blk + 2) : -8.0f * k.s_lo;
    } else if (type == Q8_0) {
        const uint8_t *blk = row + b * 34;
        k.lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 2)));
        k.hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 18)));
        k.s_lo = k.s_hi = f16(blk);
        k.min = 0.0f;
    } else if (type == Q4_K) {
        const uint8_t *blk = row + (b / 8) * 144, *qs = blk + 16 + ((b % 8) / 2) * 32;
        int j = (int)(b % 8), sc, m;
        k4_scale_min(blk + 4, j, &sc, &m);
        __m128i t0 = _mm_loadu_si128((const __m128i *)qs), t1 = _mm_loadu_si128((const __m128i *)(qs + 16));
        if (j & 1) { t0 = _mm_srli_epi16(t0, 4); t1 = _mm_srli_epi16(t1, 4); }
        k.lo = _mm256_cvtepu8_epi16(_mm_and_si128(t0, m4));
        k.hi = _mm256_cvtepu8_epi16(_mm_and_si128(t1, m4));
        k.s_lo = k.s_hi = f16(blk) * sc;
        k.min = -f16(blk + 2) * m;
    } else { /* Q6_K: group g of half h */
        const uint8_t *blk = row + (b / 8) * 210;
        int h = (int)(b % 8) / 4, g = (int)(b % 4);
        const uint8_t *ql = blk + h * 64 + (g & 1) * 32, *qh = blk + 128 + h * 32;
        const int8_t *sc = (const int8_t *)(blk + 192) + h * 8 + 2 * g;
        __m256i l = _mm256_loadu_si256((const __m256i *)ql), hb = _mm256_loadu_si256((const __m256i *)qh);
        if (g >= 2) l = _mm256_srli_epi16(l, 4);
        l = _mm256_and_si256(l, _mm256_set1_epi8(0x0F));
        hb = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * g), _mm256_set1_epi8(3));
        __m256i q = _mm256_sub_epi8(_mm256_or_si256(l, _mm256_slli_epi16(hb, 4)), _mm256_set1_epi8(32));
        k.lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q));
        k.hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1));
        float d = f16(blk + 208);
        k.s_lo = d * sc[0];
        k.s_hi = d * sc[1];
        k.min = 0.0f;
    }
    return k;
}

#endif

static int known(int type) {
    if (is_x16(type))
        return type == (X16 | Q4_0) || type == (X16 | Q4_1) || type == (X16 | Q8_0) || type == (X16 | F32) ||
               type == (X16 | BF16);
    return type == F32 || type == BF16 || type == Q4_0 || type == Q4_1 || type == Q8_0 || type == Q4_K || type == Q6_K;
}

static int fits(int type, int64_t k) {
    int base = x16_base(type);
    /* BF16 rows go in pairs of columns; F32 rows in whole vectors */
    return known(type) && k % (base == BF16 ? 2 : base == F32 ? 8 : (base == Q4_K || base == Q6_K) ? QKK : QK) == 0;
}

#ifdef __AVX2__
/* Row `wr` as k floats through block16 (the K-quants). */
static inline __attribute__((always_inline)) void expand_blocks16(const int type, const uint8_t *wr, int64_t k,
                                                                  float *o) {
    for (int64_t b = 0; b < k / QK; b++, o += QK) {
        Block q = block16(type, wr, b);
        __m256 m = _mm256_set1_ps(q.min), s0 = _mm256_set1_ps(q.s_lo), s1 = _mm256_set1_ps(q.s_hi);
        __m256i part[4] = {_mm256_cvtepi16_epi32(_mm256_castsi256_si128(q.lo)),
                           _mm256_cvtepi16_epi32(_mm256_extracti128_si256(q.lo, 1)),
                           _mm256_cvtepi16_epi32(_mm256_castsi256_si128(q.hi)),
                           _mm256_cvtepi16_epi32(_mm256_extracti128_si256(q.hi, 1))};
        for (int i = 0; i < 4; i++)
            _mm256_storeu_ps(o + 8 * i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(part[i]), i < 2 ? s0 : s1, m));
    }
}

/* Row `wr` of Q4_0, Q4_1 or Q8_0 as k floats: bytes widened straight to 32 bits (no 16-bit
 * step as in block16), which expands faster; the float GEMMs of a many-stream decode step
 * spend a good part of their time here. */
static inline __attribute__((always_inline)) void expand_blocks32(const int type, const uint8_t *wr, int64_t k,
                                                                  float *o) {
    const int64_t bytes = block_bytes(type);
    const __m128i m4 = _mm_set1_epi8(0x0F);
    for (int64_t b = 0; b < k / QK; b++, o += QK, wr += bytes) {
        __m256 d = _mm256_set1_ps(f16(wr));
        __m256i v[4];
        if (type == Q8_0) {
            for (int i = 0; i < 4; i++) v[i] = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(wr + 2 + 8 * i)));
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(v[i]), d));
            continue;
        }
        __m256 m = type == Q4_1 ? _mm256_set1_ps(f16(wr + 2)) : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
        __m128i t = _mm_loadu_si128((const __m128i *)(wr + (type == Q4_1 ? 4 : 2)));
        __m128i lo = _mm_and_si128(t, m4), hi = _mm_and_si128(_mm_srli_epi16(t, 4), m4);
        v[0] = _mm256_cvtepu8_epi32(lo);
        v[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
        v[2] = _mm256_cvtepu8_epi32(hi);
        v[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(o + 8 * i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(v[i]), d, m));
    }
}
#endif

/* Row `wr` of W as k floats. */
static void expand_row(int type, const uint8_t *wr, int64_t k, float *o) {
#ifdef __AVX2__
    switch (type) { /* constant types, so each loop specializes */
    case F32: memcpy(o, wr, sizeof(float) * (size_t)k); break;
    case BF16: dequant_row(BF16, wr, k, o); break;
    case Q4_0: expand_blocks32(Q4_0, wr, k, o); break;
    case Q4_1: expand_blocks32(Q4_1, wr, k, o); break;
    case Q8_0: expand_blocks32(Q8_0, wr, k, o); break;
    case Q4_K: expand_blocks16(Q4_K, wr, k, o); break;
    default: expand_blocks16(Q6_K, wr, k, o); break;
    }
#else
    dequant_row(type, wr, k, o);
#endif
}
