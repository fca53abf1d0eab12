/* Shared-memory all-gather between the ranks of a worker pool (one process per rank, one host).
 *
 * Runs in: every CPU worker process of the native pool (included by decoder.c); the coordinator
 * maps the same segment to publish aborts and read the counters.
 *
 * The segment (created by the coordinator, powerinfer/native/comm.py) starts with a
 * header: a cache line of pool-wide words (abort flag, rank count, capacity), the step doorbell,
 * one cache line per rank holding the generation that rank last published and how many of its
 * peers sleep on it, one per rank for its answer to a step, the ranks' pids; then the step's io
 * area and, per rank, two banks of `cap` floats (page-aligned, written by that rank alone, so on a
 * multi-socket machine their pages are first touched, hence placed, on the writer's node; the
 * peers read them across the interconnect once per sync). A sync of a [T, ld] matrix whose
 * columns the ranks split between them:
 *   1. rank r copies its columns [c0, c1) packed ([T, c1 - c0]) into its bank gen & 1, notes c0
 *      and c1 for that bank in its line and stores gen there (release);
 *   2. it waits until every peer's line holds >= gen (acquire): spinning with `pause` for up to
 *      spin_us, then sleeping on the peer's word with futex (woken by that peer's store);
 *   3. it copies every peer's columns from that peer's bank into place: every rank ends with the
 *      same bits.
 * Why a gather, not a sum of partials: each output element stays one rank's whole dot product,
 * so the split changes no rounding (a sum of partial dot products moved the logits by up to ~1
 * through the 8-bit activations of later layers, measured on SmolLM2).
 * Two banks (and two column notes) per rank suffice: a rank can only write bank gen & 1 again at
 * gen + 2, which needs every peer past gen + 1, i.e. done reading gen. Waiting checks, every
 * slice_ms, the abort flag (set by the coordinator when a rank dies), the peers' liveness
 * (/proc/<pid>/stat: gone or zombie) and a deadline, so a dead or stopped rank fails the sync
 * instead of hanging it. Latencies (ns, per sync) go to a ring the benchmark reads.
 */
#ifndef PI_COMM_H
#define PI_COMM_H

#include <errno.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define PI_PAUSE() _mm_pause()
#else
#define PI_PAUSE() ((void)0)
#endif

#define PI_MAX_RANKS 64
#define PI_COMM_MAGIC 0x50494152u /* "PIAR" */
#define PI_LAT_RING 8192

typedef struct {
    _Atomic uint32_t gen;      /* last generation this rank published */
    _Atomic uint32_t sleepers; /* peers asleep on gen (futex) */
    int32_t c0[2], c1[2];      /* per bank: the columns of the sync that last wrote it */
    uint8_t pad[40];
} pi_rank_line;

/* The step doorbell (coordinator -> ranks): the coordinator writes T tokens' ids, positions and
 * slots into the segment's io area, T and mode here, then bumps gen. control is bumped when a
 * ZeroMQ message waits for the ranks (LOGITS, SHUTDOWN): a serving rank then returns to Python. */
typedef struct {
    _Atomic uint32_t gen, control;
    _Atomic uint32_t seq, sleepers; /* seq: bumped after either; the ranks sleep on it */
    int32_t T, mode;
    uint8_t pad[40];
} pi_door;

/* A rank's answer to step gen (rank -> coordinator): done = gen once its outputs are written. */
typedef struct {
    _Atomic uint32_t done, sleepers;
    int32_t rc, pad;
    int64_t compute_ns, wait_ns, syncs, gpu_ns; /* gpu_ns: waiting for the GPU rank's runs (handoff.h) */
    uint8_t pad2[16];
} pi_done_line;

/* The GPU rank's hand-off (handoff.h): CPU rank 0 writes [T, d] at `off` bytes from the
 * segment's base (the stream, or a layer's normed input), the task (kind, [first, stop)) and T
 * here, and stores in; the GPU rank computes it, writes [T, d] back there (the stream after the
 * run, or its partial sum), rc, and stores out; every CPU rank reads it. seq is bumped by each
 * hand-off and each control ring (the GPU rank sleeps on it). off 0: no GPU rank. */
typedef struct {
    _Atomic uint32_t in, out, seq, sleepers, out_sleepers, control;
    int32_t T, first, stop, rc, pid, kind; /* kind: PI_GPU_RUN / PI_GPU_ATTN / PI_GPU_FFN (handoff.h) */
    int64_t off, d;
} pi_gpu_line;

typedef struct {
    uint32_t magic, n_ranks;
    _Atomic uint32_t abort; /* nonzero: every wait fails (the coordinator saw a rank die) */
    uint32_t pad0;
    int64_t cap;   /* floats per bank */
    int64_t max_t; /* tokens of the io area */
    uint8_t pad1[32];
    pi_door door;
    pi_rank_line ranks[PI_MAX_RANKS];
    pi_done_line done[PI_MAX_RANKS];
    int32_t pids[PI_MAX_RANKS];
    _Alignas(64) pi_gpu_line gpu; /* a cache line of its own */
} pi_shm_hdr;

/* Bytes of the header; the io area (int64 [3, max_t]: ids, positions, slots) follows, 64-byte
 * aligned, then the banks: per rank [2][cap] floats, each rank's pair starting on a page (PI_PAGE). */
#define PI_PAGE 65536u /* the largest common base page (aarch64 may use 64 KiB): banks of two ranks never share one */
static inline size_t pi_shm_hdr_bytes(void) { return (sizeof(pi_shm_hdr) + 63) & ~(size_t)63; }
static inline size_t pi_shm_banks_off(int64_t max_t) {
    return (pi_shm_hdr_bytes() + 3 * 8 * (size_t)max_t + PI_PAGE - 1) & ~(size_t)(PI_PAGE - 1);
}
static inline size_t pi_shm_rank_stride(int64_t cap) { return (2 * 4 * (size_t)cap + PI_PAGE - 1) & ~(size_t)(PI_PAGE - 1); }

/* One rank's handle (private to its process). */
typedef struct {
    pi_shm_hdr *hdr;
    float *bufs; /* the banks: rank r's bank b at bufs + r * stride + b * cap floats */
    int32_t rank, spin_us, slice_ms, deadline_ms;
    uint32_t gen;
    int32_t err; /* sticky: 0, or why a sync failed (PI_COMM_*) */
    uint64_t n_syncs, wait_ns;
    uint32_t handoffs, pad; /* runs handed to the GPU rank (handoff.h) */
    uint64_t gpu_ns;        /* time waiting for their answers */
    uint32_t *lat; /* PI_LAT_RING latencies in ns, ring */
} pi_comm;

enum { PI_COMM_OK = 0, PI_COMM_ABORT = 10, PI_COMM_PEER_DEAD = 11, PI_COMM_TIMEOUT = 12, PI_COMM_TOO_BIG = 13, PI_COMM_GPU_FAILED = 14,
       PI_COMM_NO_GPU = 15 };

static inline uint64_t pi_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* 1 when pid is gone or a zombie (a sibling's exit is only reaped by the coordinator). */
static int pi_pid_dead(int32_t pid) {
    if (pid <= 0) return 0;
    if (kill(pid, 0) != 0 && errno == ESRCH) return 1;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *fp = fopen(path, "r");
    if (!fp) return 0; /* kill() found it: alive, whatever /proc says */
    size_t n = fread(buf, 1, sizeof buf - 1, fp);
    fclose(fp);
    buf[n] = 0;
    const char *p = strrchr(buf, ')'); /* "pid (comm) S ..." : comm may hold spaces */
    return p && (p[2] == 'Z' || p[2] == 'X');
}

/* Wait until *word >= gen (wrapping compare): spin with `pause` for spin_us, then sleep on the
 * word with futex in slices of slice_ms (its writer wakes the sleepers: Dekker pairing through
 * *sleepers). Between slices: the abort flag, the peer's liveness (pid > 0), the deadline. */
static int pi_wait_word(pi_shm_hdr *h, _Atomic uint32_t *word, _Atomic uint32_t *sleepers, uint32_t gen, int spin_us, int slice_ms,
                        int deadline_ms, int32_t pid) {
    if ((int32_t)(atomic_load_explicit(word, memory_order_acquire) - gen) >= 0) return 0;
    const uint64_t t0 = pi_now_ns(), spin_end = t0 + (uint64_t)spin_us * 1000u;
    while (spin_us > 0) { /* spin: a peer a few microseconds behind costs no system call */
        for (int i = 0; i < 64; i++) {
            if ((int32_t)(atomic_load_explicit(word, memory_order_acquire) - gen) >= 0) return 0;
            PI_PAUSE();
        }
        if (atomic_load_explicit(&h->abort, memory_order_relaxed)) return PI_COMM_ABORT;
        if (pi_now_ns() >= spin_end) break;
    }
    const uint64_t deadline = t0 + (uint64_t)deadline_ms * 1000000ull;
    for (;;) {
        atomic_fetch_add_explicit(sleepers, 1, memory_order_seq_cst);
        const uint32_t seen = atomic_load_explicit(word, memory_order_seq_cst);
        if ((int32_t)(seen - gen) < 0 && !atomic_load_explicit(&h->abort, memory_order_seq_cst)) {
            struct timespec ts = {slice_ms / 1000, (long)(slice_ms % 1000) * 1000000L};
            syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, seen, &ts, NULL, 0);
        }
        atomic_fetch_sub_explicit(sleepers, 1, memory_order_seq_cst);
        if ((int32_t)(atomic_load_explicit(word, memory_order_acquire) - gen) >= 0) return 0;
        if (atomic_load_explicit(&h->abort, memory_order_relaxed)) return PI_COMM_ABORT;
        if (pid > 0 && pi_pid_dead(pid)) return PI_COMM_PEER_DEAD;
        if (pi_now_ns() >= deadline) return PI_COMM_TIMEOUT;
    }
}

/* Store gen into word and wake whoever sleeps on it. */
static void pi_post_word(_Atomic uint32_t *word, _Atomic uint32_t *sleepers, uint32_t gen) {
    atomic_store_explicit(word, gen, memory_order_seq_cst);
    if (atomic_load_explicit(sleepers, memory_order_seq_cst)) syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
}

static int pi_wait_gen(pi_comm *c, int r, uint32_t gen) {
    pi_rank_line *line = &c->hdr->ranks[r];
    return pi_wait_word(c->hdr, &line->gen, &line->sleepers, gen, c->spin_us, c->slice_ms, c->deadline_ms, c->hdr->pids[r]);
}

/* After setting abort: wake every sleeper (the doorbell's word changes, so its sleepers cannot miss it). */
static void pi_wake_all(pi_shm_hdr *h) {
    atomic_fetch_add(&h->door.seq, 1u);
    syscall(SYS_futex, (uint32_t *)&h->door.seq, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
    for (uint32_t r = 0; r < h->n_ranks; r++) {
        syscall(SYS_futex, (uint32_t *)&h->ranks[r].gen, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
        syscall(SYS_futex, (uint32_t *)&h->done[r].done, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
    }
    atomic_fetch_add(&h->gpu.seq, 1u);
    syscall(SYS_futex, (uint32_t *)&h->gpu.seq, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
    syscall(SYS_futex, (uint32_t *)&h->gpu.out, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
}

static void pi_publish(pi_comm *c, uint32_t gen) {
    pi_rank_line *me = &c->hdr->ranks[c->rank];
    pi_post_word(&me->gen, &me->sleepers, gen);
}

/* x [T, ld]: columns [c0, c1) are this rank's; afterwards every row holds every rank's columns
 * (the ranks' column ranges partition [0, ld)). 0, or a PI_COMM_* code (sticky: later syncs
 * fail at once, so a pass that lost a peer ends quickly). */
static int pi_allgather(pi_comm *c, float *x, int T, int ld, int c0, int c1) {
    if (c->err) return c->err;
    const int64_t n = (int64_t)T * ld;
    if (n > c->hdr->cap) return c->err = PI_COMM_TOO_BIG;
    const int R = (int)c->hdr->n_ranks;
    const uint64_t t0 = pi_now_ns();
    const uint32_t gen = ++c->gen, b = gen & 1u;
    const size_t stride = pi_shm_rank_stride(c->hdr->cap) / sizeof(float), cap = (size_t)c->hdr->cap;
    pi_rank_line *me = &c->hdr->ranks[c->rank];
    if (c1 > c0) {
        float *bank = c->bufs + (size_t)c->rank * stride + b * cap;
        const size_t w = (size_t)(c1 - c0);
        for (int t = 0; t < T; t++) memcpy(bank + (size_t)t * w, x + (size_t)t * ld + c0, sizeof(float) * w);
    }
    me->c0[b] = c0;
    me->c1[b] = c1;
    pi_publish(c, gen); /* seq_cst store: the bank and the column note are visible before gen */
    const uint64_t t1 = pi_now_ns();
    for (int r = 0; r < R; r++) {
        if (r == c->rank) continue;
        int rc = pi_wait_gen(c, r, gen);
        if (rc) { /* the peers would wait for this rank's next generation: fail them now */
            atomic_store(&c->hdr->abort, 1u);
            pi_wake_all(c->hdr);
            return c->err = rc;
        }
    }
    const uint64_t t2 = pi_now_ns();
    for (int r = 0; r < R; r++) {
        const pi_rank_line *peer = &c->hdr->ranks[r];
        const int p0 = peer->c0[b], p1 = peer->c1[b];
        if (r == c->rank || p1 <= p0) continue;
        if (p0 < 0 || p1 > ld) { /* a peer with another idea of the row: fail every rank now, not at the deadline */
            atomic_store(&c->hdr->abort, 1u);
            pi_wake_all(c->hdr);
            return c->err = PI_COMM_TOO_BIG;
        }
        const float *bank = c->bufs + (size_t)r * stride + b * cap;
        const size_t w = (size_t)(p1 - p0);
        for (int t = 0; t < T; t++) memcpy(x + (size_t)t * ld + p0, bank + (size_t)t * w, sizeof(float) * w);
    }
    const uint64_t t3 = pi_now_ns();
    c->wait_ns += t2 - t1;
    if (c->lat) c->lat[c->n_syncs % PI_LAT_RING] = (uint32_t)((t3 - t0) > 0xffffffffu ? 0xffffffffu : (t3 - t0));
    c->n_syncs++;
    return 0;
}

/* --- entry points (ctypes) -------------------------------------------------------------------- */

int64_t pi_comm_hdr_bytes(void) { return (int64_t)pi_shm_hdr_bytes(); }
int64_t pi_comm_banks_off(int64_t max_t) { return (int64_t)pi_shm_banks_off(max_t); }
int64_t pi_comm_rank_stride(int64_t cap) { return (int64_t)pi_shm_rank_stride(cap); }
int pi_comm_size(void) { return (int)sizeof(pi_comm); }

/* The coordinator formats a fresh segment: the header, the io area, n_ranks * pi_shm_rank_stride(cap)
 * bytes of banks (+ its outputs; native/comm.py's SegmentLayout mirrors these offsets). */
int pi_comm_format(void *base, int n_ranks, int64_t cap, int64_t max_t) {
    if (n_ranks < 1 || n_ranks > PI_MAX_RANKS || cap < 1 || max_t < 1) return 1;
    pi_shm_hdr *h = (pi_shm_hdr *)base;
    memset(h, 0, sizeof *h);
    h->n_ranks = (uint32_t)n_ranks;
    h->cap = cap;
    h->max_t = max_t;
    atomic_thread_fence(memory_order_seq_cst);
    h->magic = PI_COMM_MAGIC;
    return 0;
}

/* A rank attaches: c is its private handle; lat a PI_LAT_RING uint32 ring (or NULL). */
int pi_comm_attach(pi_comm *c, void *base, int rank, int spin_us, int slice_ms, int deadline_ms, uint32_t *lat) {
    pi_shm_hdr *h = (pi_shm_hdr *)base;
    if (h->magic != PI_COMM_MAGIC || rank < 0 || rank >= (int)h->n_ranks) return 1;
    memset(c, 0, sizeof *c);
    c->hdr = h;
    c->bufs = (float *)((uint8_t *)base + pi_shm_banks_off(h->max_t)); /* [n_ranks][stride] */
    c->rank = rank;
    c->spin_us = spin_us;
    c->slice_ms = slice_ms > 0 ? slice_ms : 50;
    c->deadline_ms = deadline_ms > 0 ? deadline_ms : 60000;
    c->gen = atomic_load(&h->ranks[rank].gen); /* a fresh segment: 0 */
    c->lat = lat;
    h->pids[rank] = (int32_t)getpid();
    return 0;
}

/* Abort every wait in the pool (coordinator: a rank died), waking the sleepers. */
void pi_comm_abort(void *base) {
    pi_shm_hdr *h = (pi_shm_hdr *)base;
    atomic_store(&h->abort, 1u);
    pi_wake_all(h);
}

/* Coordinator: step gen is in the io area (T tokens, mode): ring the doorbell. */
void pi_door_post(void *base, uint32_t gen, int T, int mode) {
    pi_shm_hdr *h = (pi_shm_hdr *)base;
    h->door.T = T;
    h->door.mode = mode;
    atomic_store_explicit(&h->door.gen, gen, memory_order_seq_cst);
    atomic_fetch_add(&h->door.seq, 1u);
    if (atomic_load_explicit(&h->door.sleepers, memory_order_seq_cst))
        syscall(SYS_futex, (uint32_t *)&h->door.seq, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
}

/* Coordinator: a ZeroMQ message waits for the ranks; serving ranks return to Python to read it. */
void pi_door_control(void *base) {
    pi_shm_hdr *h = (pi_shm_hdr *)base;
    atomic_fetch_add(&h->door.control, 1u);
    atomic_fetch_add(&h->door.seq, 1u);
    syscall(SYS_futex, (uint32_t *)&h->door.seq, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
}

/* A rank: wait for step want or a control bump. 0: the step is there; 2: control; 1: idle_ms
 * passed; PI_COMM_ABORT. Sleeps on seq, which every post bumps, so no post is missed. */
static int pi_door_next(pi_shm_hdr *h, uint32_t want, uint32_t *control, int spin_us, int idle_ms) {
    uint32_t now;
    const uint64_t spin_end = pi_now_ns() + (uint64_t)spin_us * 1000u;
    for (;;) {
        for (int i = 0; i < 64; i++) {
            if ((int32_t)(atomic_load_explicit(&h->door.gen, memory_order_acquire) - want) >= 0) return 0;
            PI_PAUSE();
        }
        if ((now = atomic_load(&h->door.control)) != *control) {
            *control = now;
            return 2;
        }
        if (atomic_load_explicit(&h->abort, memory_order_relaxed)) return PI_COMM_ABORT;
        if (pi_now_ns() >= spin_end) break;
    }
    atomic_fetch_add_explicit(&h->door.sleepers, 1, memory_order_seq_cst);
    const uint32_t seen = atomic_load_explicit(&h->door.seq, memory_order_seq_cst);
    if ((int32_t)(atomic_load(&h->door.gen) - want) < 0 && atomic_load(&h->door.control) == *control && !atomic_load(&h->abort)) {
        struct timespec ts = {idle_ms / 1000, (long)(idle_ms % 1000) * 1000000L};
        syscall(SYS_futex, (uint32_t *)&h->door.seq, FUTEX_WAIT, seen, &ts, NULL, 0);
    }
    atomic_fetch_sub_explicit(&h->door.sleepers, 1, memory_order_seq_cst);
    if ((int32_t)(atomic_load_explicit(&h->door.gen, memory_order_acquire) - want) >= 0) return 0;
    if ((now = atomic_load(&h->door.control)) != *control) {
        *control = now;
        return 2;
    }
    if (atomic_load_explicit(&h->abort, memory_order_relaxed)) return PI_COMM_ABORT;
    return 1;
}

/* Coordinator: wait up to slice_ms for every rank to finish step gen (no spinning: the ranks need
 * the cores). 0: all done; 1: not yet (the caller checks the ranks' health and waits again);
 * PI_COMM_ABORT. out [R, 5] int64: rc, compute ns, wait ns, syncs, GPU-wait ns of each rank. */
int pi_door_wait(void *base, uint32_t gen, int slice_ms, int64_t *out) {
    pi_shm_hdr *h = (pi_shm_hdr *)base;
    for (uint32_t r = 0; r < h->n_ranks; r++) {
        int rc = pi_wait_word(h, &h->done[r].done, &h->done[r].sleepers, gen, 0, slice_ms, slice_ms, 0);
        if (rc == PI_COMM_TIMEOUT) return 1;
        if (rc) return rc;
    }
    for (uint32_t r = 0; r < h->n_ranks; r++) {
        out[5 * r] = h->done[r].rc;
        out[5 * r + 1] = h->done[r].compute_ns;
        out[5 * r + 2] = h->done[r].wait_ns;
        out[5 * r + 3] = h->done[r].syncs;
        out[5 * r + 4] = h->done[r].gpu_ns;
    }
    return 0;
}

/* One rank's answer to step gen. */
static void pi_rank_done(pi_comm *c, uint32_t gen, int rc, int64_t compute_ns, int64_t wait_ns, int64_t syncs, int64_t gpu_ns) {
    pi_done_line *d = &c->hdr->done[c->rank];
    d->rc = rc;
    d->compute_ns = compute_ns;
    d->wait_ns = wait_ns;
    d->syncs = syncs;
    d->gpu_ns = gpu_ns;
    pi_post_word(&d->done, &d->sleepers, gen);
}

/* The micro-benchmark: n syncs of a [1, m] row, this rank's columns [c0, c1) set to rank + 1
 * each time. 0, or the failing code. */
int pi_comm_bench(pi_comm *c, int m, int c0, int c1, int n, float *x) {
    for (int i = 0; i < n; i++) {
        for (int j = c0; j < c1; j++) x[j] = (float)(c->rank + 1);
        int rc = pi_allgather(c, x, 1, m, c0, c1);
        if (rc) return rc;
    }
    return 0;
}

#endif
