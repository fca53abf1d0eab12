/* The GPU worker as a rank of the native pool: the hand-off of [T, d] rows to it and back, around
 * a run of layers that live on the GPU (layer split) and inside a layer whose attention or hot
 * FFN neurons live there (neuron split).
 *
 * Runs in: every CPU worker process of the native pool (pi_gpu_post / pi_gpu_wait, inside its
 * forward pass), the GPU worker process (pi_gpu_next / pi_gpu_task / pi_gpu_answer through ctypes,
 * its wait in native code) and the coordinator (pi_gpu_setup, pi_gpu_control). Included by
 * decoder.c after comm.h.
 *
 * Three kinds of task, each [T, d] f32 in the hand-off area (pi_gpu_line.off) both ways:
 *   PI_GPU_RUN   layers [first, stop): the residual stream in, the stream after the run out;
 *   PI_GPU_ATTN  layer first's attention: its normed input in, the output projection out (the
 *                layer's KV cache lives on the GPU rank);
 *   PI_GPU_FFN   layer first's hot neurons: the FFN's normed input in, their partial of the down
 *                projection out (the CPU ranks compute the cold neurons meanwhile and add it).
 * Rank 0 posts (copies the rows, notes the task, stores in = k, the k-th hand-off since the
 * segment was made, and wakes the GPU rank); every CPU rank waits for out >= k (spin, then futex;
 * checking the abort flag, the GPU worker's liveness and a deadline, as a merge does) and reads
 * the answer. One area suffices because rank 0 posts again only after a merge that every rank
 * enters after it has read the previous answer: decoder.c ends each use with one (RUN and ATTN: a
 * barrier merge after the copy; FFN: the answer is added before the down projection's gather), and
 * a step's first post follows the coordinator seeing every rank finish the previous step.
 * The GPU's layers, attention weights and KV caches live on the GPU rank alone; the CPU ranks build
 * nothing for them (native/decoder.py's `only` and `gpu_attn`).
 */
#ifndef PI_HANDOFF_H
#define PI_HANDOFF_H

#include "comm.h"

#define PI_GPU_DEADLINE_FACTOR 10 /* a run of layers may take longer than a merge's wait */

enum { PI_GPU_RUN = 0, PI_GPU_ATTN = 1, PI_GPU_FFN = 2 };

static void pi_wake_word(_Atomic uint32_t *word) { syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0); }

/* A CPU rank (one thread, the others at a barrier or computing): hand task (kind, [first, stop))
 * over rows [T, d] to the GPU rank; rank 0 copies them into the area, the others only count the
 * hand-off. 0, or a PI_COMM_* code (sticky, as a failed merge). */
static int pi_gpu_post(pi_comm *c, int kind, const float *rows, int T, int d, int first, int stop) {
    if (c->err) return c->err;
    pi_shm_hdr *h = c->hdr;
    pi_gpu_line *g = &h->gpu;
    if (!g->off || g->d != d || (int64_t)T > h->max_t) return c->err = PI_COMM_NO_GPU;
    const uint32_t k = ++c->handoffs;
    if (c->rank == 0) {
        memcpy((uint8_t *)h + g->off, rows, sizeof(float) * (size_t)T * d);
        g->T = T;
        g->kind = kind;
        g->first = first;
        g->stop = stop;
        atomic_store_explicit(&g->in, k, memory_order_seq_cst); /* the area and the task are visible before in */
        atomic_fetch_add_explicit(&g->seq, 1u, memory_order_seq_cst);
        if (atomic_load_explicit(&g->sleepers, memory_order_seq_cst)) pi_wake_word(&g->seq);
    }
    return 0;
}

/* A CPU rank (one thread): wait for the answer to the last pi_gpu_post. The area [T, d] holding
 * it, or NULL with c->err set (the GPU rank died, stalled or failed; the others' waits fail too). */
static const float *pi_gpu_wait(pi_comm *c) {
    if (c->err) return NULL;
    pi_shm_hdr *h = c->hdr;
    pi_gpu_line *g = &h->gpu;
    const int deadline_ms = c->deadline_ms > INT32_MAX / PI_GPU_DEADLINE_FACTOR ? INT32_MAX : c->deadline_ms * PI_GPU_DEADLINE_FACTOR;
    const uint64_t t0 = pi_now_ns();
    /* g->pid 0 (the GPU rank not attached yet): the abort flag and the deadline only; the
     * coordinator starts steps after the GPU worker's READY, which follows its attach */
    int rc = pi_wait_word(h, &g->out, &g->out_sleepers, c->handoffs, c->spin_us, c->slice_ms, deadline_ms, g->pid);
    if (rc) {
        atomic_store(&h->abort, 1u);
        pi_wake_all(h);
        c->err = rc;
        return NULL;
    }
    c->gpu_ns += pi_now_ns() - t0; /* the time this rank had nothing else to do */
    if (g->rc) { /* every CPU rank reads the same answer */
        c->err = PI_COMM_GPU_FAILED;
        return NULL;
    }
    return (const float *)((const uint8_t *)h + g->off);
}

/* The hand-off area: the answer to the last post once pi_gpu_wait succeeded. */
static inline const float *pi_gpu_area(const pi_comm *c) { return (const float *)((const uint8_t *)c->hdr + c->hdr->gpu.off); }

/* A CPU rank (one thread): layers [first, stop) of x [T, d] on the GPU rank, x updated. 0, or a
 * PI_COMM_* code. The caller merges (a barrier) before rank 0 may post again. */
static int pi_gpu_run(pi_comm *c, float *x, int T, int d, int first, int stop) {
    if (pi_gpu_post(c, PI_GPU_RUN, x, T, d, first, stop)) return c->err;
    const float *area = pi_gpu_wait(c);
    if (!area) return c->err;
    memcpy(x, area, sizeof(float) * (size_t)T * d);
    return 0;
}

/* --- entry points (ctypes) -------------------------------------------------------------------- */

/* The hand-off micro-benchmark (`powerinfer bench --merge`), a CPU rank's side: n runs of "layers
 * [0, 1)" on x [1, d], each followed by a merge of one column per rank (the CPU layers between two
 * runs, which is what lets rank 0 reuse the area); lat [n] receives each run's round trip in ns.
 * 0, or the failing code. */
int pi_gpu_bench(pi_comm *c, float *x, int d, int n, uint32_t *lat) {
    float col[PI_MAX_RANKS];
    const int R = (int)c->hdr->n_ranks;
    for (int i = 0; i < n; i++) {
        const uint64_t t0 = pi_now_ns();
        int rc = pi_gpu_run(c, x, 1, d, 0, 1);
        if (rc) return rc;
        const uint64_t t = pi_now_ns() - t0;
        lat[i] = (uint32_t)(t > 0xffffffffu ? 0xffffffffu : t);
        col[c->rank] = x[0];
        if ((rc = pi_allgather(c, col, 1, R, c->rank, c->rank + 1))) return rc;
    }
    return 0;
}

/* Coordinator: this segment has a GPU rank; its hand-off area [max_t, d] f32 is `off` bytes in. */
void pi_gpu_setup(void *base, int64_t off, int64_t d) {
    pi_shm_hdr *h = (pi_shm_hdr *)base;
    h->gpu.off = off;
    h->gpu.d = d;
}

/* Coordinator: a ZeroMQ message waits for the GPU rank (it returns to Python to read it). */
void pi_gpu_control(void *base) {
    pi_gpu_line *g = &((pi_shm_hdr *)base)->gpu;
    atomic_fetch_add(&g->control, 1u);
    atomic_fetch_add(&g->seq, 1u);
    pi_wake_word(&g->seq);
}

/* The GPU rank attaches: its pid for the CPU ranks' liveness checks; returns the last hand-off
 * answered (a fresh segment: 0), so that it waits for the next. */
uint32_t pi_gpu_attach(void *base, int32_t pid) {
    pi_gpu_line *g = &((pi_shm_hdr *)base)->gpu;
    g->pid = pid;
    return atomic_load(&g->out);
}

/* The GPU rank: wait for hand-off `want` or a control ring, spinning spin_us, then sleeping on seq.
 * 0: it is there; 2: control (*control updated); 1: idle_ms passed; PI_COMM_ABORT. */
int pi_gpu_next(void *base, uint32_t want, uint32_t *control, int spin_us, int idle_ms) {
    pi_shm_hdr *h = (pi_shm_hdr *)base;
    pi_gpu_line *g = &h->gpu;
    uint32_t now;
    const uint64_t spin_end = pi_now_ns() + (uint64_t)(spin_us > 0 ? spin_us : 0) * 1000u;
    for (;;) {
        for (int i = 0; i < 64; i++) {
            if ((int32_t)(atomic_load_explicit(&g->in, memory_order_acquire) - want) >= 0) return 0;
            PI_PAUSE();
        }
        if ((now = atomic_load(&g->control)) != *control) {
            *control = now;
            return 2;
        }
        if (atomic_load_explicit(&h->abort, memory_order_relaxed)) return PI_COMM_ABORT;
        if (pi_now_ns() >= spin_end) break;
    }
    atomic_fetch_add_explicit(&g->sleepers, 1, memory_order_seq_cst);
    const uint32_t seen = atomic_load_explicit(&g->seq, memory_order_seq_cst);
    if ((int32_t)(atomic_load(&g->in) - want) < 0 && atomic_load(&g->control) == *control && !atomic_load(&h->abort)) {
        struct timespec ts = {idle_ms / 1000, (long)(idle_ms % 1000) * 1000000L};
        syscall(SYS_futex, (uint32_t *)&g->seq, FUTEX_WAIT, seen, &ts, NULL, 0);
    }
    atomic_fetch_sub_explicit(&g->sleepers, 1, memory_order_seq_cst);
    if ((int32_t)(atomic_load_explicit(&g->in, memory_order_acquire) - want) >= 0) return 0;
    if ((now = atomic_load(&g->control)) != *control) {
        *control = now;
        return 2;
    }
    if (atomic_load_explicit(&h->abort, memory_order_relaxed)) return PI_COMM_ABORT;
    return 1;
}

/* The GPU rank: the posted task. out [4] int64: T, first, stop, kind (PI_GPU_*). */
void pi_gpu_task(void *base, int64_t *out) {
    const pi_gpu_line *g = &((const pi_shm_hdr *)base)->gpu;
    out[0] = g->T;
    out[1] = g->first;
    out[2] = g->stop;
    out[3] = g->kind;
}

/* The GPU rank: hand-off k answered (the area holds its answer; rc nonzero: it failed). */
void pi_gpu_answer(void *base, uint32_t k, int rc) {
    pi_gpu_line *g = &((pi_shm_hdr *)base)->gpu;
    g->rc = rc;
    pi_post_word(&g->out, &g->out_sleepers, k);
}

#endif
