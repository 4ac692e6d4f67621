#define _DEFAULT_SOURCE /* syscall() and friends under -std=c11: first, before any header */
/* A decode step's decoder layers in one call, for the CPU: the library the layers load.
 *
 * This file is the one compiled unit: it includes the block-quantized products
 * (quant_matmul.c), the fused small operators (cpu_ops.c), the gate/up product with its SiLU
 * (gate_up_silu.c), the adapters' products (lora.c) and the sampler's passes over logits
 * (logit_rows.c), and adds `decode_layers`, which runs every layer of a dense llama-family
 * stack for a few decode rows without returning to Python. In a one-row step the layers'
 * arithmetic is small; from Python the same step is a dozen or more operator calls per layer,
 * each costing more than its arithmetic. The decode attention kernel lives in another library
 * (attention/csrc/paged_decode.c) and is passed in as a function pointer.
 *
 * Per layer, x being the residual stream [m, hidden]:
 *   h = rms_norm(x); qkv = h W_qkv^T (+ bias); [q_norm, k_norm per head]; rotary on q and k;
 *   k, v -> the cache at this row's slot; a = attention(q, cache); x += a W_o^T;
 *   h = rms_norm(x); x += (silu(h W_gate^T) * (h W_up^T)) W_down^T.
 * Gemma's layers norm each block's output again before the add, and take GELU for SiLU.
 * The same formulas as the torch modules in layers/, so outputs agree to float rounding (the
 * products to the 16-bit activations of quant_matmul.c).
 */
#include "quant_matmul.c"
#include "cpu_ops.c"
#include "gate_up_silu.c"
#include "lora.c"
#include "logit_rows.c"

#ifdef __AVX2__
#define GEMM_PATH "avx2 fma, 8 lanes"
#else
#define GEMM_PATH "plain C"
#endif

/* The instructions this build's products run on (it is compiled for the host CPU, so what the
 * CPU offers decides them once): logged when the library loads, shown by `shardserve env`. */
const char *kernel_paths(void) {
    static char text[400];
    int bf = bf16_path();
    snprintf(text, sizeof text, "Q4_0/Q4_1/Q8_0/float32 products: x16 groups on %s%s; bfloat16: %s; Q4_K/Q6_K: %s",
             X16_PATH, i8_ready() ? I8_PATH_ON : "",
             bf == 1 ? AMX_PATH_ON : bf == 2 ? DPBF_PATH_ON : "x16 groups, float32 activations", GEMM_PATH);
    if (!amx_ready() && AMX_BUILT) /* said where the CPU lists AMX and it is not used */
        snprintf(text + strlen(text), sizeof text - strlen(text), " (%s)", amx_why);
    else if (!i8_ready() && AMX_I8_BUILT)
        snprintf(text + strlen(text), sizeof text - strlen(text), " (AMX-INT8: %s)", i8_why);
    else if (bf == 0 && DPBF_BUILT)
        snprintf(text + strlen(text), sizeof text - strlen(text), " (vdpbf16ps off: SHARDSERVE_FLOAT32_ACTIVATIONS)");
    return text;
}

typedef struct {
    int64_t type, rows, row_bytes;
    const uint8_t *data;
} Seg; /* rows of a weight in one block format */

typedef struct {
    int64_t nseg;
    Seg seg[3];
} Mat; /* a weight as up to 3 row segments (a fused q/k/v may mix formats) */

typedef struct {
    const float *ln1, *ln2, *qkv_bias, *q_norm, *k_norm; /* the last three may be NULL */
    Mat qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* [slots, hkv, d], float32 or (Dims.kv_bf16) bfloat16 */
    LoraMat lqkv, lo, lgate_up, ldown; /* --enable-lora: the adapter slots of each product (a NULL: none) */
    /* Gemma's sandwich: the attention's and the MLP's outputs normed before the residual add
     * (NULL: added as they are; ln2 is then its pre_feedforward_layernorm). */
    const float *post_attn, *post_ffn;
    int64_t windowed; /* reads the Window side where decode_layers is given one */
} Layer;

typedef struct {
    int64_t hidden, hq, hkv, d, inter;
    float eps, scale;
    const int64_t *kv_of_q;
    int64_t kv_bf16; /* the caches hold bfloat16: new rows rounded (nearest even) as written */
    int64_t rd;      /* each head's leading dims that RoPE rotates (d but under partial rotary) */
    int64_t act;     /* the MLP's activation: 0 SiLU, 1 GELU's tanh approximation */
    float softcap;   /* > 0: attention scores bounded to softcap * tanh(s / softcap) (Gemma 2) */
} Dims;

typedef struct {
    const float *cos, *sin;                             /* [m, rd/2]; NULL: the full layers' tables */
    const int64_t *block_tables, *context_lens, *skips; /* as decode_layers' own, under the window */
    int64_t max_pages;
} Window; /* what the windowed layers read where the others attend fully (Gemma 3) */

typedef int (*attn_fn)(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                       const int64_t *block_tables, int64_t max_pages, const int64_t *context_lens,
                       const int64_t *skips, const int64_t *kv_of_q, float *out, float *lse, int64_t B, int64_t H,
                       int64_t Hkv, int64_t D, int64_t page_size, float scale, float softcap, int num_threads);

/* This thread's share of y = x W^T: runs of weight rows claimed from *next (see claim_rows), a
 * run that spans segments taken segment by segment; x both as floats and as `a` prepares it. */
static void mat_rows(const Mat *w, const Acts *a, const float *x, int64_t m, float *y, int64_t ldy, float *wp,
                     int64_t *next, int nth) {
    int64_t total = 0;
    for (int64_t s = 0; s < w->nseg; s++) total += w->seg[s].rows;
    const int64_t grain = claim_grain((int)w->seg[0].type, m, total, nth);
    for (int64_t r0, r1; (r0 = claim_rows(next, total, grain, nth, &r1)) >= 0;) {
        for (int64_t s = 0, off = 0; s < w->nseg && off < r1; off += w->seg[s++].rows) { /* its segments */
            const Seg *g = &w->seg[s];
            int64_t lo = r0 > off ? r0 - off : 0, hi = r1 - off < g->rows ? r1 - off : g->rows;
            if (lo < hi)
                qmatmul_rows((int)g->type, g->data, g->row_bytes, g->rows, lo, hi, a, x, a->k, m, y + off, ldy, wp);
        }
    }
}

static int mat_fits(const Mat *w, int64_t k) {
    for (int64_t s = 0; s < w->nseg; s++)
        if (!fits((int)w->seg[s].type, k)) return 0;
    return 1;
}

typedef struct {
    const int64_t *block_tables, *context_lens, *skips; /* [m, max_pages], [m], [m] or NULL (no window) */
    int64_t max_pages, page_size;
    attn_fn attn;
} Pages; /* what the attention kernel reads besides q and the caches */

/* Attention for the step's rows into att, each row then into `aq` (quantized or packed) when not NULL.
 * Several rows: claimed a few at a time from *next (their contexts differ in length, and a thread
 * the OS preempts leaves its rows to the others). One row: this thread's share of the query
 * heads (one row claimed whole would leave the other threads idle); the caller quantizes it. */
static int attend(const Layer *L, const Dims *dm, const float *qkv, int64_t nqkv, float *att, int64_t m,
                  const Pages *pg, const Acts *aq, int64_t *next, int tid, int nth) {
    int64_t d = dm->d, nq = dm->hq * d;
    if (m == 1) {
        int64_t h0 = dm->hq * tid / nth, h1 = dm->hq * (tid + 1) / nth;
        if (h1 == h0) return 0;
        return pg->attn(qkv + h0 * d, nqkv, L->k_cache, L->v_cache, pg->block_tables, pg->max_pages,
                        pg->context_lens, pg->skips, dm->kv_of_q + h0, att + h0 * d, NULL, 1, h1 - h0, dm->hkv, d,
                        pg->page_size, dm->scale, dm->softcap, 1);
    }
    int64_t step = (m + 4 * nth - 1) / (4 * nth); /* rows per claim: a quarter of an even share */
    for (int64_t c; (c = claim(next, (m + step - 1) / step)) >= 0;) {
        int64_t i = c * step, n = i + step < m ? step : m - i;
        if (pg->attn(qkv + i * nqkv, nqkv, L->k_cache, L->v_cache, pg->block_tables + i * pg->max_pages,
                     pg->max_pages, pg->context_lens + i, pg->skips ? pg->skips + i : NULL, dm->kv_of_q,
                     att + i * nq, NULL, n, dm->hq, dm->hkv, d, pg->page_size, dm->scale, dm->softcap, 1))
            return 1;
        if (aq) acts_rows(att, nq, i, i + n, aq);
    }
    return 0;
}

/* Rows [r0, r1) of x: h = rms_norm(x) and, when `prep`, h into `a` (quantized or packed). */
static void norm_rows(const float *x, int64_t r0, int64_t r1, int64_t H, const float *w, float eps, float *h,
                      const Acts *a, int prep) {
    rms_norm_f32(x + r0 * H, r1 - r0, H, H, w, eps, h + r0 * H, H, 1);
    if (prep) acts_rows(h, H, r0, r1, a);
}

/* x [m, hidden] in/out. cos, sin [m, rd/2]; slots [m] (each row's new cache slot); block_tables
 * [m, max_pages], context_lens [m] and skips [m] (NULL: no sliding window) as the attention kernel
 * takes them; `win` (NULL: none) what the layers marked `windowed` read instead. Returns 0, 1 for
 * a weight the kernels do not take (checked before anything runs), 2 when out of memory.
 *
 * One parallel region covers the whole stack: the threads claim runs of the products' weight
 * rows and the attention's rows (`mat_rows`, `attend`), the small steps (norms, rotary, the cache
 * write, SiLU, residual adds) split the activation rows evenly, and barriers (not a fork and join
 * per operator) separate the phases. */
int decode_layers(const Layer *layers, int64_t nlayers, const Dims *dm, float *x, int64_t m, const float *cos,
                  const float *sin, const int64_t *slots, const int64_t *block_tables, int64_t max_pages,
                  const int64_t *context_lens, const int64_t *skips, int64_t page_size, attn_fn attn, int nthreads,
                  const LoraRows *lrows, const Window *win) {
    int64_t H = dm->hidden, d = dm->d, nq = dm->hq * d, nkv = dm->hkv * d, nqkv = nq + 2 * nkv, I = dm->inter;
    for (int64_t l = 0; l < nlayers; l++) {
        const Layer *L = &layers[l];
        if (!mat_fits(&L->qkv, H) || !mat_fits(&L->o, nq) || !mat_fits(&L->gate_up, H) || !mat_fits(&L->down, I))
            return 1;
    }
    int paths = 0; /* the products' paths (product_path), as bits: which activation buffers they read */
    for (int64_t l = 0; l < nlayers; l++) {
        const Mat *mats[4] = {&layers[l].qkv, &layers[l].o, &layers[l].gate_up, &layers[l].down};
        for (int j = 0; j < 4; j++)
            for (int64_t s = 0; s < mats[j]->nseg; s++) paths |= 1 << product_path((int)mats[j]->seg[s].type, m);
    }
    int64_t kmax = H > nq ? H : nq;
    kmax = kmax > I ? kmax : I;
    int64_t klora = 0; /* the widest adapter shrink: the scratch of A x */
    for (int64_t l = 0; lrows && l < nlayers; l++) {
        const LoraMat *lm[4] = {&layers[l].lqkv, &layers[l].lo, &layers[l].lgate_up, &layers[l].ldown};
        for (int j = 0; j < 4; j++)
            if (lm[j]->a && lm[j]->k > klora) klora = lm[j]->k;
    }
    float *buf = malloc(sizeof(float) * (size_t)(m * (H + nqkv + nq + 3 * I + H + klora)));
    int64_t *next = calloc((size_t)(nlayers * 5), sizeof(int64_t)); /* claim counters: 5 per layer */
    Acts a;
    int ok = acts_alloc(&a, m, kmax, paths);
    int prep = a.q || a.p || a.b; /* some product reads `a` (else all read x itself) */
    if (!buf || !next || !ok) { free(buf); free(next); acts_free(&a); return 2; }
    float *h = buf, *qkv = h + m * H, *att = qkv + m * nqkv, *gu = att + m * nq, *act = gu + m * 2 * I,
          *t = act + m * I, *u = t + m * H;
    int rc = 0;
    Acts aH = a, aQ = a, aI = a; /* the same buffers, read as rows of H, nq or I */
    aH.k = H; aQ.k = nq; aI.k = I;
    Pages pg = {block_tables, context_lens, skips, max_pages, page_size, attn}, pgw = pg;
    const float *wcos = cos, *wsin = sin;
    if (win && win->block_tables) pgw = (Pages){win->block_tables, win->context_lens, win->skips, win->max_pages,
                                                page_size, attn};
    if (win && win->cos) wcos = win->cos, wsin = win->sin;
#pragma omp parallel num_threads(nthreads)
    {
        int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        int64_t r0 = m * tid / nth, r1 = m * (tid + 1) / nth; /* this thread's rows of the small steps */
        float *wp = needs_scratch(paths) ? malloc(gemm_scratch(kmax, paths)) : NULL;
        if (needs_scratch(paths) && !wp) {
#pragma omp atomic write
            rc = 2;
        }
#pragma omp barrier
        for (int64_t l = 0; l < nlayers && !rc; l++) {
            const Layer *L = &layers[l];
            const Pages *P = L->windowed ? &pgw : &pg;
            const float *lcos = L->windowed ? wcos : cos, *lsin = L->windowed ? wsin : sin;
            norm_rows(x, r0, r1, H, L->ln1, dm->eps, h, &aH, prep);
#pragma omp barrier
            mat_rows(&L->qkv, &aH, h, m, qkv, nqkv, wp, &next[5 * l], nth);
#pragma omp barrier
            /* The module path's order: the product, its bias, then the adapters' share. */
            int lq = lrows && L->lqkv.a;
            if (lq) {
                for (int64_t i = r0; i < r1 && L->qkv_bias; i++)
                    for (int64_t e = 0; e < nqkv; e++) qkv[i * nqkv + e] += L->qkv_bias[e];
                lora_apply(&L->lqkv, lrows, h, H, H, u, qkv, nqkv, tid, nth);
            }
            for (int64_t i = r0; i < r1; i++) {
                float *row = qkv + i * nqkv;
                if (L->qkv_bias && !lq)
                    for (int64_t e = 0; e < nqkv; e++) row[e] += L->qkv_bias[e];
                if (L->q_norm) {
                    rms_norm_f32(row, dm->hq, d, d, L->q_norm, dm->eps, row, d, 1);
                    rms_norm_f32(row + nq, dm->hkv, d, d, L->k_norm, dm->eps, row + nq, d, 1);
                }
                rotary_f32(row, nqkv, dm->hq, row + nq, nqkv, dm->hkv, 1, d, dm->rd, lcos + i * (dm->rd / 2),
                           lsin + i * (dm->rd / 2), 1);
                if (dm->kv_bf16) {
                    bf16_rows_of(row + nq, 0, 0, 1, nkv, nkv, (uint16_t *)L->k_cache + slots[i] * nkv);
                    bf16_rows_of(row + nq + nkv, 0, 0, 1, nkv, nkv, (uint16_t *)L->v_cache + slots[i] * nkv);
                } else {
                    memcpy((float *)L->k_cache + slots[i] * nkv, row + nq, sizeof(float) * (size_t)nkv);
                    memcpy((float *)L->v_cache + slots[i] * nkv, row + nq + nkv, sizeof(float) * (size_t)nkv);
                }
            }
            /* Rows' caches are written before any row is attended; one row's heads are split. */
#pragma omp barrier
            if (attend(L, dm, qkv, nqkv, att, m, P, prep ? &aQ : NULL, &next[5 * l + 4], tid, nth)) {
#pragma omp atomic write
                rc = 2;
            }
            if (m == 1) {
#pragma omp barrier
                if (prep && tid == 0) acts_rows(att, nq, 0, 1, &aQ);
            }
#pragma omp barrier
            mat_rows(&L->o, &aQ, att, m, t, H, wp, &next[5 * l + 1], nth);
#pragma omp barrier
            if (lrows && L->lo.a) lora_apply(&L->lo, lrows, att, nq, nq, u, t, H, tid, nth);
            if (L->post_attn) rms_norm_f32(t + r0 * H, r1 - r0, H, H, L->post_attn, dm->eps, t + r0 * H, H, 1);
            for (int64_t e = r0 * H; e < r1 * H; e++) x[e] += t[e];
            norm_rows(x, r0, r1, H, L->ln2, dm->eps, h, &aH, prep);
#pragma omp barrier
            mat_rows(&L->gate_up, &aH, h, m, gu, 2 * I, wp, &next[5 * l + 2], nth);
#pragma omp barrier
            if (lrows && L->lgate_up.a) lora_apply(&L->lgate_up, lrows, h, H, H, u, gu, 2 * I, tid, nth);
            (dm->act ? gelu_tanh_mul_f32 : silu_mul_f32)(gu + r0 * 2 * I, r1 - r0, 2 * I, I, act + r0 * I, 1);
            if (prep) acts_rows(act, I, r0, r1, &aI);
#pragma omp barrier
            mat_rows(&L->down, &aI, act, m, t, H, wp, &next[5 * l + 3], nth);
#pragma omp barrier
            if (lrows && L->ldown.a) lora_apply(&L->ldown, lrows, act, I, I, u, t, H, tid, nth);
            if (L->post_ffn) rms_norm_f32(t + r0 * H, r1 - r0, H, H, L->post_ffn, dm->eps, t + r0 * H, H, 1);
            for (int64_t e = r0 * H; e < r1 * H; e++) x[e] += t[e]; /* the next layer starts on these rows */
        }
        free(wp);
    }
    free(buf);
    free(next);
    acts_free(&a);
    return rc;
}
