/* Rows in the "split" layout: a row's block scales (and Q4_1's mins) first, then its 4-bit codes;
 * one row dotted on its own with AVX-512 two blocks at a time (the sparse FFN's chosen rows).
 *
 * Runs in: the process that loads decoder.c (included after qtile.h; AVX-512 VNNI builds compute,
 * others report the layout unsupported and the sparse FFN reads the file's rows).
 *
 * Why: a chosen row is dotted alone, and in the file's layout each 18-byte block costs ~17
 * instructions (its scale converted and broadcast, its offset term added, one 8-lane sum); with the
 * scales contiguous the row's 64 scales are converted 16 at a time, the offsets folded in one
 * 16-lane product, and two blocks meet 64 activations in one 512-bit dpbusd: ~6.5 instructions a
 * block. The codes and scales are the file's, moved (row bytes unchanged: 18 or 20 per block).
 */
#ifndef PI_QSPLIT_H
#define PI_QSPLIT_H

#define PI_SPLIT_MAX_COLS 8192 /* split_dot keeps a row's scales (one per 32 values) on the stack */

int pi_split_supported(int type) {
#ifdef PI_VNNI
    const pi_qtype *t = pi_qtype_of(type);
    return t && t->split;
#else
    (void)type;
    return 0;
#endif
}

/* rows [0, rows) of src (the file's layout, row_bytes apart) into dst in the split layout. */
int pi_split_repack(const uint8_t *src, int64_t row_bytes, int type, int cols, int rows, uint8_t *dst) {
    const pi_qtype *t = pi_qtype_of(type);
    if (!t || !t->split || cols % 32 || cols > PI_SPLIT_MAX_COLS) return 1; /* split_dot's scales live on its stack */
    const int nb = cols / 32, bb = t->bytes, hdr = t->qs;
    for (int r = 0; r < rows; r++) {
        const uint8_t *s = src + (size_t)r * row_bytes;
        uint8_t *o = dst + (size_t)r * row_bytes;
        for (int b = 0; b < nb; b++) {
            memcpy(o + 2 * b, s + bb * b, 2);                              /* scale */
            if (t->min >= 0) memcpy(o + 2 * nb + 2 * b, s + bb * b + t->min, 2); /* min */
            memcpy(o + (size_t)hdr * nb + 16 * b, s + bb * b + hdr, 16);   /* codes */
        }
    }
    return 0;
}

/* Rows to ask for while others are dotted: up to 8 byte ranges, walked one cache line per call
 * of pf_step (split_dot makes one every four blocks), so the requests spread over the arithmetic
 * instead of queueing in one burst ahead of it: a burst of a quad's 144 lines filled the miss
 * queue and stalled the dot products behind it (the phase was their compute plus their wait). On
 * a Zen 4, in process: the chosen rows' phase 0.918-0.948x, the step 0.953-0.994x; the sparse down
 * (36 lines a group of four half rows) measured 1.08x spread, so it keeps its burst. */
typedef struct {
    const uint8_t *p[8];
    int64_t n[8];
    int k, i;
    int64_t o;
} pi_pf;

static inline void pf_step(pi_pf *c) {
    if (!c || c->i >= c->k) return;
    __builtin_prefetch(c->p[c->i] + c->o, 0, 2); /* into L2, as prefetch_row_bytes */
    if ((c->o += 64) >= c->n[c->i]) c->i++, c->o = 0;
}

static inline void pf_rest(pi_pf *c) {
    while (c && c->i < c->k) pf_step(c);
}

#ifdef PI_VNNI
/* row (split layout) . x for K values: sum_b scale_b dx_b sum(q x) + offset term. */
static float split_dot(const uint8_t *row, int type, const pi_act *x, int K, pi_pf *pf) {
    const int nb = K / 32, q41 = type == T_Q4_1;
    const uint16_t *sc = (const uint16_t *)row;
    const uint8_t *codes = row + (size_t)(q41 ? 4 : 2) * nb;
    float fs[PI_SPLIT_MAX_COLS / 32] __attribute__((aligned(64))); /* scale_b * dx_b (pi_split_repack refuses wider rows) */
    __m512 corr = _mm512_setzero_ps();
    int b = 0;
    for (; b + 16 <= nb; b += 16) {
        const __m512 s16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + b)));
        _mm512_store_ps(fs + b, _mm512_mul_ps(s16, _mm512_loadu_ps(x->d + b)));
        const __m512 off = q41 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + nb + b))) : _mm512_mul_ps(s16, _mm512_set1_ps(-8.0f));
        corr = _mm512_fmadd_ps(off, _mm512_loadu_ps(x->s + b), corr);
    }
    float tail = 0.0f;
    for (; b < nb; b++) {
        const float s1 = h2f(sc[b]);
        fs[b] = s1 * x->d[b];
        tail += (q41 ? h2f(sc[nb + b]) : -8.0f * s1) * x->s[b];
    }
    const __m512i m0f = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    b = 0;
    for (; b + 4 <= nb; b += 4) { /* two pairs of blocks, two accumulators */
        pf_step(pf);
        for (int h = 0; h < 2; h++) {
            const int bp = b + 2 * h;
            const __m256i y = _mm256_loadu_si256((const __m256i *)(codes + 16 * bp));
            __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(y), _mm256_srli_epi16(y, 4), 1);
            z = _mm512_and_si512(_mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0)), m0f);
            const __m512i p = _mm512_dpbusd_epi32(zero, z, _mm512_loadu_si512((const void *)(x->q + 32 * bp)));
            const __m512 sv = _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castps_si512(_mm512_set1_ps(fs[bp])),
                                                                     _mm256_castps_si256(_mm256_set1_ps(fs[bp + 1])), 1)); /* AVX-512F only */
            if (h == 0)
                acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sv, acc0);
            else
                acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sv, acc1);
        }
    }
    float rest = 0.0f;
    for (; b < nb; b++) { /* the last one to three blocks */
        const uint8_t *c = codes + 16 * b;
        const int8_t *xq = x->q + 32 * b;
        int32_t sum = 0;
        for (int i = 0; i < 16; i++) sum += (c[i] & 0xF) * xq[i] + (c[i] >> 4) * xq[i + 16];
        rest += fs[b] * (float)sum;
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) + _mm512_reduce_add_ps(corr) + tail + rest;
}
#endif

#endif
