/* Native sparse FFN kernel: one layer's FFN over T tokens, computing only the active neurons.
 *
 * Runs in: a CPU worker process (or the coordinator for the in-process executor), loaded with
 * ctypes by powerinfer/native/sparse_kernel.py, which compiles this file on first use.
 *
 * Why native: torch has no kernel that reads a *subset* of a quantized matrix's rows, so the
 * torch path either computes every neuron or first gathers the active rows into a copy. Here each
 * active neuron's gate/up row and down row are read in place, in the file's own 4/8-bit codes.
 *
 * Layouts (all neuron-major; codes are the GGUF codes, so every value is exactly the file's:
 * w = q * scale + zero with per-group float16 scale and zero):
 *   gate, up  rows [n, d]: groups of `group` along d.  4-bit: 16 bytes per 32 values, byte b
 *             holds value b (low nibble) and value b + 16 (high nibble); 8-bit: one int8 each.
 *             scale, zero [n, d / group].
 *   down      rows [n, d] (row j = neuron j's output direction, the file's column j); the file's
 *             groups run along the neurons, so scale, zero are [n / group, d]: down[i, j] =
 *             q[j, i] * scale[j / group, i] + zero[j / group, i].  Codes packed like gate/up in
 *             chunks of 32 along d (4-bit) or one int8 each.
 *   Each is one plain array: a run of rows is one sequential stream (one record per neuron
 *   with all three rows, or scales interleaved with the codes, measured slower; native.py).
 *   A unit is one down group of neurons: y[i] += scale[u, i] * sum_j h_j q[j, i] + zero[u, i] * sum_j h_j,
 *   so the file's scales are applied once per unit. The first sum is an integer one: the unit's
 *   h are held as int16 with one scale (hq = rint(h / hs), hs = max |h| / 32767, 1.5e-5 of the
 *   largest), two rows at a time in one multiply-add (madd_epi16); the second uses h exactly.
 *
 * Work is split into `parts` static ranges of units, each with its own partial y, summed in
 * order at the end: results depend on `parts` but never on T, on the OpenMP thread count, or on
 * which other tokens share the call (prefill, decode and batched decode agree to the bit).
 */
#include "pi_rows.h"

/* Units per block: a block's selected neurons are finished together (finish_block), so up and
 * down are walked in runs of 8 units rather than one (SmolLM2, 30 layers out of cache: 200 -> 126
 * µs a layer with 4 and 8; 1.1B at 15% active: 1661 -> 1432 µs all, 600 -> 558 given_gate). */
#define PI_BLOCK 8

enum { PI_ALL = 0, PI_GATE = 1, PI_MASK = 2, PI_ORACLE = 3, PI_GIVEN_GATE = 4, PI_GIVEN_H = 5 };

/* Group sums of x [d] for groups of g: out [d / g]. */
static void group_sums(const float *x, int d, int g, float *out) {
    for (int i = 0; i < d / g; i++) {
        float s = 0.0f;
        for (int k = 0; k < g; k++) s += x[i * g + k];
        out[i] = s;
    }
}

/* Per token: group sums of x for gate's and up's groups, and x quantized to int16 per 32. */
static void prepare_x(const float *x, int T, int d, int gg, int ug, float *xs_g, float *xs_u, int16_t *xq, float *xd) {
    for (int t = 0; t < T; t++) {
        const float *xt = x + (size_t)t * d;
        group_sums(xt, d, gg, xs_g + (size_t)t * (d / gg));
        group_sums(xt, d, ug, xs_u + (size_t)t * (d / ug));
        quantize_x(xt, d, xq + (size_t)t * d, xd + (size_t)t * (d / 32));
    }
}

/* The scratch floats pi_ffn needs: parts * T * d partial outputs, T * d for group sums, and
 * parts * T counters. */
int64_t pi_ffn_scratch(int T, int d, int parts) { return (int64_t)(parts + 1) * T * d + (int64_t)parts * T; }

/* One call's arguments in one struct: the Python side keeps it and sets only what changes (a
 * ctypes call with fifteen arguments costs more than the kernel at high sparsity). */
typedef struct {
    const float *x;        /* [T, d] */
    float *y;              /* [T, d] */
    int32_t *active;       /* [T] */
    const uint8_t *mask;   /* [T, n] for PI_MASK, else unused */
    const float *given_a;  /* [T, n] act(gate) for PI_GIVEN_GATE / PI_GIVEN_H */
    const float *given_h;  /* [T, n] act(gate) * up for PI_GIVEN_H */
    float *scratch;        /* pi_ffn_scratch(T, d, parts) floats */
    pi_mat gate, up, down;
    int32_t T, d, n, act, mode, parts;
    float thr;
    float act_thr;         /* FATReLU's threshold (act PI_ACT_RELU; 0 for ReLU) */
} pi_call;

/* Stage one for unit u, token t: the neurons to compute, idx[k], and what is known of them in
 * h[k] (act(gate), or act(gate) * up for PI_GIVEN_H; nothing yet for PI_MASK). Gate-reading modes
 * compute the unit's gate rows here (a sequential stream the hardware prefetches by itself). */
static int select_unit(const pi_call *c, int u, int t, const int16_t *xqt, const float *xdt, const float *xs_gt, int32_t *idx, float *h) {
    const int ug = c->down.group, n = c->n, d = c->d, mode = c->mode, j0 = u * ug;
    const float thr = c->thr;
    int k = 0;
    if (mode == PI_GIVEN_GATE || mode == PI_GIVEN_H) {
        /* the caller computed act(gate) (and up) densely: select only */
        const float *at = c->given_a + (size_t)t * n + j0;
        for (int i = 0; i < ug; i++) {
            if (!(fabsf(at[i]) > thr)) continue;
            idx[k] = j0 + i;
            h[k++] = mode == PI_GIVEN_H ? c->given_h[(size_t)t * n + j0 + i] : at[i];
        }
        return k;
    }
    if (mode == PI_MASK) {
        const uint8_t *mt = c->mask + (size_t)t * n + j0;
        for (int i = 0; i < ug; i++)
            if (mt[i]) idx[k++] = j0 + i;
        return k;
    }
    /* act(gate) of every neuron of the unit, activated 8 at a time */
    float a[64];
    for (int i = 0; i < ug; i++) idx[i] = j0 + i;
    row_dots(&c->gate, d, idx, ug, xqt, xdt, xs_gt, a);
    act_inplace(a, ug, c->act, c->act_thr);
    for (int i = 0; i < ug; i++) {
        if (mode == PI_GATE && !(fabsf(a[i]) > thr)) continue;
        idx[k] = j0 + i;
        h[k++] = a[i];
    }
    return k;
}

/* Stage two, for a block of units: the rest of each selected neuron (PI_MASK: its gate; then up,
 * unless given) over the whole block's list at once, so each matrix is walked as one long
 * stream rather than one per unit, then each unit's down rows into y [d]. PI_ORACLE drops
 * those with |act(gate) * up| <= thr first. off[i] is where unit u + i's neurons start in
 * idx/h (off[nu] = their count). Returns the neurons whose down rows were summed. */
static int finish_block(const pi_call *c, int u, int nu, const int *off, const int16_t *xqt, const float *xdt, const float *xs_gt,
                        const float *xs_ut, int32_t *idx, float *h, float *y) {
    const int d = c->d, mode = c->mode, k = off[nu];
    float uv[PI_BLOCK * 64];
    if (!k) return 0;
    if (mode == PI_MASK) {
        row_dots(&c->gate, d, idx, k, xqt, xdt, xs_gt, h);
        for (int i = k; i < ((k + 7) & ~7); i++) h[i] = 0.0f;
        act_inplace(h, (k + 7) & ~7, c->act, c->act_thr);
    }
    if (mode != PI_GIVEN_H) {
        row_dots(&c->up, d, idx, k, xqt, xdt, xs_ut, uv);
        for (int i = 0; i < k; i++) h[i] *= up_act(uv[i], c->act);
    }
    int done = 0;
    for (int i = 0; i < nu; i++) {
        int32_t *ui = idx + off[i];
        float *hi = h + off[i];
        int ku = off[i + 1] - off[i];
        if (mode == PI_ORACLE) {
            int kept = 0;
            for (int a = 0; a < ku; a++) {
                if (!(fabsf(hi[a]) > c->thr)) continue;
                ui[kept] = ui[a];
                hi[kept++] = hi[a];
            }
            ku = kept;
        }
        if (ku) down_unit(&c->down, d, u + i, ui, hi, ku, idx + off[i + 1], k - off[i + 1], y);
        done += ku;
    }
    return done;
}

/*
 * x [T, d] (normed input) -> y [T, d]; active [T] counts the neurons computed per token.
 * mode PI_ALL: every neuron. PI_GATE: neurons with |act(gate)| > thr. PI_MASK: mask [T, n] != 0
 * (gate and up of the others are never read). PI_ORACLE: |act(gate) * up| > thr. PI_GIVEN_GATE:
 * act(gate) comes in given_a (computed densely by the caller), |act(gate)| > thr picks the
 * neurons whose up and down rows are read. PI_GIVEN_H: given_h holds act(gate) * up too, only
 * down rows are read. Returns 0, or -1 for a shape this kernel does not take (checked by the
 * caller too).
 */
int pi_ffn(const pi_call *c) {
    const int T = c->T, d = c->d, n = c->n, parts = c->parts, ug = c->down.group;
    const pi_mat *gate = &c->gate, *up = &c->up;
    /* row_dot keeps a row's scales on the stack (<= 512 groups); a unit's neurons too (<= 64) */
    if (d % 32 || d > 8192 || d / gate->group > 512 || d / up->group > 512 || n % ug || ug > 64 || parts < 1) return -1;
    const int units = n / ug;
    float *scratch = c->scratch;
    float *xs_g = scratch + (size_t)parts * T * d;  /* [T, d / gate group] */
    float *xs_u = xs_g + (size_t)T * (d / gate->group);  /* [T, d / up group] */
    float *xd = xs_u + (size_t)T * (d / up->group);  /* [T, d / 32] */
    int16_t *xq = (int16_t *)(xd + (size_t)T * (d / 32));  /* [T, d]: the four fit in T * d floats */
    int32_t *counts = (int32_t *)(scratch + (size_t)(parts + 1) * T * d);  /* [parts, T] */
    prepare_x(c->x, T, d, gate->group, up->group, xs_g, xs_u, xq, xd);
    memset(scratch, 0, sizeof(float) * (size_t)parts * T * d);
    memset(counts, 0, sizeof(int32_t) * (size_t)parts * T);
#pragma omp parallel for schedule(static, 1)
    for (int p = 0; p < parts; p++) {
        int32_t idx[PI_BLOCK * 64];
        float h[PI_BLOCK * 64 + 8];
        int off[PI_BLOCK + 1];
        const int u0 = (int)((int64_t)units * p / parts), u1 = (int)((int64_t)units * (p + 1) / parts);
        for (int ub = u0; ub < u1; ub += PI_BLOCK) {
            const int nu = u1 - ub < PI_BLOCK ? u1 - ub : PI_BLOCK;
            for (int t = 0; t < T; t++) {
                const int16_t *xqt = xq + (size_t)t * d;
                const float *xdt = xd + (size_t)t * (d / 32), *xs_gt = xs_g + (size_t)t * (d / gate->group);
                off[0] = 0;
                for (int i = 0; i < nu; i++) off[i + 1] = off[i] + select_unit(c, ub + i, t, xqt, xdt, xs_gt, idx + off[i], h + off[i]);
                counts[(size_t)p * T + t] += finish_block(c, ub, nu, off, xqt, xdt, xs_gt, xs_u + (size_t)t * (d / up->group), idx, h,
                                                          scratch + ((size_t)p * T + t) * d);
            }
        }
    }
    for (int t = 0; t < T; t++) {
        float *yt = c->y + (size_t)t * d;
        memcpy(yt, scratch + (size_t)t * d, sizeof(float) * d);
        c->active[t] = counts[t];
        for (int p = 1; p < parts; p++) {
            const float *s = scratch + ((size_t)p * T + t) * d;
            for (int i = 0; i < d; i++) yt[i] += s[i];
            c->active[t] += counts[(size_t)p * T + t];
        }
    }
    return 0;
}

/* Every neuron's act(gate) and act(gate) * up for x [T, d]: g, h [T, n] (quality statistics). */
void pi_ffn_acts(const float *x, int T, int d, int n, const pi_mat *gate, const pi_mat *up, int act, float act_thr, float *g,
                 float *h, float *scratch) {
    float *xs_g = scratch, *xs_u = scratch + (size_t)T * (d / gate->group);
    float *xd = xs_u + (size_t)T * (d / up->group);
    int16_t *xq = (int16_t *)(xd + (size_t)T * (d / 32));
    prepare_x(x, T, d, gate->group, up->group, xs_g, xs_u, xq, xd);
#pragma omp parallel for schedule(static)
    for (int j0 = 0; j0 < n; j0 += 8) {
        for (int t = 0; t < T; t++) {
            const int16_t *xqt = xq + (size_t)t * d;
            const float *xdt = xd + (size_t)t * (d / 32);
            float a[8] = {0};
            const int m = n - j0 < 8 ? n - j0 : 8;
            for (int i = 0; i < m; i++) a[i] = row_dot(gate, d, j0 + i, xqt, xdt, xs_g + (size_t)t * (d / gate->group));
            act_inplace(a, 8, act, act_thr);
            for (int i = 0; i < m; i++) {
                g[(size_t)t * n + j0 + i] = a[i];
                h[(size_t)t * n + j0 + i] = a[i] * up_act(row_dot(up, d, j0 + i, xqt, xdt, xs_u + (size_t)t * (d / up->group)), act);
            }
        }
    }
}

/* sizeof(pi_call): native.py refuses a build whose struct layout is not the one it was written for. */
int pi_call_size(void) { return (int)sizeof(pi_call); }

/* Threads of the OpenMP runtime this library resolved (native.py checks it is torch's). */
int pi_max_threads(void) {
#ifdef _OPENMP
    extern int omp_get_max_threads(void);
    return omp_get_max_threads();
#else
    return 1;
#endif
}
