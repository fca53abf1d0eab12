/* The native decoder's data: a matrix in place (pi_wt), a layer, the model, the profile phases,
 * and the scratch carved for up to max_t tokens. Mirrored by ctypes structures in
 * powerinfer/native/decoder.py and native/decoder_lib.py (their sizes are checked at load).
 *
 * Runs in: the process that loads decoder.c (included by it; one translation unit).
 */
#ifndef PI_MODEL_H
#define PI_MODEL_H

#include <omp.h>
#include <stdlib.h>

#include "qdot.h"

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
    /* A sparse FFN: sp gives the rule (sparse_rows.h) by which only some neurons' gate and up rows
     * are computed, the others' hidden values being zero; pred, when set, is the neuron
     * predictor whose positive logits pick them (PI_SP_MASK). NULL: dense. */
    const struct pi_sparse *sp;
    const struct pi_pred *pred;
    /* Neuron split with a GPU rank (handoff.h): gpu_part bit 1, the attention (weights, KV cache)
     * lives there; bit 2, some FFN neurons do, and cold [n_ff] marks this rank's neurons the CPU
     * computes (1) and the GPU's hot ones (0; their hidden values stay zero here); cold_blocks
     * [n_ff / 16 rounded up]: 0 for a block of 16 of them all hot, whose gate and up rows the dense
     * kernels skip; down_col0 > 0: every neuron before it is the GPU's, and wd holds only the
     * columns [down_col0, n_ff) of this rank's rows (the dense down reads the hidden state from
     * there: the GPU's leading neurons cost the CPU ranks nothing). */
    const uint8_t *cold, *cold_blocks;
    int32_t gpu_part, down_col0;
    /* OPT (NULL elsewhere): LayerNorm biases [d]; the attention output's and down's biases [d]
     * (whole: added after the gather, by every rank alike); bg: the gate's bias at this rank's
     * neurons [n_ff] (OPT's fc1, which sits in wg; a gate-less model's wu has no rows). */
    const float *attn_norm_b, *ffn_norm_b, *bo, *bd, *bg;
} pi_layer;

enum { PI_PART_ATTN = 1, PI_PART_FFN = 2 };

/* A layer's neuron predictor, in 8 bits through the same dot products as the weights:
 * logits [T, n_ff] = fc2 . relu(fc1 . xn + b1) + b2, fc1 [r, d], fc2 [n_ff, r] (r % 32 == 0).
 * linear: 1 for no relu (a low-rank predictor's pairs relu(z), relu(-z) folded into z). */
typedef struct pi_pred {
    pi_wt fc1, fc2;
    const float *b1, *b2;
    int32_t residual; /* 1: fc1 reads the residual stream before the FFN norm (PowerInfer's OPT predictors), 0: the normed input */
    int32_t linear;
    const uint8_t *sg; /* fc2 in pred_sign.h's layout (NULL: fc2's Q8_0 rows), sg_k columns a group */
    int32_t sg_k;
} pi_pred;

/* A layer's sparse rule: which neurons a token computes (PI_SP_*, sparse_rows.h), the threshold
 * on |act(gate)| (gate mode) or |act(gate) * up| (the oracle), down_t: the down projection
 * neuron-major, Q8_0 or Q4_0 [n_ff (all), this rank's output rows padded to 32], for decode's sparse sum
 * (data NULL: the dense down always), and copies of the up (gate) rows that decode dots one by
 * one in the split layout where this build has it. */
typedef struct pi_sparse {
    int32_t mode;
    float thr;
    pi_wt down_t;
    const uint8_t *up_split, *gate_split; /* NULL, or wu / wg rows in qsplit.h's layout (row_bytes apart) */
    int32_t dense_from; /* PI_SP_MASK: a prefill batch of at least this many tokens runs the layer dense (0: none does) */
    /* Hot neurons (decode, gate and mask modes): hot [n_hot] this rank's neurons that calibrate
     * found firing most often, is_hot [n_ff] 1 for them; hot_up and hot_gate (mask mode) their
     * rows copied together (eight-row repacks where the build has them), which decode computes
     * every step with the dense kernel, keeping the neurons the rule chose. down_t's rows are in
     * dperm's order over all neurons, most often firing first (row p is neuron dperm[p]). */
    const int32_t *hot, *dperm;
    const uint8_t *is_hot;
    int32_t n_hot;
    int64_t *computed; /* NULL, or where decode adds the gate / up rows it computed (hot ones and chosen others) */
    pi_wt hot_up, hot_gate;
    /* bytes from one neuron's split rows to the next's (0: the row's own bytes): a predictor's
     * layer bundles each neuron's gate and up rows (gate_split + stride = up_split's next row) */
    int64_t split_stride;
    /* Measurement only (NULL otherwise: sparse_layers.py's track): quality [3] counts decode's
     * predictor against the true active set (|act(gate) * up| > thr; every neuron computed once
     * more): true positives, false negatives, false positives; pred_s the seconds it took. */
    int64_t *quality;
    double *pred_s;
} pi_sparse;

typedef struct {
    int32_t n_layers, d, n_ff, n_head, n_kv, D, Dv, rope_dim, neox, act, n_ctx, n_slots, n_threads, max_t;
    float eps, attn_scale, act_thr; /* act: act.h's code; act_thr: FATReLU's threshold */
    const float *out_norm;
    pi_wt head;
    const pi_layer *layers;
    double *profile; /* NULL, or PI_PHASES seconds accumulated per phase (thread 0's clock) */
    /* A rank of a worker pool holds query heads [q0, q0 + n_head) of n_head_all, the kv heads
     * [kv0, kv0 + n_kv) they read (grp query heads each: a group split between ranks has its kv
     * head computed by both), neurons [n0, n0 + n_ff) of n_ff_all for gate and up, rows
     * [d0, d0 + wo.rows) of the output and down projections, and its rows of the head. comm (a
     * pi_comm, comm.h) gathers the ranks' column slices four times a layer (attention output,
     * its projection, the FFN's hidden, its projection), so each output row is one rank's whole
     * dot product and the numbers equal the unsplit model's bit for bit. In process: comm NULL,
     * the *_all counts 0 (= the local ones), offsets 0. */
    int32_t q0, kv0, grp, n_head_all, n_ff_all, n0, d0, sparse; /* sparse: some layer has a rule (the scratch holds its lists) */
    void *comm;
    int64_t *ffn_active; /* NULL, or [n_layers] neurons computed by each sparse FFN, summed over tokens and calls */
    const int8_t *on_gpu; /* NULL, or [n_layers]: 1 for a layer of the GPU rank (a rank of a pool with one: handoff.h) */
    /* OPT: layernorm (every norm is a LayerNorm with the *_b biases), gateless (h = act(wg x + bg):
     * no up), learned positions: row pos + pos_offset of pos_embd [pos_rows, d] added to each
     * embedding (NULL: none). out_norm_b: the final LayerNorm's bias. */
    const float *out_norm_b, *pos_embd;
    int32_t layernorm, gateless, pos_rows, pos_offset;
    /* A pipeline stage's pool (coordinator/cluster): its layers [first, stop) (stop 0: the whole
     * model), and where a step's incoming residual stream [T, d] lies (the segment's hidden area,
     * which rank 0 overwrites with the outgoing one), for steps with PI_STEP_STREAM. */
    int32_t first, stop;
    const float *stream_in;
} pi_model;

/* Query heads per kv head of the whole model (grp, or what the local counts imply). */
static inline int pi_grp(const pi_model *m) { return m->grp > 0 ? m->grp : m->n_kv > 0 ? m->n_head / m->n_kv : 1; }
/* Query heads and FFN neurons of the whole model (a rank holds a slice of each). */
static inline int pi_heads_all(const pi_model *m) { return m->n_head_all > 0 ? m->n_head_all : m->n_head; }
static inline int pi_ff_all(const pi_model *m) { return m->n_ff_all > 0 ? m->n_ff_all : m->n_ff; }

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
int pi_sparse_size(void) { return (int)sizeof(pi_sparse); }
int pi_pred_size(void) { return (int)sizeof(pi_pred); }

/* Scratch layout (bytes), for up to max_t tokens: see carve(). */
typedef struct {
    float *xn, *q, *k, *v, *att, *tmp, *g, *u, *scores;
    int8_t *aq;
    float *ad;
    float *as;
    uint8_t *mask;   /* sparse FFN, [T, n_ff]: the predictor's chosen neurons */
    int32_t *idx;    /* [T, n_ff]: each token's chosen neurons */
    float *ha, *hu;  /* [T, n_ff]: their act(gate) and up values, packed token after token */
    int32_t *cnt;    /* [3T + 2]: the tokens' offsets into ha/hu, their quads' offsets, how many each kept;
                      * then (down) each 512-neuron chunk's count of nonzero hidden values */
} pi_scratch;

static size_t al64(size_t n) { return (n + 63) & ~(size_t)63; }

static size_t carve(const pi_model *m, int T, uint8_t *base, pi_scratch *s) {
    const size_t nff = (size_t)pi_ff_all(m), attw = (size_t)pi_heads_all(m) * m->Dv;
    const size_t kmax = ((size_t)m->d > nff ? (size_t)m->d : nff) > attw ? ((size_t)m->d > nff ? (size_t)m->d : nff) : attw;
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
    TAKE(att, float, (size_t)T * attw);
    TAKE(tmp, float, (size_t)T * m->d);
    TAKE(g, float, (size_t)T * nff);
    TAKE(u, float, (size_t)T * m->n_ff);
    TAKE(scores, float, (size_t)(m->n_threads > 0 ? m->n_threads : 1) * pi_grp(m) * m->n_ctx);
    TAKE(aq, int8_t, (size_t)T * kmax);
    TAKE(ad, float, (size_t)T * kmax / 32 + 1);
    TAKE(as, float, (size_t)T * kmax / 32 + 1);
    if (m->sparse) {
        TAKE(mask, uint8_t, (size_t)T * m->n_ff);
        TAKE(idx, int32_t, (size_t)T * pi_ff_all(m));
        TAKE(ha, float, (size_t)T * pi_ff_all(m) + 8);
        TAKE(hu, float, (size_t)T * pi_ff_all(m) + 8);
        TAKE(cnt, int32_t, 3 * (size_t)T + 2 + (size_t)T * (pi_ff_all(m) / 512 + 2));
    }
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

#endif
