/* An item's attention on AMX tiles over a bfloat16 cache, for paged_bf16.c, which includes this
 * file; not compiled alone. Where this process runs AMX (amx.h: decided alike for the products)
 * and pages are whole tiles of 16 keys, every row (prefill and decode alike) takes this path:
 * scores (amx_item_scores), softmax (paged_decode.c), then values (amx_item_values). Each output
 * is one fixed chain of tile products over its own row's keys, whatever shares its tiles.
 */
#if PAGED_BF16 && AMX_BUILT
static int amx_on; /* set once, when the library loads (amx.h) */
__attribute__((constructor)) static void amx_init(void) { amx_on = amx_decide() == NULL; }

/* Scores on AMX tiles for an item's query rows, where this process runs AMX (amx.h: decided alike
 * for the products) and pages are whole tiles of 16 keys: for one KV head, a tile of 16 cached
 * keys (the page's rows as stored, 32 dims a tile row) times a tile of 16 query columns (the
 * item's rows and heads that read this KV head, their rounded queries laid out as pairs), one
 * tile product a chunk of 32 dims, summed in dim order in float32. A score is one fixed chain
 * whatever else shares its tiles, and every row on this path (prefill and decode alike) takes
 * it. The columns' pairs for chunk c of column tile j: qt + (j * nch + c) * 512. */
static void amx_query_tiles(const uint16_t *qb, int64_t D, const int64_t *cols, int64_t ncols, uint16_t *qt) {
    const int64_t nch = D / 32;
    memset(qt, 0, sizeof(uint16_t) * 512 * (size_t)(((ncols + 15) / 16) * nch));
    for (int64_t n = 0; n < ncols; ++n) {
        const uint16_t *q = qb + cols[n] * D;
        for (int64_t c = 0; c < nch; ++c)
            for (int p = 0; p < 16; ++p) {
                uint16_t *t = qt + ((n / 16) * nch + c) * 512 + p * 32 + (n % 16) * 2;
                t[0] = q[32 * c + 2 * p];
                t[1] = q[32 * c + 2 * p + 1];
            }
    }
}

/* The item's columns that read KV head kv, in order: (b - b0) * H + h for each of its rows b with
 * keys and heads h it takes. Returns their count. */
static int64_t amx_columns(const int64_t *lens, int64_t b0, int64_t b1, const unsigned char *take,
                           const int64_t *kv_of_q, int64_t kv, int64_t H, int64_t *cols) {
    int64_t n = 0;
    for (int64_t b = b0; b < b1; ++b)
        for (int64_t h = 0; h < H; ++h)
            if (take[h] && kv_of_q[h] == kv && lens[b] > 0) cols[n++] = (b - b0) * H + h;
    return n;
}

/* The 16 x 16 scores of keys [t, t + 16) of `page` (rows `stride` bfloat16 apart, this KV head's
 * D at the start) against column tile `qt` (nch chunks), into `c` (16 keys x 16 columns). */
static inline void amx_key_tile(const uint16_t *keys, int64_t stride, const uint16_t *qt, int64_t nch, float *c) {
    _tile_zero(0);
    for (int64_t ch = 0; ch < nch; ++ch) {
        _tile_loadd(4, keys + 32 * ch, stride * 2);
        _tile_loadd(6, qt + ch * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
    }
    _tile_stored(0, c, 64);
}

/* block_item's scores (paged_decode.c) on AMX tiles, one KV head at a time: its columns (the
 * item's rows and heads that read it) laid out once, then the pages in table order, 16 keys a
 * tile. Keys past a row's length in a tile are computed and not kept (a page holds whole tiles:
 * page_size is a multiple of 16 on this path). longest: the item's longest row; qt: the column
 * tiles' scratch. */
static void amx_item_scores(const uint16_t *qb, const uint16_t *k_cache, const int64_t *table, const int64_t *lens,
                            int64_t b0, int64_t b1, int64_t longest, const unsigned char *take,
                            const int64_t *kv_of_q, int64_t kv0, int64_t kv1, int64_t H, int64_t Hkv, int64_t D,
                            int64_t page_size, float scale, float *scores, int64_t max_len, uint16_t *qt) {
    const int64_t stride = Hkv * D, nch = D / 32;
    int64_t cols[(b1 - b0) * H]; /* a column: (b - b0) * H + h, its query's index in qb */
    float c[16 * 16];
    const __m512i key_rows = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 16, 0);
    const int64_t npages = (longest + page_size - 1) / page_size;
    amx_configure();
    for (int64_t kv = kv0; kv < kv1; ++kv) {
        const int64_t ncols = amx_columns(lens, b0, b1, take, kv_of_q, kv, H, cols);
        if (!ncols) continue;
        amx_query_tiles(qb, D, cols, ncols, qt);
        for (int64_t pg = 0, t0 = 0; pg < npages; ++pg, t0 += page_size) {
            const uint16_t *page = k_cache + (table[pg] * page_size * stride + kv * D);
            if (pg + 1 < npages) /* the next page's rows of this head, while this one is multiplied */
                prefetch_rows((const char *)(k_cache + table[pg + 1] * page_size * stride), 0, page_size, stride * 2,
                              kv * D * 2, D * 2);
            for (int64_t t = t0; t < t0 + page_size && t < longest; t += 16)
                for (int64_t j = 0; j * 16 < ncols; ++j) {
                    amx_key_tile(page + (t - t0) * stride, stride, qt + j * nch * 512, nch, c);
                    for (int64_t n = j * 16; n < ncols && n < j * 16 + 16; ++n) { /* column n's 16 keys */
                        const int64_t b = b0 + cols[n] / H, h = cols[n] % H, len = lens[b];
                        if (t >= len) continue;
                        const __mmask16 keep = len - t >= 16 ? 0xFFFF : (__mmask16)((1u << (len - t)) - 1);
                        const __m512 col = _mm512_i32gather_ps(key_rows, c + n % 16, 4);
                        _mm512_mask_storeu_ps(scores + (b - b0) * H * max_len + h * len + t, keep,
                                              _mm512_mul_ps(col, _mm512_set1_ps(scale)));
                    }
                }
        }
    }
    _tile_release();
}

/* Interleaves the values of keys [t0, t0 + 32) of KV head `kv` into B tiles (vp): d-tile j of
 * 16 dims at vp + j * 512, pair-row p holding, for each of its dims, key t0 + 2 p then key
 * t0 + 2 p + 1. Keys from `longest` on are zero: the cache there may hold anything, and a zero
 * probability times a NaN would not be zero. */
static void amx_value_chunk(const uint16_t *v_cache, const int64_t *table, int64_t kv, int64_t Hkv, int64_t D,
                            int64_t page_size, int64_t longest, int64_t t0, uint16_t *vp) {
    const int64_t stride = Hkv * D;
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                        5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23, 54, 22,
                                        53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
    for (int64_t t = t0; t < t0 + 32; t += 2) {
        /* t is even and page_size a multiple of 16: keys t and t + 1 share a page */
        const uint16_t *r0 = t < longest ? v_cache + (table[t / page_size] * page_size + t % page_size) * stride + kv * D
                                         : NULL, *r1 = r0 ? r0 + stride : NULL;
        uint16_t *o = vp + (t - t0) / 2 * 32;
        if (t % page_size == 0 && t + page_size < longest) /* the next page's rows of this head: pages lie anywhere */
            prefetch_rows((const char *)(v_cache + table[t / page_size + 1] * page_size * stride), 0, page_size,
                          stride * 2, kv * D * 2, D * 2);
        for (int64_t c = 0; c < D / 32; ++c) {
            __m512i a = t < longest ? _mm512_loadu_si512((const void *)(r0 + 32 * c)) : _mm512_setzero_si512();
            __m512i b = t + 1 < longest ? _mm512_loadu_si512((const void *)(r1 + 32 * c)) : _mm512_setzero_si512();
            _mm512_storeu_si512((void *)(o + 2 * c * 512), _mm512_permutex2var_epi16(a, lo, b));
            _mm512_storeu_si512((void *)(o + (2 * c + 1) * 512), _mm512_permutex2var_epi16(a, hi, b));
        }
    }
}

/* block_item's weighted values on AMX tiles, one KV head at a time: its values laid out as B
 * tiles (amx_value_chunk), then for each tile of 16 columns (the item's rows and heads reading
 * it) and each 64 dims, the probabilities of 32 keys at a time rounded to bfloat16 (nearest even)
 * as an A tile, summed in key order into float32 accumulator tiles; out[b][h] written whole.
 * scores: the exps item_softmax left, a column's probabilities those times its invs entry (the
 * normalization, done here as they are rounded); vp holds (longest rounded up to 32) * D
 * bfloat16, pt 512. */
static void amx_item_values(const float *scores, const float *invs, const uint16_t *v_cache, const int64_t *table,
                            const int64_t *lens, int64_t b0, int64_t b1, int64_t longest, const unsigned char *take,
                            const int64_t *kv_of_q, int64_t kv0, int64_t kv1, int64_t H, int64_t Hkv, int64_t D,
                            int64_t page_size, float *out, int64_t max_len, uint16_t *vp, uint16_t *pt) {
    const int64_t nd = D / 16;
    int64_t cols[(b1 - b0) * H];
    float c[4][16 * 16];
    const int64_t nchunks = (longest + 31) / 32;
    amx_configure();
    for (int64_t kv = kv0; kv < kv1; ++kv) {
        const int64_t ncols = amx_columns(lens, b0, b1, take, kv_of_q, kv, H, cols);
        if (!ncols) continue;
        /* One pass of tiles (a decode row's heads): each chunk's values laid out just before its
         * products, in L1; several: all of them first, for every pass to reuse. */
        const int once = ncols <= 16 && nd <= 4;
        for (int64_t ch = 0; !once && ch < nchunks; ++ch)
            amx_value_chunk(v_cache, table, kv, Hkv, D, page_size, longest, 32 * ch, vp + ch * nd * 512);
        for (int64_t j0 = 0; j0 < ncols; j0 += 16) {
            const int64_t nc = ncols - j0 < 16 ? ncols - j0 : 16;
            memset(pt, 0, 16 * 32 * sizeof(uint16_t)); /* rows past the columns stay zero */
            for (int64_t d0 = 0; d0 < nd; d0 += 4) {
                const int nj = nd - d0 < 4 ? (int)(nd - d0) : 4;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t ch = 0; ch < nchunks; ++ch) {
                    const int64_t t = 32 * ch;
                    for (int64_t n = 0; n < nc; ++n) { /* column n's probabilities of keys [t, t + 32) */
                        const int64_t b = b0 + cols[j0 + n] / H, h = cols[j0 + n] % H, len = lens[b];
                        const float *p = scores + (b - b0) * H * max_len + h * len + t;
                        const __m512 inv = _mm512_set1_ps(invs[(b - b0) * H + h]);
                        const int64_t left = len - t;
                        const __mmask16 k0 = left >= 16 ? 0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
                        const __mmask16 k1 = left >= 32 ? 0xFFFF : left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : 0;
                        __m512bh two = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_maskz_loadu_ps(k1, p + 16), inv),
                                                           _mm512_mul_ps(_mm512_maskz_loadu_ps(k0, p), inv));
                        _mm512_storeu_si512((void *)(pt + n * 32), (__m512i)two);
                    }
                    if (once) amx_value_chunk(v_cache, table, kv, Hkv, D, page_size, longest, t, vp);
                    _tile_loadd(4, pt, 64);
                    const uint16_t *bt = vp + ((once ? 0 : ch) * nd + d0) * 512;
                    _tile_loadd(6, bt, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    if (nj > 1) {
                        _tile_loadd(7, bt + 512, 64);
                        _tile_dpbf16ps(1, 4, 7);
                    }
                    if (nj > 2) {
                        _tile_loadd(6, bt + 1024, 64);
                        _tile_dpbf16ps(2, 4, 6);
                    }
                    if (nj > 3) {
                        _tile_loadd(7, bt + 1536, 64);
                        _tile_dpbf16ps(3, 4, 7);
                    }
                }
                _tile_stored(0, c[0], 64);
                if (nj > 1) _tile_stored(1, c[1], 64);
                if (nj > 2) _tile_stored(2, c[2], 64);
                if (nj > 3) _tile_stored(3, c[3], 64);
                for (int64_t n = 0; n < nc; ++n) {
                    const int64_t b = b0 + cols[j0 + n] / H, h = cols[j0 + n] % H;
                    for (int j = 0; j < nj; ++j)
                        memcpy(out + (b * H + h) * D + (d0 + j) * 16, c[j] + n * 16, 16 * sizeof(float));
                }
            }
        }
    }
    _tile_release();
}
#else
static const int amx_on = 0;
#endif
