/* Native decoder: a whole forward pass (every layer, the final norm) in one call, and the output
 * head; weights are read in place from the memory-mapped GGUF file through qdot.h.
 *
 * Runs in: the process of the in-process executor (the coordinator), loaded with ctypes by
 * powerinfer/native/decoder.py (native/decoder_lib.py compiles this file once per machine and ISA), and by each worker of the native pool.
 *
 * One OpenMP parallel region per call; inside it each operation is a work-shared loop (rows of a
 * matrix, tokens, or (token, head) pairs) and the implicit barrier between loops is the only
 * synchronisation, so Python is entered once per step instead of ~40 times per layer.
 * Per layer (T tokens; x [T, d] is the residual stream, updated in place):
 *   xn = rmsnorm(x) * attn_norm (OPT: LayerNorm, + bias), quantized to 8 bits
 *   q, k, v = xn @ Wq.T, Wk.T, Wv.T (+ biases)          [T, Hq*D], [T, Hkv*D], [T, Hkv*Dv]
 *   per head: rmsnorm * q_norm / k_norm (Gemma), rope (adjacent pairs or NEOX halves)
 *   k, v -> cache[slot, head, pos]; each query attends over its slot's positions lo..pos
 *   x += post_norm(att @ Wo.T (+ bo));  xn = rmsnorm(x) * ffn_norm
 *   x += post_norm((act(xn @ Wg.T) * up_act(xn @ Wu.T)) @ Wd.T)     (act.h: SiLU, GELU, (FAT)ReLU, dReLU)
 *   OPT (gateless): x += act(xn @ Wg.T + bg) @ Wd.T + bd, its fc1 in Wg; no rope (learned positions, step.h)
 * Tokens are either one prompt chunk (one slot, consecutive positions) or one token of each of
 * T sequences (distinct slots): every token's k, v is written before any token attends. A
 * token's numbers never depend on the others in the call (per-row arithmetic throughout).
 */
#include "model.h"
#include "qtraits.h" /* every type's kernels (qdot.h, qdot_k.h, qtile.h) in one table */
#include "vecmath.h"
#include "norms.h"
#include "attend.h"
#include "qtile.h"
#include "qx8.h"
#include "qsplit.h"
#include "dequant.h"
#include "comm.h"
#include "handoff.h"

/* Rows [ra, rb) from the file's layout: groups of eight, then four tokens through the type's
 * several-token kernels (qtile.h), so the rows stay in L1 while the groups pass; then one token
 * at a time. */
static void rows_plain(const pi_wt *w, const pi_scratch *s, const float *f, int T, float *y, int ldy, int ra, int rb) {
    int align;
    dot_fn dot = dot_for(w->type, &align);
    const int K = w->cols;
    int t0 = 0;
    for (int n = 8; n >= 4; n -= 4) {
        dotn_fn dotn = dotn_for(w->type, n);
        for (; dotn && t0 + n <= T; t0 += n) {
            pi_act a[8];
            for (int i = 0; i < n; i++) a[i] = act_row(s, f, t0 + i, K);
            for (int r = ra; r < rb; r++) {
                float out[8];
                dotn(w->data + (size_t)r * w->row_bytes, a, K, out);
                for (int i = 0; i < n; i++) y[(size_t)(t0 + i) * ldy + r] = out[i];
            }
        }
    }
    for (int r = ra; r < rb; r++) {
        const uint8_t *row = w->data + (size_t)r * w->row_bytes;
        for (int t = t0; t < T; t++) {
            pi_act a = act_row(s, f, t, K);
            y[(size_t)t * ldy + r] = dot(row, &a, K);
        }
    }
}

/* y[t, r] (row stride ldy) = W[r] . x_t for rows r of W, work-shared in blocks of 16 rows, but
 * for the blocks b with blocks[b] == 0 (blocks NULL: every block; a skipped block's y is left as
 * it was); nowait: the caller places the barrier. Repacked groups of eight rows go through qx8.h.
 * Guided: the two halves of a static split of a streamed matrix finished ~5-10% apart (the
 * cores' share of the bandwidth differs), the faster thread now takes more blocks at the end
 * (in process, q/k/v phase 0.90-0.94x, step 0.97-0.99x; a row's numbers do not depend on who computes it). */
static void matmul_blocks(const pi_wt *w, const pi_scratch *s, const float *f, int T, float *y, int ldy, const uint8_t *blocks) {
#ifdef PI_SIMD
    const int K = w->cols, x8_rows = w->x8 ? w->rows / 8 * 8 : 0;
#endif
#pragma omp for schedule(guided, 2) nowait
    for (int r0 = 0; r0 < w->rows; r0 += 16) {
        if (blocks && !blocks[r0 / 16]) continue;
        const int r1 = r0 + 16 < w->rows ? r0 + 16 : w->rows;
        int r = r0;
#ifdef PI_SIMD
        const size_t group = (size_t)(K / 32) * PI_X8_BYTES(w->type);
        for (; r + 8 <= r1 && r + 8 <= x8_rows; r += 8)
            for (int t0 = 0; t0 < T; t0 += PI_X8_TOKENS) {
                pi_act a[PI_X8_TOKENS];
                const int nt = T - t0 < PI_X8_TOKENS ? T - t0 : PI_X8_TOKENS;
                for (int i = 0; i < nt; i++) a[i] = act_row(s, f, t0 + i, K);
                x8_dot(w->x8 + (size_t)(r / 8) * group, w->type, a, nt, K, y + (size_t)t0 * ldy + r, ldy);
            }
#endif
        if (r < r1) rows_plain(w, s, f, T, y, ldy, r, r1);
    }
}

static void matmul(const pi_wt *w, const pi_scratch *s, const float *f, int T, float *y, int ldy) { matmul_blocks(w, s, f, T, y, ldy, NULL); }

static void rope(float *h, const float *c, const float *sn, int rope_dim, int neox) {
    const int half = rope_dim / 2;
    for (int i = 0; i < half; i++) {
        const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
        const float x0 = h[a], x1 = h[b];
        h[a] = x0 * c[i] - x1 * sn[i];
        h[b] = x0 * sn[i] + x1 * c[i];
    }
}

static void add_post(float *x, float *h, const float *post, int n, float eps) {
    if (post) rmsnorm(h, post, n, eps, h);
    for (int i = 0; i < n; i++) x[i] += h[i];
}

/* A rank: columns [c0, c1) of x [T, ld] are this rank's; afterwards x holds every rank's (comm.h).
 * All threads arrive here after a barrier; one of them syncs, the others wait at the single's end.
 * In process (comm NULL): nothing to do. */
static void gather(const pi_model *m, float *x, int T, int ld, int c0, int c1) {
    if (!m->comm) return;
#pragma omp barrier
#pragma omp single
    pi_allgather((pi_comm *)m->comm, x, T, ld, c0, c1);
}

#include "pred_sign.h"
#include "sparse_rows.h"
#include "sparse_down.h"

/* Layer li's attention on the GPU rank (neuron split): xn [T, d] (normed) handed over, the output
 * projection [T, d] it answers copied into s->tmp by every rank, then a barrier merge (nothing
 * gathered) so that no rank still reads the area when rank 0 posts the FFN's input (handoff.h). */
static void gpu_attention(const pi_model *m, const pi_scratch *s, int T, int li) {
    pi_comm *c = (pi_comm *)m->comm;
#pragma omp single
    {
        const float *a = pi_gpu_post(c, PI_GPU_ATTN, s->xn, T, m->d, li, li + 1) ? NULL : pi_gpu_wait(c);
        if (a) memcpy(s->tmp, a, sizeof(float) * (size_t)T * m->d);
        pi_allgather(c, s->tmp, T, m->d, 0, 0);
    }
}

/* The attention of layer L on this rank's heads: xn [T, d] normed in, the output projection
 * [T, d] (every rank's rows, gathered) into s->tmp. */
static void attention_cpu(const pi_model *m, const pi_layer *L, const int64_t *pos, const int64_t *slot, int T, const pi_scratch *s,
                          double *last) {
    const int d = m->d, D = m->D, Dv = m->Dv, Hq = m->n_head, Hkv = m->n_kv;
    quantize_rows(s, s->xn, T, d);
    mark(m, PH_NORM, last);
    matmul(&L->wq, s, s->xn, T, s->q, Hq * D);
    matmul(&L->wk, s, s->xn, T, s->k, Hkv * D);
    matmul(&L->wv, s, s->xn, T, s->v, Hkv * Dv);
#pragma omp barrier
    mark(m, PH_QKV, last);
    /* per (token, head): bias, q/k norm, rope; k and v into the cache */
#pragma omp for schedule(static)
    for (int i = 0; i < T * (Hq + Hkv); i++) {
        const int t = i / (Hq + Hkv), h = i % (Hq + Hkv), is_k = h >= Hq, hh = is_k ? h - Hq : h;
        float *row = is_k ? s->k + ((size_t)t * Hkv + hh) * D : s->q + ((size_t)t * Hq + hh) * D;
        const float *bias = is_k ? L->bk : L->bq;
        if (bias)
            for (int j = 0; j < D; j++) row[j] += bias[(size_t)hh * D + j];
        const float *nw = is_k ? L->k_norm : L->q_norm;
        if (nw) rmsnorm(row, nw, D, m->eps, row);
        const size_t pr = (size_t)pos[t] * (m->rope_dim / 2);
        if (m->rope_dim) rope(row, L->rope_cos + pr, L->rope_sin + pr, m->rope_dim, m->neox);
        if (is_k) {
            const size_t c = (((size_t)slot[t] * Hkv + hh) * m->n_ctx + (size_t)pos[t]);
            memcpy(L->k_cache + c * D, row, sizeof(float) * D);
            float *vrow = s->v + ((size_t)t * Hkv + hh) * Dv;
            if (L->bv)
                for (int j = 0; j < Dv; j++) vrow[j] += L->bv[(size_t)hh * Dv + j];
            memcpy(L->v_cache + c * Dv, vrow, sizeof(float) * Dv);
        }
    }
    mark(m, PH_ROPE, last);
    /* attention: per (token, kv head) with its query heads together when there is enough such
     * work for the threads (each key and value row is read once for the group), else per
     * (token, query head) so that a decode step's few heads still spread over the threads */
    /* local query head h is global head q0 + h of kv head (q0 + h) / grp, local (q0 + h) / grp - kv0;
     * its output lands in att [T, HqA * Dv] at global column (q0 + h) * Dv */
    const int grp = pi_grp(m), q0 = m->q0, kv0 = m->kv0, attw = pi_heads_all(m) * Dv;
    if (T * Hkv >= 2 * m->n_threads) { /* round-robin: later tokens see more keys */
#pragma omp for schedule(static, 1)
        for (int i = 0; i < T * Hkv; i++) {
            const int t = i / Hkv, kvh = i % Hkv, p = (int)pos[t];
            const int lo = L->window && p - L->window + 1 > 0 ? p - L->window + 1 : 0;
            const size_t base = ((size_t)slot[t] * Hkv + kvh) * m->n_ctx;
            const int ga = (kv0 + kvh) * grp, gb = ga + grp; /* this kv head's query heads, global */
            const int qa = (ga > q0 ? ga : q0) - q0, qb = (gb < q0 + Hq ? gb : q0 + Hq) - q0;
            attend_group(s->q + ((size_t)t * Hq + qa) * D, qb - qa, L->k_cache + base * D, L->v_cache + base * Dv, lo, p, D, Dv,
                         m->attn_scale, s->scores + (size_t)omp_get_thread_num() * grp * m->n_ctx, m->n_ctx,
                         s->att + (size_t)t * attw + (size_t)(q0 + qa) * Dv);
        }
    } else {
#pragma omp for schedule(static, 1)
        for (int i = 0; i < T * Hq; i++) {
            const int t = i / Hq, h = i % Hq, kvh = (q0 + h) / grp - kv0, p = (int)pos[t];
            const int lo = L->window && p - L->window + 1 > 0 ? p - L->window + 1 : 0;
            const size_t base = ((size_t)slot[t] * Hkv + kvh) * m->n_ctx;
            attend_group(s->q + ((size_t)t * Hq + h) * D, 1, L->k_cache + base * D, L->v_cache + base * Dv, lo, p, D, Dv, m->attn_scale,
                         s->scores + (size_t)omp_get_thread_num() * grp * m->n_ctx, m->n_ctx, s->att + (size_t)t * attw + (size_t)(q0 + h) * Dv);
        }
    }
    gather(m, s->att, T, attw, q0 * Dv, (q0 + Hq) * Dv);
    quantize_rows(s, s->att, T, attw);
    mark(m, PH_ATTN, last);
    /* output projection: this rank's rows [d0, d1) of the model dimension */
    const int d0 = m->d0, d1 = m->d0 + L->wo.rows;
    matmul(&L->wo, s, s->att, T, s->tmp + d0, d);
#pragma omp barrier
    gather(m, s->tmp, T, d, d0, d1);
    mark(m, PH_OUT, last);
}

/* The FFN half of layer L: the attention's output in s->tmp [T, d] added to x (after the
 * post-norm), then x += post_norm(down(act(gate) * up)) over this rank's neurons, gathered; a
 * layer with hot neurons on the GPU rank hands them its normed input first and adds their
 * partial before the gather (each rank to its own output rows). */
static void ffn_forward(const pi_model *m, const pi_layer *L, float *x, int T, const pi_scratch *s, double *last) {
    const int d = m->d, nff = m->n_ff;
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++) {
        add_vec(s->tmp + (size_t)t * d, L->bo, d);
        add_post(x + (size_t)t * d, s->tmp + (size_t)t * d, L->post_attn_norm, d, m->eps);
        norm_row(m, x + (size_t)t * d, L->ffn_norm, L->ffn_norm_b, s->xn + (size_t)t * d);
    }
    const int on_gpu = (L->gpu_part & PI_PART_FFN) != 0;
    pi_comm *comm = (pi_comm *)m->comm;
    if (on_gpu) { /* the hot neurons start on the GPU rank while this rank computes the cold ones */
#pragma omp single nowait
        pi_gpu_post(comm, PI_GPU_FFN, s->xn, T, d, (int)(L - m->layers), (int)(L - m->layers) + 1);
    }
    quantize_rows(s, s->xn, T, d);
    mark(m, PH_FFN_NORM, last);
    /* gate into g [T, nffA] at this rank's neurons [n0, n0 + nff); up into u [T, nff] */
    const int nffA = pi_ff_all(m), n0 = m->n0, nchunk = (nff + 255) / 256;
    const int d0 = m->d0, d1 = m->d0 + L->wd.rows;
    /* A predictor-mode prefill batch of at least dense_from tokens runs the layer dense
     * (sparse_layers.py's PREFILL_DENSE_FROM): prefill computes gate and up with the dense kernels
     * anyway, so the predictor and the mask would only add time. */
    const pi_sparse *sp = L->sp && !(L->sp->mode == PI_SP_MASK && T > PI_SPARSE_T && L->sp->dense_from > 0 && T >= L->sp->dense_from)
                              ? L->sp : NULL;
    if (L->sp && !sp && m->ffn_active) {
#pragma omp single nowait
        m->ffn_active[L - m->layers] += (int64_t)T * nff; /* every neuron computed */
    }
    if (sp) {
        sparse_hidden(m, L, x, T, s, last); /* g [T, nffA] at [n0, n0 + nff): zero but for the computed neurons */
    } else {
        matmul_blocks(&L->wg, s, s->xn, T, s->g + n0, nffA, L->cold_blocks); /* blocks all hot: not here */
        if (!m->gateless) matmul_blocks(&L->wu, s, s->xn, T, s->u, nff, L->cold_blocks);
#pragma omp barrier
        mark(m, PH_GATE_UP, last);
#pragma omp for schedule(static)
        for (int i = 0; i < T * nchunk; i++) { /* chunks of 256 within a row: the same lanes whatever the split */
            const int t = i / nchunk, c = (i % nchunk) * 256;
            const int n = c + 256 < nff ? 256 : nff - c;
            float *gt = s->g + (size_t)t * nffA + n0 + c;
            add_vec(gt, L->bg ? L->bg + c : NULL, n);
            if (m->gateless)
                act_only(gt, n, m->act, m->act_thr);
            else
                act_mul(gt, s->u + (size_t)t * nff + c, n, m->act, m->act_thr);
            if (L->cold) /* the GPU rank's hot neurons: their values come as its partial of the down */
                for (int j = 0; j < n; j++)
                    if (!L->cold[c + j]) gt[j] = 0.0f;
        }
    }
    gather(m, s->g, T, nffA, n0, n0 + nff);
    /* decode with few active neurons: only their rows of down_t; else the dense down on g */
    if (!(sp && sp->down_t.data && T <= PI_SPARSE_T && down_sparse(m, sp, T, s, s->tmp + d0, d1 - d0))) {
        const float *h = s->g;
        int K = nffA;
        if (L->down_col0) { /* the hidden state from down_col0 on, packed [T, K] into xn (free since gate and up) */
            K = nffA - L->down_col0;
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++) memcpy(s->xn + (size_t)t * K, s->g + (size_t)t * nffA + L->down_col0, sizeof(float) * K);
            h = s->xn;
        }
        quantize_rows(s, h, T, K);
        mark(m, PH_ACT, last);
        matmul(&L->wd, s, h, T, s->tmp + d0, d);
    }
#pragma omp barrier
    if (on_gpu) { /* the hot neurons' partial, added to this rank's rows before they are gathered */
#pragma omp single
        pi_gpu_wait(comm);
        if (!comm->err) {
            const float *a = pi_gpu_area(comm);
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++)
                for (int o = d0; o < d1; o++) s->tmp[(size_t)t * d + o] += a[(size_t)t * d + o];
        }
    }
    gather(m, s->tmp, T, d, d0, d1);
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++) {
        add_vec(s->tmp + (size_t)t * d, L->bd, d);
        add_post(x + (size_t)t * d, s->tmp + (size_t)t * d, L->post_ffn_norm, d, m->eps);
    }
    mark(m, PH_DOWN, last);
}

static void layer_forward(const pi_model *m, const pi_layer *L, float *x, const int64_t *pos, const int64_t *slot, int T, const pi_scratch *s,
                          double *last) {
    const int d = m->d;
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++) norm_row(m, x + (size_t)t * d, L->attn_norm, L->attn_norm_b, s->xn + (size_t)t * d);
    if (L->gpu_part & PI_PART_ATTN) {
        gpu_attention(m, s, T, (int)(L - m->layers));
        mark(m, PH_ATTN, last);
    } else {
        attention_cpu(m, L, pos, slot, T, s, last);
    }
    ffn_forward(m, L, x, T, s, last);
}

/* x [T, d]: the residual stream entering layer `first` in, leaving layer stop - 1 out, final-normed
 * when `out_norm` (a run of layers: the GPU hybrid's CPU-only layers; the whole model below).
 * 0 on success; 3: a range outside the model. */
int pi_forward_range(const pi_model *m, float *x, const int64_t *pos, const int64_t *slot, int T, void *scratch, int first, int stop,
                     int out_norm) {
    if (T < 1 || T > m->max_t) return 1;
    if (first < 0 || stop > m->n_layers || first > stop) return 3;
    if (m->on_gpu && !m->comm) return 3; /* GPU layers (and shares of layers) need the pool's segment */
    for (int l = first; l < stop && !m->comm; l++)
        if (m->layers[l].gpu_part) return 3;
    for (int t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= m->n_ctx || slot[t] < 0 || slot[t] >= m->n_slots) return 2;
    pi_scratch s;
    carve(m, T, (uint8_t *)scratch, &s);
#pragma omp parallel num_threads(m->n_threads)
    {
        double last = omp_get_wtime();
        for (int l = first; l < stop; l++) {
            if (m->on_gpu && m->on_gpu[l]) { /* a run of layers on the GPU rank (handoff.h) */
                int e = l + 1;
                while (e < stop && m->on_gpu[e]) e++;
#pragma omp barrier
#pragma omp single
                { /* then a barrier merge: rank 0 may post again only once every rank has read the answer */
                    pi_gpu_run((pi_comm *)m->comm, x, T, m->d, l, e);
                    pi_allgather((pi_comm *)m->comm, x, T, m->d, 0, 0);
                }
                l = e - 1;
                continue;
            }
            layer_forward(m, &m->layers[l], x, pos, slot, T, &s, &last);
        }
        if (out_norm) {
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++) norm_row(m, x + (size_t)t * m->d, m->out_norm, m->out_norm_b, x + (size_t)t * m->d);
        }
    }
    return m->comm ? ((pi_comm *)m->comm)->err : 0;
}

/* x [T, d]: the (scaled) embeddings in, the final-normed hidden state out. 0 on success. */
int pi_forward(const pi_model *m, float *x, const int64_t *pos, const int64_t *slot, int T, void *scratch) {
    return pi_forward_range(m, x, pos, slot, T, scratch, 0, m->n_layers, 1);
}

/* y [T, w->rows] = x [T, w->cols] @ W.T (the output head, and the tests' entry to every type). */
int pi_matmul(const pi_model *m, const pi_wt *w, const float *x, int T, float *y, void *scratch) {
    int align;
    if (!dot_for(w->type, &align) || w->cols % align || T < 1 || T > m->max_t) return 1;
    pi_scratch s;
    carve(m, T, (uint8_t *)scratch, &s);
#pragma omp parallel num_threads(m->n_threads)
    {
        quantize_rows(&s, x, T, w->cols);
        matmul(w, &s, x, T, y, w->rows);
    }
    return 0;
}

#include "step.h"
