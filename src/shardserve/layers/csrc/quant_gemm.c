/* The float GEMM half of quant_matmul.c (which includes this file after `expand_row`): products
 * of GEMM_ROWS activation rows or more against block-quantized weights. Not compiled alone. */

/* ------------------------------------------------------------------ many rows: a float GEMM */

/* From GEMM_ROWS activation rows up (prefill, many decode streams), 16 weight rows at a time are
 * expanded to floats and packed k-major (wp[e * 16 + j] = W[n0 + j][e], in L1/L2), and a 6 x 16
 * block of the output is computed in 12 accumulators: per e, two loads of packed weights, six
 * broadcasts of x, twelve multiply-adds (the register-blocked shape of a float GEMM). Float32
 * throughout, so exact to float rounding. */
#ifndef GEMM_ROWS
#define GEMM_ROWS 16 /* below: the 16-bit path; from here the float GEMM (measured crossover) */
#endif
#define MR 6
#define NR 16

static inline __attribute__((always_inline)) void micro(const int mr, const float *x, int64_t ldx, const float *wp,
                                                        int64_t k, float *out) {
#ifdef __AVX2__
    __m256 c[MR][2];
    for (int i = 0; i < MR; i++) c[i][0] = c[i][1] = _mm256_setzero_ps();
    for (int64_t e = 0; e < k; e++) {
        __m256 b0 = _mm256_loadu_ps(wp + e * NR), b1 = _mm256_loadu_ps(wp + e * NR + 8);
        for (int i = 0; i < mr; i++) {
            __m256 av = _mm256_broadcast_ss(x + i * ldx + e);
            c[i][0] = _mm256_fmadd_ps(av, b0, c[i][0]);
            c[i][1] = _mm256_fmadd_ps(av, b1, c[i][1]);
        }
    }
    for (int i = 0; i < mr; i++) {
        _mm256_storeu_ps(out + i * NR, c[i][0]);
        _mm256_storeu_ps(out + i * NR + 8, c[i][1]);
    }
#else
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NR; j++) {
            float t = 0.0f;
            for (int64_t e = 0; e < k; e++) t += x[i * ldx + e] * wp[e * NR + j];
            out[i * NR + j] = t;
        }
#endif
}

#ifdef __AVX2__
/* r[i] (row i of an 8 x 8 block) -> r[e] (column e). */
static inline void transpose8(__m256 r[8]) {
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20); r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20); r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31); r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31); r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}
#endif

/* wp[e * NR + j] = W[n0 + j][e] for j < nn (0 for nn <= j < NR); tmp holds 8 * k floats. */
static void pack_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t n0, int nn, int64_t k, float *wp,
                      float *tmp) {
    for (int g = 0; g < NR; g += 8) {
        for (int j = 0; j < 8; j++) {
            if (g + j < nn) expand_row(type, w + (n0 + g + j) * row_bytes, k, tmp + j * k);
            else memset(tmp + j * k, 0, sizeof(float) * (size_t)k);
        }
#ifdef __AVX2__
        for (int64_t e0 = 0; e0 < k; e0 += 8) {
            __m256 r[8];
            for (int j = 0; j < 8; j++) r[j] = _mm256_loadu_ps(tmp + j * k + e0);
            transpose8(r);
            for (int e = 0; e < 8; e++) _mm256_storeu_ps(wp + (e0 + e) * NR + g, r[e]);
        }
#else
        for (int64_t e = 0; e < k; e++)
            for (int j = 0; j < 8; j++) wp[e * NR + g + j] = tmp[j * k + e];
#endif
    }
}

/* y[i * ldy + r] = x_i . W[r] for i < m, r0 <= r < r1; wp holds NR * k floats, tmp 8 * k. */
static void gemm_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, const float *x,
                      int64_t ldx, int64_t m, int64_t k, float *y, int64_t ldy, float *wp, float *tmp) {
    for (int64_t n0 = r0; n0 < r1; n0 += NR) {
        int nn = r1 - n0 < NR ? (int)(r1 - n0) : NR;
        pack_rows(type, w, row_bytes, n0, nn, k, wp, tmp);
        for (int64_t i0 = 0; i0 < m; i0 += MR) {
            int mr = m - i0 < MR ? (int)(m - i0) : MR;
            float out[MR * NR];
            const float *xi = x + i0 * ldx;
            switch (mr) { /* constant row counts: unrolled, accumulators in registers */
            case 6: micro(6, xi, ldx, wp, k, out); break;
            case 5: micro(5, xi, ldx, wp, k, out); break;
            case 4: micro(4, xi, ldx, wp, k, out); break;
            case 3: micro(3, xi, ldx, wp, k, out); break;
            case 2: micro(2, xi, ldx, wp, k, out); break;
            default: micro(1, xi, ldx, wp, k, out); break;
            }
            for (int i = 0; i < mr; i++)
                for (int j = 0; j < nn; j++) y[(i0 + i) * ldy + n0 + j] = out[i * NR + j];
        }
    }
}

