/* The sparse FFN of the native decoder: per token, only the chosen neurons' gate and up rows, and
 * in decode with few neurons active only their rows of a neuron-major down projection.
 *
 * Runs in: the process that loads decoder.c (included by it, after matmul and gather; one
 * translation unit): the in-process executor's coordinator and each rank of the native pool.
 *
 * A sparse layer's rule (pi_sparse, model.h) picks, per token, the neurons it computes:
 *   PI_SP_GATE    |act(gate)| > thr: the gate is computed for every neuron (one dense matmul),
 *                 up only for the chosen ones (PowerInfer's and CATS' gate rule);
 *   PI_SP_MASK    the predictor's logit > 0 (fc1, relu, fc2 in 8 bits through the same dot
 *                 products as the weights): gate and up only for the chosen ones;
 *   PI_SP_ORACLE  |act(gate) * up| > thr: the true active set (every row computed; tests, quality);
 *   PI_SP_ALL     every neuron (the rule's arithmetic without skipping anything).
 * A chosen neuron's act(gate) * up is the dense decoder's value up to float rounding (the same
 * codes on the same 8-bit activations); the others' are zero.
 *
 * Decode (up to PI_SPARSE_T tokens a call) reads only the chosen rows: in qsplit.h's layout on
 * AVX-512 (the row's scales first, two blocks per instruction), else four rows at a time from the
 * file's rows (dotr4), asking for rows two quads ahead (a line at a time between the split rows'
 * blocks: qsplit.h's pi_pf); the hot neurons (calibrated to fire
 * often: sparse_layers.py's HOT_FREQ) all of them every step, from a copy of their rows through
 * the dense kernel, kept where the rule chose them. Its down projection sums the active
 * neurons' rows of down_t (neuron-major; Q4_0 for a 4-bit file, else Q8_0: sparse_down.h) when at most PI_DT_MAX of them are active, else
 * runs the dense kernel on the mostly-zero hidden state. Prefill computes gate and up densely
 * through the tiled kernels (on the eight-row repacks, as dense layers do), applies the same rule
 * in place in one pass and runs the dense down projection: dense prefill's work and no more, but
 * for the predictor's: so a predictor-mode batch of at least dense_from tokens (a long prompt's)
 * skips the predictor and runs dense (decoder.c's ffn_forward).
 *
 * What decided this, measured on this CPU (AVX-512 VNNI, 2 cores, the 1.1B-shaped file;
 * docs/sparsity.md): the dense eight-row kernel streams a matrix at ~79 GB/s, while scattered
 * rows of 1-2 KiB arrive at ~16-20 GB/s whatever the kernel (more prefetch distance, huge pages,
 * four-row kernels all left it there; on a Zen 4 prefetching into L2 moved them: prefetch_row_bytes),
 * so a chosen row costs about four streamed ones: skipping
 * pays in proportion to what is left out only below ~25% active, and the sparse down below ~12%.
 * Groups of eight rows in hot-first order were tried and dropped: skipping every other 9 KiB
 * group cost as much as reading them all (the hardware prefetchers fetch across such gaps).
 */
#ifndef PI_SPARSE_ROWS_H
#define PI_SPARSE_ROWS_H

enum { PI_SP_ALL = 0, PI_SP_GATE = 1, PI_SP_MASK = 2, PI_SP_ORACLE = 3 };
#define PI_SPARSE_T 4
#define PI_QUADS_AHEAD 2 /* quads of rows asked for ahead of the one computed (1 and 4 measured the same on a Zen 4) */

/* g[i] = act(g[i]) for n values (act_mul's arithmetic with u = 1; dReLU's up is rectified where
 * it multiplies). */
static void act_only(float *g, int n, int act, float thr) {
    static const float ones[256] = {[0 ... 255] = 1.0f};
    for (int c = 0; c < n; c += 256) act_mul(g + c, ones, n - c < 256 ? n - c : 256, act, thr);
}

/* A scattered row asked for ahead into L2 (prefetcht1), not L1: on a Zen 4 (2 threads, loads only:
 * scripts/membench/gather.c's L2 switch) 1-2 KiB rows arrived at 14-20 GB/s against 9-16 with
 * prefetcht0, whose requests queue on L1's few miss buffers; the sparse down phase took 0.69x. */
static inline void prefetch_row_bytes(const uint8_t *p, int64_t n) {
    for (int64_t o = 0; o < n; o += 64) __builtin_prefetch(p + o, 0, 2);
}

/* logits [T, n] of the layer's predictor into s->mask (1: compute the neuron). Its input is xn
 * [T, d] (normed, quantized by the caller) or, for a predictor that reads the residual stream,
 * x [T, d] (quantized here; the caller quantizes xn again afterwards). A linear predictor
 * (P->linear: a low-rank one folded, sparse_layers.py's predictor_q8) has no relu. */
static void predict_mask(const pi_model *m, const pi_pred *P, const float *x, int T, const pi_scratch *s) {
    const int r = P->fc1.rows, n = m->n_ff, nch = (n + 255) / 256;
    if (P->residual) quantize_rows(s, x, T, m->d);
    matmul(&P->fc1, s, P->residual ? x : s->xn, T, s->u, r);
#pragma omp barrier
#ifdef PI_VNNI
    uint8_t *aq = (uint8_t *)s->idx; /* pred_sign.h's codes [T, sg_k] in idx [T, n] (free until the rows are listed) */
#endif
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++) {
        for (int i = 0; i < r; i++) {
            const float v = s->u[(size_t)t * r + i] + P->b1[i];
            s->u[(size_t)t * r + i] = v > 0.0f || P->linear ? v : 0.0f;
        }
#ifdef PI_VNNI
        if (P->sg) s->ha[t] = sign_quant(s->u + (size_t)t * r, P->sg_k, aq + (size_t)t * P->sg_k); /* its scale: ha is free */
#endif
    }
#ifdef PI_VNNI
    if (P->sg) { /* fc2 by sign (pred_sign.h), 16 neurons a group, the mask written from registers */
        const int ng = (n + 15) / 16;
        const int64_t gb = 32 + 16 * (int64_t)P->sg_k; /* a group's bytes: 16 f16 scales, 16 rows x sg_k codes */
#pragma omp for schedule(static)
        for (int g = 0; g < ng; g++)
            for (int t = 0; t < T; t++)
                sign_mask_group(P->sg + g * gb, P->sg_k, aq + (size_t)t * P->sg_k, s->ha[t], P->b2 + 16 * g, s->mask + (size_t)t * n + 16 * g,
                                n - 16 * g < 16 ? n - 16 * g : 16);
        return; /* the loop's barrier: every thread's share is done */
    }
#endif
    quantize_rows(s, s->u, T, r);
    matmul(&P->fc2, s, s->u, T, s->ha, n); /* ha is free until the rows are computed */
#pragma omp barrier
#pragma omp for schedule(static)
    for (int i = 0; i < T * nch; i++) { /* chunks of 256 (no division per neuron: it vectorizes) */
        const int t = i / nch, c = (i % nch) * 256, c1 = c + 256 < n ? c + 256 : n;
        uint8_t *mt = s->mask + (size_t)t * n;
        const float *ht = s->ha + (size_t)t * n;
        for (int j = c; j < c1; j++) mt[j] = ht[j] + P->b2[j] > 0.0f;
    }
}

/* it[k...] = the neurons j < n that mt chose and is_hot does not mark, in order; returns the list's
 * new length. A decode step's one token lists on one thread, so this runs 64 neurons a step
 * (AVX-512), else branch-free. Nothing is written past it[n] (the next token's list). */
static int list_cold_chosen(const uint8_t *mt, const uint8_t *is_hot, int n, int32_t *it, int k) {
    int j = 0;
#ifdef PI_VNNI
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; j + 64 <= n; j += 64) {
        const __m512i cm = _mm512_loadu_si512((const void *)(mt + j)), hm = _mm512_loadu_si512((const void *)(is_hot + j));
        const __mmask64 sel = _mm512_test_epi8_mask(cm, cm) & _mm512_testn_epi8_mask(hm, hm);
        for (int q = 0; sel && q < 4; q++) {
            const __mmask16 s16 = (__mmask16)(sel >> (16 * q));
            if (!s16) continue;
            const __m512i js = _mm512_add_epi32(iota, _mm512_set1_epi32(j + 16 * q));
            if (k + 16 <= n) /* compress in a register, then a plain store (a compressing store to memory is slow on Zen 4) */
                _mm512_storeu_si512((void *)(it + k), _mm512_maskz_compress_epi32(s16, js));
            else /* the list's last lanes: nothing written past it[n] */
                _mm512_mask_compressstoreu_epi32((void *)(it + k), s16, js);
            k += __builtin_popcount((unsigned)s16);
        }
    }
#endif
    for (; j < n && k < n; j++) { /* k = n: every neuron listed already */
        it[k] = j;
        k += mt[j] && !is_hot[j];
    }
    return k;
}

/* Token t's chosen rows j[0..nr) (nr <= 4) of w dotted with its activations into out. */
static void dot_quad(const pi_wt *w, dotr_fn quad, dot_fn one, const int32_t *j, int nr, const pi_act *a, int K, float *out) {
    const uint8_t *rows[4];
    for (int r = 0; r < 4; r++) rows[r] = w->data + (size_t)j[r < nr ? r : nr - 1] * w->row_bytes; /* a short quad repeats its last row */
    if (quad) {
        quad(rows, a, K, out);
    } else {
        for (int r = 0; r < nr; r++) out[r] = one(rows[r], a, K);
    }
}

/* Measurement (S->quality, decode in mask mode): every neuron's act(gate) * up once more with the
 * dense kernels, into ha and u (free until the down projection), against the predictor's mask. */
static void quality_counts(const pi_model *m, const pi_layer *L, int T, const pi_scratch *s) {
    const int n = m->n_ff;
    matmul(&L->wg, s, s->xn, T, s->ha, n);
    if (!m->gateless) matmul(&L->wu, s, s->xn, T, s->u, n);
#pragma omp barrier
#pragma omp single
    {
        int64_t c[3] = {0, 0, 0};
        for (int t = 0; t < T; t++) {
            float *g = s->ha + (size_t)t * n;
            add_vec(g, L->bg, n);
            act_only(g, n, m->act, m->act_thr);
            for (int j = 0; j < n; j++) {
                const float h = g[j] * (m->gateless ? 1.0f : up_act(s->u[(size_t)t * n + j], m->act));
                const int fired = fabsf(h) > L->sp->thr, chosen = s->mask[(size_t)t * n + j] != 0;
                c[0] += fired && chosen;
                c[1] += fired && !chosen;
                c[2] += !fired && chosen;
            }
        }
        for (int i = 0; i < 3; i++) L->sp->quality[i] += c[i];
    }
}

/* The sparse FFN hidden state into g [T, nffA] at this rank's neurons [n0, n0 + n_ff): zero but
 * for the chosen neurons. xn [T, d] is normed and quantized, x [T, d] the residual stream it was
 * normed from (a residual predictor's input); the caller gathers g afterwards. */
static void sparse_hidden(const pi_model *m, const pi_layer *L, const float *x, int T, const pi_scratch *s, double *last) {
    const pi_sparse *S = L->sp;
    const int n = m->n_ff, nffA = pi_ff_all(m), n0 = m->n0, d = m->d, mode = S->mode, nchunk = (n + 255) / 256;
    const float thr = L->sp->thr;
    const int rows_only = T <= PI_SPARSE_T, dense_gate = !rows_only || mode != PI_SP_MASK;
    int32_t *off = s->cnt, *qo = s->cnt + T + 1, *kept = s->cnt + 2 * T + 2;
    if (mode == PI_SP_MASK) {
        const double t0 = S->pred_s ? omp_get_wtime() : 0.0;
        predict_mask(m, L->pred, x, T, s); /* ends with a barrier: every thread's share is done */
        if (S->pred_s && omp_get_thread_num() == 0) *S->pred_s += omp_get_wtime() - t0;
        quantize_rows(s, s->xn, T, d); /* the predictor's hidden took the activation scratch */
    }
    if (dense_gate) matmul_blocks(&L->wg, s, s->xn, T, s->g + n0, nffA, L->cold_blocks); /* blocks all hot: never chosen */
    if (!rows_only && !m->gateless) matmul_blocks(&L->wu, s, s->xn, T, s->u, n, L->cold_blocks);
#pragma omp barrier
    if (dense_gate) {
#pragma omp for schedule(static)
        for (int i = 0; i < T * nchunk; i++) { /* chunks of 256: a decode step's one token over every thread */
            const int t = i / nchunk, c = (i % nchunk) * 256, len = n - c < 256 ? n - c : 256;
            add_vec(s->g + (size_t)t * nffA + n0 + c, L->bg ? L->bg + c : NULL, len); /* OPT's fc1 bias */
            act_only(s->g + (size_t)t * nffA + n0 + c, len, m->act, m->act_thr);
        }
    }
    if (!rows_only) { /* prefill: every gate and up value is at hand; the rule masks them in place in one pass */
#pragma omp for schedule(static)
        for (int i = 0; i < T * nchunk; i++) {
            const int t = i / nchunk, c = (i % nchunk) * 256, len = n - c < 256 ? n - c : 256;
            float *gt = s->g + (size_t)t * nffA + n0 + c;
            const float *ut = s->u + (size_t)t * n + c;
            const uint8_t *mt = s->mask + (size_t)t * n + c;
            int64_t kk = 0;
            if (mode == PI_SP_GATE && !L->cold && !m->gateless) { /* the common case, branch-free so that it vectorizes */
                for (int j = 0; j < len; j++) {
                    const int keep = fabsf(gt[j]) > thr;
                    gt[j] = keep ? gt[j] * up_act(ut[j], m->act) : 0.0f;
                    kk += keep;
                }
            } else {
                for (int j = 0; j < len; j++) {
                    int keep = (!L->cold || L->cold[c + j]) && (mode == PI_SP_MASK ? mt[j] != 0 : mode == PI_SP_GATE ? fabsf(gt[j]) > thr : 1);
                    float h = keep ? gt[j] * (m->gateless ? 1.0f : up_act(ut[j], m->act)) : 0.0f;
                    if (keep && mode == PI_SP_ORACLE && !(fabsf(h) > thr)) h = 0.0f, keep = 0;
                    gt[j] = h;
                    kk += keep;
                }
            }
            if (m->ffn_active && kk) {
#pragma omp atomic
                m->ffn_active[L - m->layers] += kk;
            }
        }
        mark(m, PH_GATE_UP, last);
        mark(m, PH_ACT, last);
        return;
    }
    /* decode: per token, the neurons computed (idx [T, n]) and their count: the hot ones (all of
     * them, in their rows' order: one streamed read), then the chosen others; mask [T, n] then
     * says which hot ones the rule chose (gate mode writes it here) */
    const int n_hot = (L->cold || (mode != PI_SP_MASK && mode != PI_SP_GATE)) ? 0 : S->n_hot;
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++) {
        const float *gt = s->g + (size_t)t * nffA + n0;
        uint8_t *mt = s->mask + (size_t)t * n;
        int32_t *it = s->idx + (size_t)t * n;
        int k = 0;
        if (n_hot) {
            if (mode == PI_SP_GATE)
                for (int j = 0; j < n; j++) mt[j] = fabsf(gt[j]) > thr;
            memcpy(it, S->hot, sizeof(int32_t) * (size_t)n_hot);
            k = list_cold_chosen(mt, S->is_hot, n, it, n_hot);
        } else {
            for (int j = 0; j < n; j++) /* L->cold: the GPU rank's hot neurons are never chosen here */
                if ((!L->cold || L->cold[j]) && (mode == PI_SP_MASK ? mt[j] != 0 : mode == PI_SP_GATE ? fabsf(gt[j]) > thr : 1)) it[k++] = j;
        }
        off[t + 1] = k;
    }
#pragma omp single
    {
        off[0] = qo[0] = 0;
        for (int t = 0; t < T; t++) {
            qo[t + 1] = qo[t] + (off[t + 1] - n_hot + 3) / 4; /* the others' quads (n_hot <= every list) */
            off[t + 1] += off[t];
        }
        if (S->computed && rows_only) *S->computed += off[T];
    }
    if (rows_only) {
        if (n_hot) { /* the hot block: every hot row with the dense kernel, one stream; gate into g [T, nffA] at n0 + k (free in mask mode) */
            if (!m->gateless) matmul(&S->hot_up, s, s->xn, T, s->u, n_hot);
            if (!dense_gate) matmul(&S->hot_gate, s, s->xn, T, s->g + n0, nffA);
#pragma omp barrier
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++) {
                float *hu = s->hu + off[t], *ha = s->ha + off[t];
                const float *gt = s->g + (size_t)t * nffA + n0;
                for (int k = 0; k < n_hot; k++) {
                    const int j = S->hot[k];
                    hu[k] = m->gateless ? 1.0f : s->u[(size_t)t * n_hot + k];
                    ha[k] = dense_gate ? gt[j] : gt[k] + (L->bg ? L->bg[j] : 0.0f);
                }
            }
        }
        /* the others: quad q is token t's list entries n_hot + [4 (q - qo[t]), +4); values packed at ha/hu[off[t] + ...] */
        const int quads = qo[T];
        int align;
        const dot_fn udot = dot_for(L->wu.type, &align), gdot = dot_for(L->wg.type, &align);
        const dotr_fn ur = dotr4_for(L->wu.type), gr = dotr4_for(L->wg.type);
        /* split rows' strides: a bundle's gate and up rows of a neuron sit together (one read) */
        const int64_t us = S->up_split && S->split_stride ? S->split_stride : L->wu.row_bytes;
        const int64_t gs = S->gate_split && S->split_stride ? S->split_stride : L->wg.row_bytes;
#pragma omp for schedule(static)
        for (int q = 0; q < quads; q++) {
            int t = 0;
            while (qo[t + 1] <= q) t++;
            const int k0 = n_hot + 4 * (q - qo[t]), kt = off[t + 1] - off[t], nr = kt - k0 < 4 ? kt - k0 : 4;
            const int32_t *it = s->idx + (size_t)t * n + k0;
            pi_pf pf = {.k = 0, .i = 0, .o = 0};
            if (q + PI_QUADS_AHEAD < quads) { /* the rows PI_QUADS_AHEAD quads on */
                const int q2 = q + PI_QUADS_AHEAD;
                int t2 = t;
                while (qo[t2 + 1] <= q2) t2++;
                const int k2 = n_hot + 4 * (q2 - qo[t2]), left = off[t2 + 1] - off[t2] - k2;
                for (int r = 0; r < (left < 4 ? left : 4); r++) {
                    const int j2 = s->idx[(size_t)t2 * n + k2 + r];
                    if (!m->gateless) {
                        pf.p[pf.k] = (S->up_split ? S->up_split : L->wu.data) + (size_t)j2 * us;
                        pf.n[pf.k++] = L->wu.row_bytes;
                    }
                    if (!dense_gate) {
                        pf.p[pf.k] = (S->gate_split ? S->gate_split : L->wg.data) + (size_t)j2 * gs;
                        pf.n[pf.k++] = L->wg.row_bytes;
                    }
                }
                if (!(S->up_split || S->gate_split)) pf_rest(&pf); /* the file's rows (no split copy): asked for at once */
            }
            const pi_act a = act_row(s, s->xn, t, d);
            float uo[4] = {1.0f, 1.0f, 1.0f, 1.0f}, go[4]; /* OPT (gateless): no up rows, up = 1 */
            if (!m->gateless) {
#ifdef PI_VNNI
                if (S->up_split)
                    for (int r = 0; r < nr; r++) uo[r] = split_dot(S->up_split + (size_t)it[r] * us, L->wu.type, &a, d, &pf);
                else
#endif
                    dot_quad(&L->wu, ur, udot, it, nr, &a, d, uo);
            }
            if (!dense_gate) {
#ifdef PI_VNNI
                if (S->gate_split)
                    for (int r = 0; r < nr; r++) go[r] = split_dot(S->gate_split + (size_t)it[r] * gs, L->wg.type, &a, d, &pf);
                else
#endif
                    dot_quad(&L->wg, gr, gdot, it, nr, &a, d, go);
            }
            pf_rest(&pf); /* what the dot products did not ask for yet */
            float *hu = s->hu + off[t] + k0, *ha = s->ha + off[t] + k0;
            for (int r = 0; r < nr; r++) {
                hu[r] = uo[r];
                ha[r] = dense_gate ? s->g[(size_t)t * nffA + n0 + it[r]] : go[r] + (L->bg ? L->bg[it[r]] : 0.0f);
            }
        }
        if (!dense_gate) { /* act over the packed gate values, in the threads' shares */
#pragma omp for schedule(static)
            for (int c = 0; c < off[T]; c += 256) act_only(s->ha + c, off[T] - c < 256 ? off[T] - c : 256, m->act, m->act_thr);
        }
    }
    mark(m, PH_GATE_UP, last);
    /* the rows of g become the hidden state: zeroed in chunks (and the counts), then act(gate) * up
     * of every listed neuron (packed at ha/hu[off[t] ...]) written to its place if chosen, the
     * tokens' lists one range split over the threads (a decode step's one list on every thread) */
#pragma omp for schedule(static)
    for (int i = 0; i < T * nchunk; i++) {
        const int t = i / nchunk, c = (i % nchunk) * 256;
        memset(s->g + (size_t)t * nffA + n0 + c, 0, sizeof(float) * (size_t)(n - c < 256 ? n - c : 256));
        if (!c) kept[t] = 0;
    }
    {
        const int nth = omp_get_num_threads(), th = omp_get_thread_num();
        const int i0 = (int)((int64_t)off[T] * th / nth), i1 = (int)((int64_t)off[T] * (th + 1) / nth);
        int t = 0, kk = 0;
        while (off[t + 1] <= i0 && t + 1 < T) t++;
        for (int i = i0; i < i1; i++) {
            for (; off[t + 1] <= i; t++, kk = 0) { /* token t's entries end here */
#pragma omp atomic
                kept[t] += kk;
            }
            const int q = i - off[t], j = s->idx[(size_t)t * n + q];
            const float h = s->ha[i] * (m->gateless ? 1.0f : up_act(s->hu[i], m->act));
            if ((q >= n_hot || s->mask[(size_t)t * n + j]) && (mode != PI_SP_ORACLE || fabsf(h) > thr)) { /* a hot neuron only if chosen */
                s->g[(size_t)t * nffA + n0 + j] = h;
                kk++;
            }
        }
        if (kk) {
#pragma omp atomic
            kept[t] += kk;
        }
    }
#pragma omp barrier
    if (m->ffn_active) {
#pragma omp single
        for (int t = 0; t < T; t++) m->ffn_active[L - m->layers] += kept[t];
    }
    if (S->quality && mode == PI_SP_MASK) quality_counts(m, L, T, s);
    mark(m, PH_ACT, last);
}

#endif
