/* Multi-LoRA products for one step's rows, each row with its own adapter slot (or none).
 *
 * A layer holds every slot's matrices stacked: A [slots, k, in] (the pieces of a fused layer
 * one after another, each `r` rows) and B transposed, Bt [slots, r, out], whose output columns
 * belong to the pieces in order (piece p ends at column piece_end[p] and reads u[p*r .. p*r+r)).
 *   shrink: u[t, :] = A[slot(t)] x[t]                (k values per row)
 *   expand: y[t, o] += sum_j Bt[slot(t), j, o] u[t, p(o) * r + j]
 * The scale (lora_alpha / r) is folded into Bt when an adapter is loaded.
 *
 * The rows arrive grouped by slot (`order`: row indices, group g = order[bounds[g] .. bounds[g+1]),
 * all with slot gslot[g]; base rows are in no group), so each adapter's matrices are read once per
 * step however many rows use it. Every u[t, j] and y[t, o] is summed in one fixed order whatever the
 * grouping, so a row's result does not depend on what else is in the step.
 */
#include <omp.h>
#include <stdint.h>

#define LORA_CHUNK 256

/* Four dot products of one x row at once: four independent chains keep the FMA units busy (one
 * chain waits on its own latency). Each dot's order depends only on `n`, never on the rows around. */
static void lora_dot4(const float *a, int64_t lda, const float *x, int64_t n, float *out) {
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
    const float *a0 = a, *a1 = a + lda, *a2 = a + 2 * lda, *a3 = a + 3 * lda;
    for (int64_t i = 0; i < n; i++) {
        s0 += a0[i] * x[i];
        s1 += a1[i] * x[i];
        s2 += a2[i] * x[i];
        s3 += a3[i] * x[i];
    }
    out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

static float lora_dot(const float *a, const float *x, int64_t n) {
    float acc = 0.0f;
    for (int64_t i = 0; i < n; i++) acc += a[i] * x[i];
    return acc;
}

typedef struct {
    const float *a, *bt; /* NULL a: the layer takes no adapters */
    int64_t k, r, npieces;
    int64_t piece_end[3];
} LoraMat;

typedef struct {
    const int64_t *order, *bounds, *gslot;
    int64_t ngroups;
} LoraRows; /* a step's adapter rows grouped by slot (see the top of this file) */

static int64_t lora_shrink_work(const LoraMat *m, const LoraRows *g) { return g->ngroups * ((m->k + 3) / 4); }

static int64_t lora_expand_work(const LoraMat *m, const LoraRows *g) {
    return g->ngroups * ((m->piece_end[m->npieces - 1] + LORA_CHUNK - 1) / LORA_CHUNK);
}

/* Work items [p0, p1) of the shrink: a (group, block of four rows of A) each. */
static void lora_shrink_part(const LoraMat *m, const LoraRows *g, const float *x, int64_t ldx, int64_t in, float *u,
                             int64_t p0, int64_t p1) {
    int64_t k = m->k, blocks = (k + 3) / 4;
    for (int64_t p = p0; p < p1; p++) {
        int64_t grp = p / blocks, j = (p % blocks) * 4;
        const float *aj = m->a + (g->gslot[grp] * k + j) * in;
        for (int64_t i = g->bounds[grp]; i < g->bounds[grp + 1]; i++) {
            int64_t t = g->order[i];
            float *ut = u + t * k + j;
            if (j + 4 <= k) {
                lora_dot4(aj, in, x + t * ldx, in, ut);
            } else {
                for (int64_t jj = 0; j + jj < k; jj++) ut[jj] = lora_dot(aj + jj * in, x + t * ldx, in);
            }
        }
    }
}

/* Work items [p0, p1) of the expand: a (group, chunk of output columns) each. */
static void lora_expand_part(const LoraMat *m, const LoraRows *g, const float *u, float *y, int64_t ldy, int64_t p0,
                             int64_t p1) {
    int64_t k = m->k, r = m->r, out = m->piece_end[m->npieces - 1];
    int64_t chunks = (out + LORA_CHUNK - 1) / LORA_CHUNK;
    for (int64_t p = p0; p < p1; p++) {
        int64_t grp = p / chunks, c = p % chunks;
        const float *b = m->bt + g->gslot[grp] * r * out;
        int64_t lo = c * LORA_CHUNK, hi = lo + LORA_CHUNK < out ? lo + LORA_CHUNK : out;
        int64_t start = 0;
        for (int64_t q = 0; q < m->npieces; q++) {
            int64_t end = m->piece_end[q];
            int64_t o0 = lo > start ? lo : start, o1 = hi < end ? hi : end;
            for (int64_t i = g->bounds[grp]; i < g->bounds[grp + 1] && o0 < o1; i++) {
                int64_t t = g->order[i];
                const float *ut = u + t * k + q * r;
                float *yt = y + t * ldy;
                int64_t j = 0;
                for (; j + 4 <= r; j += 4) { /* four rank columns per pass over the chunk of y */
                    const float *b0 = b + j * out, *b1 = b0 + out, *b2 = b1 + out, *b3 = b2 + out;
                    float u0 = ut[j], u1 = ut[j + 1], u2 = ut[j + 2], u3 = ut[j + 3];
                    for (int64_t o = o0; o < o1; o++) yt[o] += (u0 * b0[o] + u1 * b1[o]) + (u2 * b2[o] + u3 * b3[o]);
                }
                for (; j < r; j++) {
                    const float *bj = b + j * out;
                    for (int64_t o = o0; o < o1; o++) yt[o] += ut[j] * bj[o];
                }
            }
            start = end;
        }
    }
}

/* Inside a parallel region (the decode loop): thread `tid` of `nth` does its share of both
 * phases of y += B (A x) for the step's adapter rows; u: scratch of [rows, k]. */
static void lora_apply(const LoraMat *m, const LoraRows *g, const float *x, int64_t ldx, int64_t in, float *u,
                       float *y, int64_t ldy, int tid, int nth) {
    int64_t n = lora_shrink_work(m, g);
    lora_shrink_part(m, g, x, ldx, in, u, n * tid / nth, n * (tid + 1) / nth);
#pragma omp barrier
    n = lora_expand_work(m, g);
    lora_expand_part(m, g, u, y, ldy, n * tid / nth, n * (tid + 1) / nth);
#pragma omp barrier
}

static LoraMat lora_mat(const float *a, const float *bt, int64_t k, int64_t r, const int64_t *piece_end,
                        int64_t npieces) {
    LoraMat m = {a, bt, k, r, npieces, {0, 0, 0}};
    for (int64_t q = 0; q < npieces && q < 3; q++) m.piece_end[q] = piece_end[q];
    return m;
}

void lora_shrink_f32(const float *x, int64_t ldx, int64_t in, const int64_t *order, const int64_t *bounds,
                     const int64_t *gslot, int64_t ngroups, const float *a, int64_t k, float *u, int nthreads) {
    int64_t one = 0;
    LoraMat m = lora_mat(a, NULL, k, 0, &one, 1);
    LoraRows g = {order, bounds, gslot, ngroups};
    int64_t n = lora_shrink_work(&m, &g);
#pragma omp parallel num_threads(nthreads) if (n >= 8)
    {
        int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        lora_shrink_part(&m, &g, x, ldx, in, u, n * tid / nth, n * (tid + 1) / nth);
    }
}

void lora_expand_f32(const float *u, int64_t k, const int64_t *order, const int64_t *bounds, const int64_t *gslot,
                     int64_t ngroups, const float *bt, int64_t out, int64_t r, const int64_t *piece_end,
                     int64_t npieces, float *y, int64_t ldy, int nthreads) {
    LoraMat m = lora_mat(NULL, bt, k, r, piece_end, npieces);
    LoraRows g = {order, bounds, gslot, ngroups};
    int64_t n = lora_expand_work(&m, &g);
    (void)out; /* the last piece's end */
#pragma omp parallel num_threads(nthreads) if (n >= 2)
    {
        int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        lora_expand_part(&m, &g, u, y, ldy, n * tid / nth, n * (tid + 1) / nth);
    }
}
