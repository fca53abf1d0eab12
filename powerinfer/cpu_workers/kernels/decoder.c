/* Native decoder: a whole forward pass (every layer, the final norm) in one call, and the output
 * head; weights are read in place from the memory-mapped GGUF file through qdot.h.
 *
 * Runs in: the process of the in-process executor (the coordinator), loaded with ctypes by
 * powerinfer/cpu_workers/native_model.py, which compiles this file once per machine and ISA.
 *
 * One OpenMP parallel region per call; inside it each operation is a work-shared loop (rows of a
 * matrix, tokens, or (token, head) pairs) and the implicit barrier between loops is the only
 * synchronisation, so Python is entered once per step instead of ~40 times per layer.
 * Per layer (T tokens; x [T, d] is the residual stream, updated in place):
 *   xn = rmsnorm(x) * attn_norm, quantized to 8 bits
 *   q, k, v = xn @ Wq.T, Wk.T, Wv.T (+ biases)          [T, Hq*D], [T, Hkv*D], [T, Hkv*Dv]
 *   per head: rmsnorm * q_norm / k_norm (Gemma), rope (adjacent pairs or NEOX halves)
 *   k, v -> cache[slot, head, pos]; each query attends over its slot's positions lo..pos
 *   x += post_norm(att @ Wo.T);  xn = rmsnorm(x) * ffn_norm
 *   x += post_norm((act(xn @ Wg.T) * (xn @ Wu.T)) @ Wd.T)
 * Tokens are either one prompt chunk (one slot, consecutive positions) or one token of each of
 * T sequences (distinct slots): every token's k, v is written before any token attends. A
 * token's numbers never depend on the others in the call (per-row arithmetic throughout).
 */
#include <omp.h>
#include <stdlib.h>

#include "qdot.h"
#include "qtile.h"
#include "qx8.h"
#include "dequant.h"

typedef struct {
    const uint8_t *data; /* row r at data + r * row_bytes */
    const uint8_t *x8;   /* NULL, or rows [0, rows / 8 * 8) repacked eight at a time (qx8.h) */
    int64_t row_bytes;
    int32_t type, rows, cols;
} pi_wt;

typedef struct {
    pi_wt wq, wk, wv, wo, wg, wu, wd;
    const float *attn_norm, *ffn_norm, *post_attn_norm, *post_ffn_norm; /* post_*: NULL unless Gemma */
    const float *q_norm, *k_norm;                                        /* [D] or NULL */
    const float *bq, *bk, *bv;                                           /* biases or NULL (qwen2) */
    float *k_cache, *v_cache;                                            /* [slots, Hkv, n_ctx, D / Dv] */
    const float *rope_cos, *rope_sin;                                    /* [n_ctx, rope_dim / 2] */
    int32_t window;                                                      /* 0: full attention */
    int32_t pad;
} pi_layer;

typedef struct {
    int32_t n_layers, d, n_ff, n_head, n_kv, D, Dv, rope_dim, neox, act, n_ctx, n_slots, n_threads, max_t;
    float eps, attn_scale;
    const float *out_norm;
    pi_wt head;
    const pi_layer *layers;
    double *profile; /* NULL, or PI_PHASES seconds accumulated per phase (thread 0's clock) */
} pi_model;

/* Phases of a layer for the profile: norm+quantize, q/k/v, rope+cache, attention, output
 * projection, FFN norm, gate+up, activation, down+residual. */
enum { PH_NORM, PH_QKV, PH_ROPE, PH_ATTN, PH_OUT, PH_FFN_NORM, PH_GATE_UP, PH_ACT, PH_DOWN, PI_PHASES };

/* After a barrier every thread has finished the phase: thread 0 charges the time since its last mark. */
static inline void mark(const pi_model *m, int phase, double *last) {
    if (m->profile && omp_get_thread_num() == 0) {
        double now = omp_get_wtime();
        m->profile[phase] += now - *last;
        *last = now;
    }
}

int pi_model_size(void) { return (int)sizeof(pi_model); }
int pi_phases(void) { return PI_PHASES; }
int pi_layer_size(void) { return (int)sizeof(pi_layer); }

/* Scratch layout (bytes), for up to max_t tokens: see carve(). */
typedef struct {
    float *xn, *q, *k, *v, *att, *tmp, *g, *u, *scores;
    int8_t *aq;
    float *ad;
    float *as;
} pi_scratch;

static size_t al64(size_t n) { return (n + 63) & ~(size_t)63; }

static size_t carve(const pi_model *m, int T, uint8_t *base, pi_scratch *s) {
    const size_t kmax = (size_t)(m->d > m->n_ff ? m->d : m->n_ff) > (size_t)m->n_head * m->Dv
                            ? (size_t)(m->d > m->n_ff ? m->d : m->n_ff) : (size_t)m->n_head * m->Dv;
    size_t off = 0;
#define TAKE(field, type, count)                                  \
    do {                                                          \
        if (base) s->field = (type *)(base + off);                \
        off += al64(sizeof(type) * (size_t)(count));              \
    } while (0)
    TAKE(xn, float, (size_t)T * kmax);
    TAKE(q, float, (size_t)T * m->n_head * m->D);
    TAKE(k, float, (size_t)T * m->n_kv * m->D);
    TAKE(v, float, (size_t)T * m->n_kv * m->Dv);
    TAKE(att, float, (size_t)T * m->n_head * m->Dv);
    TAKE(tmp, float, (size_t)T * m->d);
    TAKE(g, float, (size_t)T * m->n_ff);
    TAKE(u, float, (size_t)T * m->n_ff);
    TAKE(scores, float, (size_t)(m->n_threads > 0 ? m->n_threads : 1) * (m->n_head / (m->n_kv > 0 ? m->n_kv : 1)) * m->n_ctx);
    TAKE(aq, int8_t, (size_t)T * kmax);
    TAKE(ad, float, (size_t)T * kmax / 32 + 1);
    TAKE(as, float, (size_t)T * kmax / 32 + 1);
#undef TAKE
    return off;
}

int64_t pi_scratch_bytes(const pi_model *m, int T) {
    pi_scratch s;
    return (int64_t)carve(m, T, NULL, &s);
}

/* Activation rows of token t for a matrix with K columns (rows are K apart in every buffer). */
static inline pi_act act_row(const pi_scratch *s, const float *f, int t, int K) {
    pi_act a = {s->aq + (size_t)t * K, s->ad + (size_t)t * (K / 32), s->as + (size_t)t * (K / 32), f + (size_t)t * K};
    return a;
}

/* Quantize T rows of f [T, K] into the scratch activations (work-shared over tokens). */
static void quantize_rows(const pi_scratch *s, const float *f, int T, int K) {
    if (K % 32) return; /* only float weights have such rows; they read f */
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++) quantize_act(f + (size_t)t * K, K, s->aq + (size_t)t * K, s->ad + (size_t)t * (K / 32), s->as + (size_t)t * (K / 32));
}

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

/* y[t, r] (row stride ldy) = W[r] . x_t for rows r of W, work-shared in blocks of 16 rows;
 * nowait: the caller places the barrier. Repacked groups of eight rows go through qx8.h. */
static void matmul(const pi_wt *w, const pi_scratch *s, const float *f, int T, float *y, int ldy) {
#ifdef PI_SIMD
    const int K = w->cols, x8_rows = w->x8 ? w->rows / 8 * 8 : 0;
#endif
#pragma omp for schedule(static) nowait
    for (int r0 = 0; r0 < w->rows; r0 += 16) {
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

static void rmsnorm(const float *x, const float *w, int n, float eps, float *out) {
    const float ss = dotf(x, x, n);
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

static void rope(float *h, const float *c, const float *sn, int rope_dim, int neox) {
    const int half = rope_dim / 2;
    for (int i = 0; i < half; i++) {
        const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
        const float x0 = h[a], x1 = h[b];
        h[a] = x0 * c[i] - x1 * sn[i];
        h[b] = x0 * sn[i] + x1 * c[i];
    }
}

/* g query heads of one kv head (q [g, D], consecutive): out [g, Dv] = softmax(scale * q . k[lo..p])
 * . v[lo..p] over kc, vc [n_ctx, D / Dv]; each key and value row is loaded once for the g heads.
 * sc: g * ld scratch floats. A head's numbers do not depend on g (same order of operations). */
static void attend_group(const float *q, int g, const float *kc, const float *vc, int lo, int p, int D, int Dv, float scale, float *sc,
                         int ld, float *out) {
    const int n = p - lo + 1;
    for (int j = 0; j < n; j++) {
        const float *kj = kc + (size_t)(lo + j) * D;
        for (int h = 0; h < g; h++) sc[(size_t)h * ld + j] = dotf(q + (size_t)h * D, kj, D) * scale;
    }
    float inv[64]; /* g <= 64: native_model.supports() */
    for (int h = 0; h < g; h++) {
        float *row = sc + (size_t)h * ld, mx = -INFINITY;
        for (int j = 0; j < n; j++) mx = row[j] > mx ? row[j] : mx;
        inv[h] = 1.0f / exp_sub_sum(row, n, mx);
        for (int i = 0; i < Dv; i++) out[(size_t)h * Dv + i] = 0.0f;
    }
    for (int j = 0; j < n; j++) {
        const float *vj = vc + (size_t)(lo + j) * Dv;
        for (int h = 0; h < g; h++) {
            const float pj = sc[(size_t)h * ld + j] * inv[h];
            float *o = out + (size_t)h * Dv;
            for (int i = 0; i < Dv; i++) o[i] += pj * vj[i];
        }
    }
}

static void add_post(float *x, float *h, const float *post, int n, float eps) {
    if (post) rmsnorm(h, post, n, eps, h);
    for (int i = 0; i < n; i++) x[i] += h[i];
}

static void layer_forward(const pi_model *m, const pi_layer *L, float *x, const int64_t *pos, const int64_t *slot, int T, const pi_scratch *s,
                          double *last) {
    const int d = m->d, D = m->D, Dv = m->Dv, Hq = m->n_head, Hkv = m->n_kv, nff = m->n_ff;
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++) rmsnorm(x + (size_t)t * d, L->attn_norm, d, m->eps, s->xn + (size_t)t * d);
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
        rope(row, L->rope_cos + pr, L->rope_sin + pr, m->rope_dim, m->neox);
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
    const int grp = Hq / Hkv;
    if (T * Hkv >= 2 * m->n_threads) { /* round-robin: later tokens see more keys */
#pragma omp for schedule(static, 1)
        for (int i = 0; i < T * Hkv; i++) {
            const int t = i / Hkv, kvh = i % Hkv, p = (int)pos[t];
            const int lo = L->window && p - L->window + 1 > 0 ? p - L->window + 1 : 0;
            const size_t base = ((size_t)slot[t] * Hkv + kvh) * m->n_ctx;
            attend_group(s->q + ((size_t)t * Hq + kvh * grp) * D, grp, L->k_cache + base * D, L->v_cache + base * Dv, lo, p, D, Dv,
                         m->attn_scale, s->scores + (size_t)omp_get_thread_num() * grp * m->n_ctx, m->n_ctx,
                         s->att + ((size_t)t * Hq + kvh * grp) * Dv);
        }
    } else {
#pragma omp for schedule(static, 1)
        for (int i = 0; i < T * Hq; i++) {
            const int t = i / Hq, h = i % Hq, kvh = h / grp, p = (int)pos[t];
            const int lo = L->window && p - L->window + 1 > 0 ? p - L->window + 1 : 0;
            const size_t base = ((size_t)slot[t] * Hkv + kvh) * m->n_ctx;
            attend_group(s->q + ((size_t)t * Hq + h) * D, 1, L->k_cache + base * D, L->v_cache + base * Dv, lo, p, D, Dv, m->attn_scale,
                         s->scores + (size_t)omp_get_thread_num() * grp * m->n_ctx, m->n_ctx, s->att + ((size_t)t * Hq + h) * Dv);
        }
    }
    quantize_rows(s, s->att, T, Hq * Dv);
    mark(m, PH_ATTN, last);
    matmul(&L->wo, s, s->att, T, s->tmp, d);
#pragma omp barrier
    mark(m, PH_OUT, last);
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++) {
        add_post(x + (size_t)t * d, s->tmp + (size_t)t * d, L->post_attn_norm, d, m->eps);
        rmsnorm(x + (size_t)t * d, L->ffn_norm, d, m->eps, s->xn + (size_t)t * d);
    }
    quantize_rows(s, s->xn, T, d);
    mark(m, PH_FFN_NORM, last);
    matmul(&L->wg, s, s->xn, T, s->g, nff);
    matmul(&L->wu, s, s->xn, T, s->u, nff);
#pragma omp barrier
    mark(m, PH_GATE_UP, last);
#pragma omp for schedule(static)
    for (int c = 0; c < T * nff; c += 256) act_mul(s->g + c, s->u + c, c + 256 < T * nff ? 256 : T * nff - c, m->act);
    quantize_rows(s, s->g, T, nff);
    mark(m, PH_ACT, last);
    matmul(&L->wd, s, s->g, T, s->tmp, d);
#pragma omp barrier
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++) add_post(x + (size_t)t * d, s->tmp + (size_t)t * d, L->post_ffn_norm, d, m->eps);
    mark(m, PH_DOWN, last);
}

/* x [T, d]: the (scaled) embeddings in, the final-normed hidden state out. 0 on success. */
int pi_forward(const pi_model *m, float *x, const int64_t *pos, const int64_t *slot, int T, void *scratch) {
    if (T < 1 || T > m->max_t) return 1;
    for (int t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= m->n_ctx || slot[t] < 0 || slot[t] >= m->n_slots) return 2;
    pi_scratch s;
    carve(m, T, (uint8_t *)scratch, &s);
#pragma omp parallel num_threads(m->n_threads)
    {
        double last = omp_get_wtime();
        for (int l = 0; l < m->n_layers; l++) layer_forward(m, &m->layers[l], x, pos, slot, T, &s, &last);
#pragma omp for schedule(static)
        for (int t = 0; t < T; t++) rmsnorm(x + (size_t)t * m->d, m->out_norm, m->d, m->eps, x + (size_t)t * m->d);
    }
    return 0;
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

/* out [n, w->cols] = rows ids[0..n) of w in float32. 0 on success. */
int pi_rows(const pi_wt *w, const int64_t *ids, int n, float *out) {
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= w->rows) return 2;
        if (dequant_row(w->type, w->data + (size_t)ids[i] * w->row_bytes, w->cols, out + (size_t)i * w->cols)) return 1;
    }
    return 0;
}

/* logits[t, idx[t, r]] = hidden[t] . dequantized head row idx[t, r], in float32 (r < R): the
 * engine's refinement of the best candidates, with the activations unrounded. */
int pi_refine(const pi_wt *w, const float *hidden, int T, const int64_t *idx, int R, float *logits, int64_t ld, float *row) {
    for (int t = 0; t < T; t++)
        for (int r = 0; r < R; r++) {
            const int64_t id = idx[(size_t)t * R + r];
            if (id < 0 || id >= w->rows) return 2;
            if (dequant_row(w->type, w->data + (size_t)id * w->row_bytes, w->cols, row)) return 1;
            logits[(size_t)t * ld + id] = dotf(hidden + (size_t)t * w->cols, row, w->cols);
        }
    return 0;
}

/* The decode logits of T rows, the engine's rule in one call: out [T, vocab] = head(hidden) from
 * the 8-bit kernels, then per row the candidates within margin of the best (at most k, the
 * largest) recomputed in float32 from their dequantized rows (pi_refine). cand: vocab ints. */
int pi_decode_logits(const pi_model *m, const float *hidden, int T, float *out, float margin, int k, void *scratch, int32_t *cand,
                     float *row) {
    int rc = pi_matmul(m, &m->head, hidden, T, out, scratch);
    if (rc) return rc;
    const int V = m->head.rows;
    for (int t = 0; t < T; t++) {
        float *lg = out + (size_t)t * V, mx = -INFINITY;
        for (int i = 0; i < V; i++) mx = lg[i] > mx ? lg[i] : mx;
        int n = 0;
        for (int i = 0; i < V; i++)
            if (lg[i] >= mx - margin) cand[n++] = i;
        if (n > k) { /* keep the k largest: a partial selection sort, n is small in practice */
            for (int a = 0; a < k; a++) {
                int best = a;
                for (int b = a + 1; b < n; b++)
                    if (lg[cand[b]] > lg[cand[best]]) best = b;
                int tmp = cand[a]; cand[a] = cand[best]; cand[best] = tmp;
            }
            n = k;
        }
        for (int c = 0; c < n; c++) {
            if (dequant_row(m->head.type, m->head.data + (size_t)cand[c] * m->head.row_bytes, m->head.cols, row)) return 1;
            lg[cand[c]] = dotf(hidden + (size_t)t * m->head.cols, row, m->head.cols);
        }
    }
    return 0;
}

/* A whole step in one call: the embedding rows of ids (times embed_scale) into x [T, d], every
 * layer and the final norm, then the decode logits (pi_decode_logits) of the last row, or of each
 * row (batched decode), into out. */
int pi_step(const pi_model *m, const pi_wt *embd, float embed_scale, const int64_t *ids, const int64_t *pos, const int64_t *slot, int T,
            int each, float *x, float *out, float margin, int k, void *scratch, int32_t *cand, float *row) {
    if (T < 1 || T > m->max_t || embd->cols != m->d) return 1;
    for (int t = 0; t < T; t++) {
        if (ids[t] < 0 || ids[t] >= embd->rows) return 3;
        float *xt = x + (size_t)t * m->d;
        if (dequant_row(embd->type, embd->data + (size_t)ids[t] * embd->row_bytes, m->d, xt)) return 1;
        if (embed_scale != 1.0f)
            for (int i = 0; i < m->d; i++) xt[i] *= embed_scale;
    }
    int rc = pi_forward(m, x, pos, slot, T, scratch);
    if (rc) return rc;
    return pi_decode_logits(m, each ? x : x + (size_t)(T - 1) * m->d, each ? T : 1, out, margin, k, scratch, cand, row);
}

/* 1 when this build computes repacked groups of eight rows of type (SIMD builds, Q4_0 / Q4_1 / Q5_0 / Q8_0). */
int pi_x8_supported(int type) {
#ifdef PI_SIMD
    return type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q8_0;
#else
    (void)type;
    return 0;
#endif
}

/* Which instruction set this build uses: 0 portable C, 1 AVX2, 2 AVX-512 VNNI. */
int pi_isa(void) {
#if defined(PI_VNNI)
    return 2;
#elif defined(PI_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* Sum of n floats read by n_threads threads: the streaming-read bandwidth test of `powerinfer
 * bench` (the decode ceiling is this bandwidth over the weight bytes read per token). */
double pi_read_sum(const float *p, int64_t n, int n_threads) {
    double total = 0.0;
#pragma omp parallel for num_threads(n_threads) schedule(static) reduction(+ : total)
    for (int64_t c = 0; c < n / 4096; c++) {
        const float *q = p + c * 4096;
#ifdef PI_SIMD
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        for (int i = 0; i < 4096; i += 32) {
            a0 = _mm256_add_ps(a0, _mm256_loadu_ps(q + i));
            a1 = _mm256_add_ps(a1, _mm256_loadu_ps(q + i + 8));
            a2 = _mm256_add_ps(a2, _mm256_loadu_ps(q + i + 16));
            a3 = _mm256_add_ps(a3, _mm256_loadu_ps(q + i + 24));
        }
        total += hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#else
        float s = 0.0f;
        for (int i = 0; i < 4096; i++) s += q[i];
        total += s;
#endif
    }
    return total;
}
