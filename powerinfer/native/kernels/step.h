/* The decoder's entry points around the forward pass: embedding rows, the refinement of the
 * best logits, the decode logits, a whole step in one call, and what a build supports.
 *
 * Runs in: the process that loads decoder.c, which includes this file after pi_forward and
 * pi_matmul (one translation unit).
 */
#ifndef PI_STEP_H
#define PI_STEP_H

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
int pi_refine_best(const pi_wt *w, const float *hidden, int T, float *out, float margin, int k, int32_t *cand, float *row);

int pi_decode_logits(const pi_model *m, const float *hidden, int T, float *out, float margin, int k, void *scratch, int32_t *cand,
                     float *row) {
    int rc = pi_matmul(m, &m->head, hidden, T, out, scratch);
    return rc ? rc : pi_refine_best(&m->head, hidden, T, out, margin, k, cand, row);
}

/* x [T, d] = embedding rows of ids times embed_scale (plus the learned position rows of pos:
 * OPT). 0, 1 (a bad table), 2 (a position outside the table), 3 (an id outside it). */
static int embed_ids(const pi_model *m, const pi_wt *embd, float embed_scale, const int64_t *ids, const int64_t *pos, int T, float *x) {
    if (embd->cols != m->d) return 1;
    for (int t = 0; t < T; t++) {
        if (ids[t] < 0 || ids[t] >= embd->rows) return 3;
        float *xt = x + (size_t)t * m->d;
        if (dequant_row(embd->type, embd->data + (size_t)ids[t] * embd->row_bytes, m->d, xt)) return 1;
        if (embed_scale != 1.0f)
            for (int i = 0; i < m->d; i++) xt[i] *= embed_scale;
        if (m->pos_embd) {
            const int64_t p = pos[t] + m->pos_offset;
            if (pos[t] < 0 || p >= m->pos_rows) return 2;
            add_vec(xt, m->pos_embd + (size_t)p * m->d, m->d);
        }
    }
    return 0;
}

/* A whole step in one call: the embedding rows of ids (times embed_scale) into x [T, d], every
 * layer and the final norm, then the decode logits (pi_decode_logits) of the last row, or of each
 * row (batched decode), into out. */
int pi_step(const pi_model *m, const pi_wt *embd, float embed_scale, const int64_t *ids, const int64_t *pos, const int64_t *slot, int T,
            int each, float *x, float *out, float margin, int k, void *scratch, int32_t *cand, float *row) {
    if (T < 1 || T > m->max_t) return 1;
    int rc = embed_ids(m, embd, embed_scale, ids, pos, T, x);
    if (!rc) rc = pi_forward(m, x, pos, slot, T, scratch);
    if (rc) return rc;
    return pi_decode_logits(m, each ? x : x + (size_t)(T - 1) * m->d, each ? T : 1, out, margin, k, scratch, cand, row);
}

enum { PI_STEP_STREAM = 4 }; /* a step's mode flag: the residual stream comes in through m->stream_in (a pipeline stage) */

/* A rank's step (a worker of the native pool; m->comm set, m->head its rows of the head).
 * mode 0: embed ids, every layer (summing partials with the other ranks) -> hidden [T, d];
 * a pipeline stage's pool runs its layers [m->first, m->stop) instead, and with mode |
 * PI_STEP_STREAM takes the stream entering m->first from m->stream_in instead of embedding ids
 * (hidden: the stream leaving m->stop - 1, final-normed only after the model's last layer);
 * mode 1 / 2: the same, then the last row's (1) or every row's (2) logits of this rank's head
 * rows into logits (row stride ld: the caller points it at this rank's first column);
 * mode 3: hidden [T, d] given -> every row's logits (the output head alone).
 * hidden (when not NULL) receives the final-normed hidden state of modes 0-2. 0, or an error
 * code (PI_COMM_* when a peer failed the sync). */
int pi_rank_step(const pi_model *m, const pi_wt *embd, float embed_scale, const int64_t *ids, const int64_t *pos, const int64_t *slot, int T,
                 int mode, float *x, float *logits, int64_t ld, float *hidden, void *scratch) {
    const int stream = mode >= 0 && (mode & PI_STEP_STREAM), first = m->first, stop = m->stop ? m->stop : m->n_layers;
    if (stream) mode &= ~PI_STEP_STREAM;
    if (T < 1 || T > m->max_t || mode < 0 || mode > 3 || (stream && !m->stream_in)) return 1;
    if (mode != 3) {
        int rc = 0;
        if (stream) /* a pipeline stage's incoming residual stream (every rank reads it before its first merge; rank 0 overwrites it after its last) */
            memcpy(x, m->stream_in, sizeof(float) * (size_t)T * m->d);
        else
            rc = first ? 1 : embed_ids(m, embd, embed_scale, ids, pos, T, x); /* token ids enter at layer 0 only */
        if (!rc) rc = pi_forward_range(m, x, pos, slot, T, scratch, first, stop, stop == m->n_layers);
        if (rc) return rc;
        if (hidden) memcpy(hidden, x, sizeof(float) * (size_t)T * m->d);
        if (mode == 0) return 0;
    }
    if (stop != m->n_layers) return 1; /* logits follow the model's last layer only */
    const float *h = mode == 1 ? x + (size_t)(T - 1) * m->d : x;
    const int n = mode == 1 ? 1 : T;
    if (m->head.rows == 0) return 0;
    pi_scratch s;
    carve(m, n, (uint8_t *)scratch, &s);
#pragma omp parallel num_threads(m->n_threads)
    {
        quantize_rows(&s, h, n, m->head.cols);
        matmul(&m->head, &s, h, n, logits, (int)ld);
    }
    return 0;
}

/* A serving rank: what pi_rank_step needs besides the step itself (native_worker.py fills it). */
typedef struct {
    const pi_model *m;
    const pi_wt *embd;
    float *x, *logits, *hidden; /* hidden: rank 0's output, else NULL */
    void *scratch;
    int64_t ld, logit_rows;
    float embed_scale;
    int32_t pad;
    uint32_t last_gen, last_control;
} pi_rank_ctx;

int pi_rank_ctx_size(void) { return (int)sizeof(pi_rank_ctx); }

/* Serve steps from the doorbell until a ZeroMQ message waits (returns 2) or nothing came for
 * idle_ms (returns 1): spin spin_us for the next step, then sleep on the doorbell. Each step's
 * ids, positions and slots are read from the segment's io area; the answer goes to the rank's
 * done line. */
int pi_rank_serve(pi_rank_ctx *ctx, int spin_us, int idle_ms) {
    pi_comm *c = (pi_comm *)ctx->m->comm;
    pi_shm_hdr *h = c->hdr;
    const int64_t *io = (const int64_t *)((const uint8_t *)h + pi_shm_hdr_bytes());
    for (;;) {
        const uint32_t want = ctx->last_gen + 1;
        /* 2: the coordinator rang for a ZeroMQ message (last_control now holds the bump seen; a
         * later bump makes the next call return 2 again). A step already posted is served first. */
        int rc = pi_door_next(h, want, &ctx->last_control, spin_us, idle_ms);
        if (rc) return rc;
        /* the generation posted (the coordinator may have skipped one: answer the one it waits for) */
        const uint32_t gen = atomic_load_explicit(&h->door.gen, memory_order_acquire);
        ctx->last_gen = gen;
        const int T = h->door.T, mode = h->door.mode;
        const uint64_t t0 = pi_now_ns(), w0 = c->wait_ns, s0 = c->n_syncs, g0 = c->gpu_ns;
        const int base = mode < 0 ? mode : mode & ~PI_STEP_STREAM;
        if (base < 0 || base > 2 || T < 1 || T > h->max_t || ((base == 2) && T > ctx->logit_rows))
            rc = 1;
        else
            rc = pi_rank_step(ctx->m, ctx->embd, ctx->embed_scale, io, io + h->max_t, io + 2 * h->max_t, T, mode, ctx->x, ctx->logits, ctx->ld,
                              ctx->hidden, ctx->scratch);
        pi_rank_done(c, gen, rc, (int64_t)(pi_now_ns() - t0), (int64_t)(c->wait_ns - w0), (int64_t)(c->n_syncs - s0), (int64_t)(c->gpu_ns - g0));
    }
}

/* The coordinator's half of the decode logits: rows of logits [T, V] from the ranks' 8-bit head,
 * each row's candidates within margin of its best (at most k) recomputed in float32 from the
 * file's head w and the final hidden [T, d] (pi_decode_logits' rule, without the matmul). */
/* The largest of n floats (NaN never wins; -INFINITY for none). */
static float max_of(const float *x, int n) {
    float mx = -INFINITY;
    int i = 0;
#ifdef PI_SIMD
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0;
    for (; i + 16 <= n; i += 16) {
        m0 = _mm256_max_ps(_mm256_loadu_ps(x + i), m0); /* max_ps(a, b) keeps b where a is NaN */
        m1 = _mm256_max_ps(_mm256_loadu_ps(x + i + 8), m1);
    }
    float lane[8];
    _mm256_storeu_ps(lane, _mm256_max_ps(m0, m1));
    for (int j = 0; j < 8; j++) mx = lane[j] > mx ? lane[j] : mx;
#endif
    for (; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    return mx;
}

/* cand[0..n) = the indices of x [n] that are >= lo, ascending; returns n. */
static int at_least(const float *x, int n, float lo, int32_t *cand) {
    int c = 0, i = 0;
#ifdef PI_SIMD
    const __m256 l = _mm256_set1_ps(lo);
    for (; i + 8 <= n; i += 8) {
        unsigned bits = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), l, _CMP_GE_OQ));
        while (bits) { /* few candidates: most blocks have none */
            cand[c++] = i + __builtin_ctz(bits);
            bits &= bits - 1;
        }
    }
#endif
    for (; i < n; i++)
        if (x[i] >= lo) cand[c++] = i;
    return c;
}

int pi_refine_best(const pi_wt *w, const float *hidden, int T, float *out, float margin, int k, int32_t *cand, float *row) {
    const int V = w->rows;
    for (int t = 0; t < T; t++) {
        float *lg = out + (size_t)t * V;
        const float mx = max_of(lg, V);
        int n = at_least(lg, V, mx - margin, cand);
        if (n > k) {
            for (int a = 0; a < k; a++) {
                int best = a;
                for (int b = a + 1; b < n; b++)
                    if (lg[cand[b]] > lg[cand[best]]) best = b;
                int tmp = cand[a]; cand[a] = cand[best]; cand[best] = tmp;
            }
            n = k;
        }
        for (int c = 0; c < n; c++) {
            if (dequant_row(w->type, w->data + (size_t)cand[c] * w->row_bytes, w->cols, row)) return 1;
            lg[cand[c]] = dotf(hidden + (size_t)t * w->cols, row, w->cols);
        }
    }
    return 0;
}

/* A type's row of qtypes.h, for the bindings to hold against powerinfer/quants/registry.py: out =
 * {values per block, bytes per block, bytes of one block of a repacked eight-row group (0: never
 * repacked), rows may take the split layout}. 1 for a type this library does not compute. */
int pi_qtype_facts(int type, int32_t *out) {
    const pi_qtype *t = pi_qtype_of(type);
    if (!t) return 1;
    out[0] = t->qk;
    out[1] = t->bytes;
    out[2] = t->x8_hdr + t->x8_codes;
    out[3] = t->split;
    return 0;
}

/* 1 when this build computes repacked groups of eight rows of type (SIMD builds, Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q6_K). */
int pi_x8_supported(int type) {
#ifdef PI_SIMD
    const pi_qtype *t = pi_qtype_of(type);
    return t && t->x8_hdr > 0;
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

#endif
