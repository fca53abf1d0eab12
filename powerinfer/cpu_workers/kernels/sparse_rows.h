/* The sparse FFN of the native decoder: per token, only the chosen neurons' gate and up rows.
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
 * A chosen neuron's act(gate) * up is the dense decoder's value (the same row dot on the same 8-bit
 * activations, up to the order of float additions in the tiled kernels); the others' are zero.
 * The down projection is then the dense one over that hidden state [T, n_ff].
 *
 * What was measured on this CPU (AVX-512 VNNI, 2 cores, the 1.1B-shaped file, docs/sparsity.md):
 * the dense eight-row kernel streams a matrix at ~79 GB/s, a row dotted on its own at ~20-30 GB/s
 * (instruction-bound: one row's block is ~13 instructions, eight rows' ~3 each), so the chosen
 * rows pay off only well below a third of a matrix. Groups of eight rows in hot-first order were
 * tried and dropped: skipping every other 9 KiB group cost as much as reading them all (the
 * hardware prefetchers fetch across such gaps). A neuron-major sparse down projection loses to
 * the dense one at ~15% active (the file's per-32-neuron scales must all be applied).
 *
 * Up to PI_SPARSE_T tokens a call (decode, batched decode) reads only the chosen rows, four at a
 * time (dotr4: one token against four rows, independent accumulators), straight from the file's
 * rows, asking for the rows two quads ahead; longer calls (prefill) compute gate and up densely
 * through the tiled kernels and apply the same rule.
 */
#ifndef PI_SPARSE_ROWS_H
#define PI_SPARSE_ROWS_H

enum { PI_SP_ALL = 0, PI_SP_GATE = 1, PI_SP_MASK = 2, PI_SP_ORACLE = 3 };
#define PI_SPARSE_T 4
#define PI_QUADS_AHEAD 2 /* quads of rows asked for ahead of the one computed */

/* g[i] = act(g[i]) for n values (act_mul's arithmetic with u = 1). */
static void act_only(float *g, int n, int act) {
    static const float ones[256] = {[0 ... 255] = 1.0f};
    for (int c = 0; c < n; c += 256) act_mul(g + c, ones, n - c < 256 ? n - c : 256, act);
}

static inline void prefetch_row_bytes(const uint8_t *p, int64_t n) {
    for (int64_t o = 0; o < n; o += 64) __builtin_prefetch(p + o);
}

/* logits [T, n] of the layer's predictor into s->mask (1: compute the neuron). */
static void predict_mask(const pi_model *m, const pi_pred *P, int T, const pi_scratch *s) {
    const int r = P->fc1.rows, n = m->n_ff;
    matmul(&P->fc1, s, s->xn, T, s->u, r);
#pragma omp barrier
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++)
        for (int i = 0; i < r; i++) {
            const float v = s->u[(size_t)t * r + i] + P->b1[i];
            s->u[(size_t)t * r + i] = v > 0.0f ? v : 0.0f;
        }
    quantize_rows(s, s->u, T, r);
    matmul(&P->fc2, s, s->u, T, s->ha, n); /* ha is free until the rows are computed */
#pragma omp barrier
#pragma omp for schedule(static)
    for (int i = 0; i < T * n; i++) s->mask[i] = s->ha[i] + P->b2[i % n] > 0.0f;
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

/* The sparse FFN hidden state into g [T, nffA] at this rank's neurons [n0, n0 + n_ff): zero but
 * for the chosen neurons. xn [T, d] is normed and quantized; the caller gathers g afterwards. */
static void sparse_hidden(const pi_model *m, const pi_layer *L, int T, const pi_scratch *s, double *last) {
    const int n = m->n_ff, nffA = pi_ff_all(m), n0 = m->n0, d = m->d, mode = L->sp->mode, nchunk = (n + 255) / 256;
    const float thr = L->sp->thr;
    const int rows_only = T <= PI_SPARSE_T, dense_gate = !rows_only || mode != PI_SP_MASK;
    int32_t *off = s->cnt, *qo = s->cnt + T + 1, *kept = s->cnt + 2 * T + 2;
    if (mode == PI_SP_MASK) {
        predict_mask(m, L->pred, T, s);
        quantize_rows(s, s->xn, T, d); /* the predictor's hidden took the activation scratch */
    }
    if (dense_gate) matmul(&L->wg, s, s->xn, T, s->g + n0, nffA);
    if (!rows_only) matmul(&L->wu, s, s->xn, T, s->u, n);
#pragma omp barrier
    if (dense_gate) {
#pragma omp for schedule(static)
        for (int i = 0; i < T * nchunk; i++) { /* chunks of 256: a decode step's one token over every thread */
            const int t = i / nchunk, c = (i % nchunk) * 256;
            act_only(s->g + (size_t)t * nffA + n0 + c, n - c < 256 ? n - c : 256, m->act);
        }
    }
    /* per token, the chosen neurons' list (idx [T, n]) and its length */
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++) {
        const float *gt = s->g + (size_t)t * nffA + n0;
        const uint8_t *mt = s->mask + (size_t)t * n;
        int32_t *it = s->idx + (size_t)t * n;
        int k = 0;
        for (int j = 0; j < n; j++)
            if (mode == PI_SP_MASK ? mt[j] != 0 : mode == PI_SP_GATE ? fabsf(gt[j]) > thr : 1) it[k++] = j;
        off[t + 1] = k;
    }
#pragma omp single
    {
        off[0] = qo[0] = 0;
        for (int t = 0; t < T; t++) {
            qo[t + 1] = qo[t] + (off[t + 1] + 3) / 4;
            off[t + 1] += off[t];
        }
    }
    if (rows_only) {
        /* quad q is token t's chosen neurons [4 (q - qo[t]), +4); values packed at ha/hu[off[t] + ...] */
        const int quads = qo[T];
        int align;
        const dot_fn udot = dot_for(L->wu.type, &align), gdot = dot_for(L->wg.type, &align);
        const dotr_fn ur = dotr4_for(L->wu.type), gr = dotr4_for(L->wg.type);
#pragma omp for schedule(static)
        for (int q = 0; q < quads; q++) {
            int t = 0;
            while (qo[t + 1] <= q) t++;
            const int k0 = 4 * (q - qo[t]), kt = off[t + 1] - off[t], nr = kt - k0 < 4 ? kt - k0 : 4;
            const int32_t *it = s->idx + (size_t)t * n + k0;
            if (q + PI_QUADS_AHEAD < quads) { /* the rows PI_QUADS_AHEAD quads on */
                const int q2 = q + PI_QUADS_AHEAD;
                int t2 = t;
                while (qo[t2 + 1] <= q2) t2++;
                const int k2 = 4 * (q2 - qo[t2]), left = off[t2 + 1] - off[t2] - k2;
                for (int r = 0; r < (left < 4 ? left : 4); r++) {
                    const int j2 = s->idx[(size_t)t2 * n + k2 + r];
                    prefetch_row_bytes(L->wu.data + (size_t)j2 * L->wu.row_bytes, L->wu.row_bytes);
                    if (!dense_gate) prefetch_row_bytes(L->wg.data + (size_t)j2 * L->wg.row_bytes, L->wg.row_bytes);
                }
            }
            const pi_act a = act_row(s, s->xn, t, d);
            float uo[4], go[4];
            dot_quad(&L->wu, ur, udot, it, nr, &a, d, uo);
            if (!dense_gate) dot_quad(&L->wg, gr, gdot, it, nr, &a, d, go);
            float *hu = s->hu + off[t] + k0, *ha = s->ha + off[t] + k0;
            for (int r = 0; r < nr; r++) {
                hu[r] = uo[r];
                ha[r] = dense_gate ? s->g[(size_t)t * nffA + n0 + it[r]] : go[r];
            }
        }
        if (!dense_gate) { /* act over the packed gate values, in the threads' shares */
#pragma omp for schedule(static)
            for (int c = 0; c < off[T]; c += 256) act_only(s->ha + c, off[T] - c < 256 ? off[T] - c : 256, m->act);
        }
    }
    mark(m, PH_GATE_UP, last);
    /* per token: act(gate) * up of the chosen neurons, packed at ha[off[t] ...] */
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++) {
        const int32_t *it = s->idx + (size_t)t * n;
        const int a0 = off[t], k = off[t + 1] - a0;
        float *h = s->ha + a0;
        for (int q = 0; q < k; q++)
            h[q] = (rows_only ? h[q] : s->g[(size_t)t * nffA + n0 + it[q]]) * (rows_only ? s->hu[a0 + q] : s->u[(size_t)t * n + it[q]]);
    }
    /* the rows of g become the hidden state: zeroed in chunks, then each token's chosen neurons */
#pragma omp for schedule(static)
    for (int i = 0; i < T * nchunk; i++) {
        const int t = i / nchunk, c = (i % nchunk) * 256;
        memset(s->g + (size_t)t * nffA + n0 + c, 0, sizeof(float) * (size_t)(n - c < 256 ? n - c : 256));
    }
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++) {
        float *gt = s->g + (size_t)t * nffA + n0;
        const int32_t *it = s->idx + (size_t)t * n;
        const float *h = s->ha + off[t];
        int kk = 0;
        for (int q = 0; q < off[t + 1] - off[t]; q++)
            if (mode != PI_SP_ORACLE || fabsf(h[q]) > thr) {
                gt[it[q]] = h[q];
                kk++;
            }
        kept[t] = kk;
    }
    if (m->ffn_active) {
#pragma omp single
        for (int t = 0; t < T; t++) m->ffn_active[L - m->layers] += kept[t];
    }
    mark(m, PH_ACT, last);
}

#endif
