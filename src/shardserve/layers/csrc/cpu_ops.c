/* The small per-layer operators of a decoder, fused for the CPU in float32.
 *
 * In a one-row decode step these are a handful of floats each, so their cost is the number of
 * operator calls, not arithmetic: torch's RMSNorm, rotate-half rotary and gated SiLU are
 * several calls each. Here each is one call. Arithmetic follows Hugging Face's float32 formulas:
 *   rms_norm:  out = w * x / sqrt(mean(x^2) + eps)
 *   rotary:    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), halves of each head, in place
 *   silu_mul:  out = silu(gate) * up, gate and up the two halves of each input row
 *   gelu_tanh_mul: out = gelu(gate) * up, GELU's tanh approximation (Gemma's gelu_pytorch_tanh)
 * Rows are split over torch's OpenMP threads only when there are enough of them to pay.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* GCC under -march=native prefers 256-bit vectors even where the CPU has AVX-512, so a loop's
 * expf calls go to libmvec's 8-lane version; this asks for 512-bit vectors in one function (and
 * libmvec's 16-lane expf where the CPU has AVX-512; elsewhere it changes nothing). */
#if defined(__GNUC__) && !defined(__clang__)
#define WIDE_VECTORS __attribute__((target("prefer-vector-width=512")))
#define ONE_COPY __attribute__((noipa)) /* neither inlined nor cloned for a caller's constants */
#else
#define WIDE_VECTORS
#define ONE_COPY __attribute__((noinline))
#endif

#define PAR_ROWS 64

/* One row of rms_norm_f32: one copy of the code, so rms_norm_bf16's rows are these bits rounded. */
static ONE_COPY void norm_row(const float *xr, int64_t dim, const float *w, float eps, float *o) {
    float ss = 0.0f;
    for (int64_t i = 0; i < dim; i++) ss += xr[i] * xr[i];
    float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int64_t i = 0; i < dim; i++) o[i] = w[i] * (xr[i] * inv);
}

void rms_norm_f32(const float *x, int64_t rows, int64_t ldx, int64_t dim, const float *w, float eps, float *out,
                  int64_t ldo, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows >= PAR_ROWS)
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * ldx, dim, w, eps, out + r * ldo);
}

/* The leading rd dims of each of `heads` heads d apart (partial rotary: rd < d; the rest kept). */
static void rotate_heads(float *x, int64_t heads, int64_t d, int64_t rd, const float *c, const float *s) {
    int64_t half = rd / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *x1 = x + h * d, *x2 = x1 + half;
        for (int64_t i = 0; i < half; i++) {
            float a = x1[i], b = x2[i];
            x1[i] = a * c[i] - b * s[i];
            x2[i] = b * c[i] + a * s[i];
        }
    }
}

/* q [T, ldq] holds hq heads of d floats at the start of each row, k likewise; each head's leading
 * rd dims are rotated (rd = d but under partial rotary); cos, sin [T, rd/2]. */
void rotary_f32(float *q, int64_t ldq, int64_t hq, float *k, int64_t ldk, int64_t hk, int64_t tokens, int64_t d,
                int64_t rd, const float *cos, const float *sin, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (tokens >= PAR_ROWS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * (rd / 2), *s = sin + t * (rd / 2);
        rotate_heads(q + t * ldq, hq, d, rd, c, s);
        rotate_heads(k + t * ldk, hk, d, rd, c, s);
    }
}

/* o[r, i] = silu(g[r, i]) * u[r, i] for i < n over `rows` rows (g and u ld apart, o ldo apart):
 * the one compiled sequence of operations every SiLU of a gated MLP on the CPU runs (both
 * entries below, the decode loop, and the gate/up product's own epilogue, qmatmul_bf16_silu), so
 * their values agree bit for bit. Neither inlined nor cloned (GCC's constant propagation would
 * compile a copy for a caller's constant widths, vectorized otherwise), so no caller gets another;
 * 16 lanes where the CPU has AVX-512 (WIDE_VECTORS). */
WIDE_VECTORS ONE_COPY static void silu_rows(const float *restrict g, const float *restrict u, int64_t ld,
                                                float *restrict o, int64_t ldo, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++, g += ld, u += ld, o += ldo)
        for (int64_t i = 0; i < n; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* One row of gate then up halves. */
static inline void silu_row(const float *g, int64_t inter, float *o) { silu_rows(g, g + inter, 0, o, 0, 1, inter); }

/* As silu_rows, for o = gelu(g) * u with GELU's tanh approximation, as torch computes
 * gelu(approximate="tanh"): 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))). The one copy
 * both the module path and the decode loop run. */
WIDE_VECTORS ONE_COPY static void gelu_rows(const float *restrict g, const float *restrict u, int64_t ld,
                                                float *restrict o, int64_t ldo, int64_t rows, int64_t n) {
    const float k0 = 0.7978845608028654f, k1 = 0.044715f;
    for (int64_t r = 0; r < rows; r++, g += ld, u += ld, o += ldo)
        for (int64_t i = 0; i < n; i++) {
            float x = g[i];
            o[i] = 0.5f * x * (1.0f + tanhf(k0 * (x + k1 * x * x * x))) * u[i];
        }
}

static inline void gelu_row(const float *g, int64_t inter, float *o) { gelu_rows(g, g + inter, 0, o, 0, 1, inter); }

void gelu_tanh_mul_f32(const float *gu, int64_t rows, int64_t ldg, int64_t inter, float *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows >= PAR_ROWS)
    for (int64_t r = 0; r < rows; r++) gelu_row(gu + r * ldg, inter, out + r * inter);
}

void silu_mul_f32(const float *gu, int64_t rows, int64_t ldg, int64_t inter, float *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows >= PAR_ROWS)
    for (int64_t r = 0; r < rows; r++) silu_row(gu + r * ldg, inter, out + r * inter);
}

/* Rows of `out` (bfloat16, `width` apart): each computed by row_of(src row, width, arg, buffer) into
 * a float32 row buffer, then rounded as a product on bfloat16 weights rounds its activations
 * (bf16_rows_of), for one that takes them so (qmatmul_bf16, qmatmul_bf16_silu): the float32 rows
 * are never stored, and the product does not pass over them again. Returns 2 when a row buffer
 * cannot be allocated. */
static int rounded_rows(void (*row_of)(const float *, int64_t, const void *, float *), const void *arg,
                        const float *src, int64_t rows, int64_t ld, int64_t width, uint16_t *out, int nthreads) {
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (rows >= PAR_ROWS) reduction(| : failed)
    {
        float *row = malloc(sizeof(float) * (size_t)width);
        failed = !row;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (!row) continue;
            row_of(src + r * ld, width, arg, row);
            bf16_rows_of(row, 0, 0, 1, width, width, out + r * width);
        }
        free(row);
    }
    return failed ? 2 : 0;
}

typedef struct {
    const float *w;
    float eps;
} NormArgs;
static void norm_of(const float *x, int64_t dim, const void *arg, float *o) {
    const NormArgs *n = arg;
    norm_row(x, dim, n->w, n->eps, o);
}
static void silu_of(const float *gu, int64_t inter, const void *arg, float *o) {
    (void)arg;
    silu_row(gu, inter, o);
}

static void gelu_of(const float *gu, int64_t inter, const void *arg, float *o) {
    (void)arg;
    gelu_row(gu, inter, o);
}

/* rms_norm_f32's rows rounded to bfloat16 (rounded_rows); out: rows `dim` apart. */
int rms_norm_bf16(const float *x, int64_t rows, int64_t ldx, int64_t dim, const float *w, float eps, uint16_t *out,
                  int nthreads) {
    const NormArgs args = {w, eps};
    return rounded_rows(norm_of, &args, x, rows, ldx, dim, out, nthreads);
}

/* silu_mul_f32's rows rounded to bfloat16 (rounded_rows); out: rows `inter` apart. */
int silu_mul_bf16(const float *gu, int64_t rows, int64_t ldg, int64_t inter, uint16_t *out, int nthreads) {
    return rounded_rows(silu_of, NULL, gu, rows, ldg, inter, out, nthreads);
}

/* gelu_tanh_mul_f32's rows rounded to bfloat16 (rounded_rows); out: rows `inter` apart. */
int gelu_tanh_mul_bf16(const float *gu, int64_t rows, int64_t ldg, int64_t inter, uint16_t *out, int nthreads) {
    return rounded_rows(gelu_of, NULL, gu, rows, ldg, inter, out, nthreads);
}
