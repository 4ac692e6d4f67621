/* Multi-LoRA products for one step's rows, each row with its own adapter slot (or none, -1).
 *
 * A layer holds every slot's matrices stacked: A [slots, k, in] (the pieces of a fused layer
 * one after another, each `r` rows) and B transposed, Bt [slots, r, out], whose output columns
 * belong to the pieces in order (piece p ends at column piece_end[p] and reads u[p*r .. p*r+r)).
 *   shrink: u[t, :] = A[slot[t]] x[t]                (k values per row; zero for a base row)
 *   expand: y[t, o] += sum_j Bt[slot[t], j, o] u[t, p(o) * r + j]
 * The scale (lora_alpha / r) is folded into Bt when an adapter is loaded. One call per product
 * serves every adapter in the step, whatever the mix: no per-adapter loop, no weight copies.
 */
#include <stdint.h>

#define LORA_CHUNK 256

void lora_shrink_f32(const float *x, int64_t rows, int64_t ldx, int64_t in, const int64_t *slot, const float *a,
                     int64_t k, float *u, int nthreads) {
#pragma omp parallel for collapse(2) num_threads(nthreads) schedule(static) if (rows * k >= 64)
    for (int64_t t = 0; t < rows; t++) {
        for (int64_t j = 0; j < k; j++) {
            float acc = 0.0f;
            if (slot[t] >= 0) {
                const float *aj = a + (slot[t] * k + j) * in, *xt = x + t * ldx;
                for (int64_t i = 0; i < in; i++) acc += aj[i] * xt[i];
            }
            u[t * k + j] = acc;
        }
    }
}

void lora_expand_f32(const float *u, int64_t rows, int64_t k, const int64_t *slot, const float *bt, int64_t out,
                     int64_t r, const int64_t *piece_end, int64_t npieces, float *y, int64_t ldy, int nthreads) {
    int64_t chunks = (out + LORA_CHUNK - 1) / LORA_CHUNK;
#pragma omp parallel for collapse(2) num_threads(nthreads) schedule(static) if (rows * chunks >= 2)
    for (int64_t t = 0; t < rows; t++) {
        for (int64_t c = 0; c < chunks; c++) {
            if (slot[t] < 0) continue;
            const float *b = bt + slot[t] * r * out;
            float *yt = y + t * ldy;
            int64_t lo = c * LORA_CHUNK, hi = lo + LORA_CHUNK < out ? lo + LORA_CHUNK : out;
            int64_t start = 0;
            for (int64_t p = 0; p < npieces; p++) {
                int64_t end = piece_end[p];
                int64_t o0 = lo > start ? lo : start, o1 = hi < end ? hi : end;
                for (int64_t j = 0; j < r && o0 < o1; j++) {
                    float uj = u[t * k + p * r + j];
                    const float *bj = b + j * out;
                    for (int64_t o = o0; o < o1; o++) yt[o] += uj * bj[o];
                }
                start = end;
            }
        }
    }
}
