/* Native sparse FFN kernel: one layer's FFN over T tokens, computing only the active neurons.
 *
 * Runs in: a CPU worker process (or the coordinator for the in-process executor), loaded with
 * ctypes by powerinfer/cpu_workers/native.py, which compiles this file on first use.
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
 *   Rows are reached through strides, so native.py stores each neuron's gate, up and down codes
 *   and its gate/up scales as one record: a sparse step then touches one run of memory per active
 *   neuron instead of three (scattered 4 KiB pages cost a TLB miss each).
 *   A unit is one down group of neurons: y[i] += scale[u, i] * sum_j h_j q[j, i] + zero[u, i] * sum_j h_j,
 *   so the file's scales are applied once per unit and the sum is exact to float rounding.
 *
 * Work is split into `parts` static ranges of units, each with its own partial y, summed in
 * order at the end: results depend on `parts` but never on T, on the OpenMP thread count, or on
 * which other tokens share the call (prefill, decode and batched decode agree to the bit).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PI_AVX2 1
#endif

typedef struct {
    const uint8_t *codes;   /* 4-bit packed or int8, see above; row j at codes + j * stride */
    const uint16_t *scale;  /* float16; row (gate/up) or unit (down) j at scale + j * sstride */
    const uint16_t *zero;   /* float16, same strides as scale */
    int64_t stride;         /* bytes from one row's codes to the next */
    int64_t sstride;        /* float16 elements from one row's (unit's) scales to the next */
    int32_t bits;           /* 4 or 8 */
    int32_t group;          /* 4-bit: 32; 8-bit: 16 or 32 */
} pi_mat;

enum { PI_ALL = 0, PI_GATE = 1, PI_MASK = 2, PI_ORACLE = 3, PI_GIVEN_GATE = 4, PI_GIVEN_H = 5 };
enum { PI_SILU = 0, PI_GELU = 1 };

__attribute__((unused)) static float h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: renormalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400u)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#ifdef PI_AVX2
/* e^x for 8 floats (Cephes' polynomial; relative error ~2e-7, inputs clamped to +-88). */
static __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.0f)), _mm256_set1_ps(88.0f));
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

/* act(g) in place for k gate values (k a multiple of 8): silu, or gelu's tanh form written as
 * g * sigmoid(2z) (tanh(z) = 2 sigmoid(2z) - 1), so both need only e^x. */
static void act_inplace(float *g, int k, int act) {
#ifdef PI_AVX2
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int i = 0; i < k; i += 8) {
        __m256 v = _mm256_loadu_ps(g + i), z = v;
        if (act == PI_GELU) {
            __m256 v3 = _mm256_mul_ps(_mm256_mul_ps(v, v), v);
            z = _mm256_mul_ps(_mm256_set1_ps(2.0f * 0.7978845608028654f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), v3, v));
        }
        _mm256_storeu_ps(g + i, _mm256_div_ps(v, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), z)))));
    }
#else
    for (int i = 0; i < k; i++) {
        const float v = g[i];
        g[i] = act == PI_SILU ? v / (1.0f + expf(-v)) : 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
    }
#endif
}

/* x [d] -> int16 codes xq [d] and one scale per 32 values xd [d / 32]: the row dots below are
 * then integer multiply-adds (madd_epi16), and 16 bits keep x to ~1.5e-5 of each block's largest
 * value (8-bit codes, as llama.cpp uses, measured ~5x the output error of the bf16 torch path). */
static void quantize_x(const float *x, int d, int16_t *xq, float *xd) {
    for (int b = 0; b < d / 32; b++) {
        const float *xb = x + b * 32;
        float amax = 0.0f;
        for (int k = 0; k < 32; k++) amax = fmaxf(amax, fabsf(xb[k]));
        const float s = amax / 32767.0f, inv = s > 0.0f ? 1.0f / s : 0.0f;
        xd[b] = s;
        for (int k = 0; k < 32; k++) xq[b * 32 + k] = (int16_t)lrintf(xb[k] * inv);
    }
}

/* Row j of gate/up dotted with x, given as xq/xd (quantize_x) and its float group sums xs
 * [d / group] (for the zeros): sum_g scale_g * xd * sum(q * xq) + zero_g * xs_g. Portable form. */
static float row_dot(const pi_mat *m, int d, int j, const int16_t *xq, const float *xd, const float *xs) {
    const int ng = d / m->group, gs = m->group;
    const uint16_t *sc = m->scale + (size_t)j * m->sstride, *zr = m->zero + (size_t)j * m->sstride;
    float tot = 0.0f;
    for (int g = 0; g < ng; g++) {
        int64_t a = 0;
        for (int k = 0; k < gs; k++) {
            const int pos = g * gs + k;
            int q;
            if (m->bits == 4) {
                const uint8_t byte = m->codes[(size_t)j * m->stride + (pos / 32) * 16 + (pos % 16)];
                q = (pos % 32) < 16 ? (byte & 15) : (byte >> 4);
            } else {
                q = ((const int8_t *)m->codes)[(size_t)j * m->stride + pos];
            }
            a += (int64_t)q * xq[pos];
        }
        tot += (float)a * (h2f(sc[g]) * xd[(g * gs) / 32]) + h2f(zr[g]) * xs[g];
    }
    return tot;
}

#ifdef PI_AVX2
/* Four rows j[0..3] at once (out[r] = row_dot of j[r]): the rows share each xq load and their
 * four independent chains keep the multiply-add units busy where one row waits on latency. */
static void row_dot4(const pi_mat *m, int d, const int32_t *j, const int16_t *xq, const float *xd, const float *xs, float *out) {
    const int ng = d / m->group;
    float sf[4][512];  /* each group's scale times its block's xd */
    __m256 acc[4];
    for (int r = 0; r < 4; r++) {
        const uint16_t *sc = m->scale + (size_t)j[r] * m->sstride, *zr = m->zero + (size_t)j[r] * m->sstride;
        __m256 zt = _mm256_setzero_ps();
        float zs = 0.0f;
        int g8 = 0;
        for (; g8 + 8 <= ng; g8 += 8) {
            _mm256_storeu_ps(sf[r] + g8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + g8))));
            zt = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(zr + g8))), _mm256_loadu_ps(xs + g8), zt);
        }
        for (; g8 < ng; g8++) {
            sf[r][g8] = _cvtsh_ss(sc[g8]);
            zs += _cvtsh_ss(zr[g8]) * xs[g8];
        }
        for (int g = 0; g < ng; g++) sf[r][g] *= xd[(g * m->group) / 32];
        acc[r] = _mm256_add_ps(zt, _mm256_setr_ps(zs, 0, 0, 0, 0, 0, 0, 0));
    }
    if (m->bits == 4) {
        const __m128i m0f = _mm_set1_epi8(0x0f);
        for (int g = 0; g < ng; g++) {
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + g * 32));
            const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + g * 32 + 16));
            for (int r = 0; r < 4; r++) {
                __m128i b = _mm_loadu_si128((const __m128i *)(m->codes + (size_t)j[r] * m->stride + g * 16));
                __m256i lo = _mm256_cvtepu8_epi16(_mm_and_si128(b, m0f));
                __m256i hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), m0f));
                __m256i p = _mm256_add_epi32(_mm256_madd_epi16(lo, x0), _mm256_madd_epi16(hi, x1));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(sf[r][g]), acc[r]);
            }
        }
    } else {
        /* int32 lane k of a madd over 16 codes holds values 2k, 2k+1: one group of 16 */
        for (int c = 0; c < d; c += 16) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + c));
            const int g = c / m->group;
            for (int r = 0; r < 4; r++) {
                __m256i q = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(m->codes + (size_t)j[r] * m->stride + c)));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(q, xv)), _mm256_set1_ps(sf[r][g]), acc[r]);
            }
        }
    }
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
#endif

/* Ask for a row's bytes (codes, scales, zeros) ahead of use: decode is bound by memory
 * bandwidth, and a sparse row set jumps where the hardware prefetcher cannot follow. */
static inline void prefetch_row(const pi_mat *m, int d, int j) {
    const size_t row = m->bits == 4 ? (size_t)d / 2 : (size_t)d;
    const char *p = (const char *)m->codes + (size_t)j * m->stride;
    for (size_t o = 0; o < row; o += 64) __builtin_prefetch(p + o);
    __builtin_prefetch(m->scale + (size_t)j * m->sstride);
    __builtin_prefetch(m->zero + (size_t)j * m->sstride);
}

/* out[i] = row_dot of rows j[i], i < k: four at a time where the CPU has AVX2. */
static void row_dots(const pi_mat *m, int d, const int32_t *j, int k, const int16_t *xq, const float *xd, const float *xs, float *out) {
    int i = 0;
    for (int a = 0; a < k && a < 4; a++) prefetch_row(m, d, j[a]);
#ifdef PI_AVX2
    for (; i < k; i += 4) {
        for (int a = i + 4; a < k && a < i + 8; a++) prefetch_row(m, d, j[a]);
        if (i + 4 <= k) {
            row_dot4(m, d, j + i, xq, xd, xs, out + i);
        } else { /* the last 1-3 rows: pad with the last one (the same row dotted twice costs little) */
            int32_t jj[4];
            float o[4];
            for (int a = 0; a < 4; a++) jj[a] = j[i + a < k ? i + a : k - 1];
            row_dot4(m, d, jj, xq, xd, xs, o);
            for (int a = 0; i + a < k; a++) out[i + a] = o[a];
        }
    }
#else
    for (; i < k; i++) out[i] = row_dot(m, d, j[i], xq, xd, xs);
#endif
}

static inline void prefetch_down(const pi_mat *m, int d, int j) {
    const size_t row = m->bits == 4 ? (size_t)d / 2 : (size_t)d;
    const char *p = (const char *)m->codes + (size_t)j * m->stride;
    for (size_t o = 0; o < row; o += 64) __builtin_prefetch(p + o);
}

/* y [d] += scale[u] * sum_k h_k * row(idx_k) + zero[u] * sum_k h_k over one unit's active neurons. */
static void down_unit(const pi_mat *m, int d, int u, const int32_t *idx, const float *h, int k, float *y) {
    const uint16_t *sc = m->scale + (size_t)u * m->sstride, *zr = m->zero + (size_t)u * m->sstride;
    float hsum = 0.0f;
    for (int a = 0; a < k; a++) hsum += h[a];
#ifdef PI_AVX2
    /* rows outer, so each active row streams through once (a chunk-outer order touches all k
     * rows per 32 outputs, and the strided misses cost ~3x in a memory-bound decode);
     * acc [d] stays in L1 */
    float acc[8192] __attribute__((aligned(32)));
    memset(acc, 0, sizeof(float) * (size_t)d);
    const __m128i m0f = _mm_set1_epi8(0x0f);
    for (int a = 0; a < k && a < 2; a++) prefetch_down(m, d, idx[a]);
    for (int a = 0; a < k; a++) {
        if (a + 2 < k) prefetch_down(m, d, idx[a + 2]);
        const __m256 hv = _mm256_set1_ps(h[a]);
        if (m->bits == 4) {
            const uint8_t *p = m->codes + (size_t)idx[a] * m->stride;
            for (int c = 0; c < d; c += 32) {
                __m128i b = _mm_loadu_si128((const __m128i *)(p + c / 2));
                __m128i lo = _mm_and_si128(b, m0f), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m0f);
                float *o = acc + c;
                _mm256_store_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), hv, _mm256_load_ps(o)));
                _mm256_store_ps(o + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), hv, _mm256_load_ps(o + 8)));
                _mm256_store_ps(o + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), hv, _mm256_load_ps(o + 16)));
                _mm256_store_ps(o + 24, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), hv, _mm256_load_ps(o + 24)));
            }
        } else {
            const int8_t *p = (const int8_t *)m->codes + (size_t)idx[a] * m->stride;
            for (int c = 0; c < d; c += 8) {
                __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + c))));
                _mm256_store_ps(acc + c, _mm256_fmadd_ps(v, hv, _mm256_load_ps(acc + c)));
            }
        }
    }
    const __m256 hs = _mm256_set1_ps(hsum);
    for (int c = 0; c < d; c += 8) {
        __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + c)));
        __m256 zv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(zr + c)));
        _mm256_storeu_ps(y + c, _mm256_add_ps(_mm256_loadu_ps(y + c), _mm256_fmadd_ps(sv, _mm256_load_ps(acc + c), _mm256_mul_ps(zv, hs))));
    }
#else
    float acc[32];
    for (int c = 0; c < d; c += 32) {
        memset(acc, 0, sizeof acc);
        for (int a = 0; a < k; a++) {
            if (m->bits == 4) {
                const uint8_t *p = m->codes + (size_t)idx[a] * m->stride + c / 2;
                for (int b = 0; b < 16; b++) {
                    acc[b] += (float)(p[b] & 15) * h[a];
                    acc[b + 16] += (float)(p[b] >> 4) * h[a];
                }
            } else {
                const int8_t *p = (const int8_t *)m->codes + (size_t)idx[a] * m->stride + c;
                for (int b = 0; b < 32; b++) acc[b] += (float)p[b] * h[a];
            }
        }
        for (int b = 0; b < 32; b++) y[c + b] += h2f(sc[c + b]) * acc[b] + h2f(zr[c + b]) * hsum;
    }
#endif
}

/* Group sums of x [d] for groups of g: out [d / g]. */
static void group_sums(const float *x, int d, int g, float *out) {
    for (int i = 0; i < d / g; i++) {
        float s = 0.0f;
        for (int k = 0; k < g; k++) s += x[i * g + k];
        out[i] = s;
    }
}

/* Per token: group sums of x for gate's and up's groups, and x quantized to int8 per 32. */
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
} pi_call;

/* The active neurons of unit u for token t: idx[k] and h[k] = act(gate) * up, returns k. */
static int unit_active(const pi_call *c, int u, int t, const int16_t *xqt, const float *xdt, const float *xs_gt, const float *xs_ut,
                       int32_t *idx, float *h) {
    const int ug = c->down.group, n = c->n, d = c->d, mode = c->mode, j0 = u * ug;
    const float thr = c->thr;
    float a[64], gv[64], uv[64];
    int k = 0;
    if (mode == PI_GIVEN_GATE || mode == PI_GIVEN_H) {
        /* the caller computed act(gate) (and up) densely: select, then read only the active up rows */
        const float *at = c->given_a + (size_t)t * n + j0;
        for (int i = 0; i < ug; i++) {
            if (!(fabsf(at[i]) > thr)) continue;
            idx[k] = j0 + i;
            h[k++] = mode == PI_GIVEN_H ? c->given_h[(size_t)t * n + j0 + i] : at[i];
        }
        if (mode == PI_GIVEN_GATE) {
            row_dots(&c->up, d, idx, k, xqt, xdt, xs_ut, uv);
            for (int i = 0; i < k; i++) h[i] *= uv[i];
        }
        return k;
    }
    /* act(gate) of the unit's candidates (all, or the masked ones), activated 8 at a time */
    const uint8_t *mt = mode == PI_MASK ? c->mask + (size_t)t * n + j0 : NULL;
    int cand = 0;
    for (int i = 0; i < ug; i++)
        if (!mt || mt[i]) idx[cand++] = j0 + i;
    if (!cand) return 0;
    row_dots(&c->gate, d, idx, cand, xqt, xdt, xs_gt, gv);
    for (int i = 0; i < ug; i++) a[i] = 0.0f;
    for (int i = 0; i < cand; i++) a[idx[i] - j0] = gv[i];
    act_inplace(a, ug, c->act);
    /* the active ones: |act(gate)| > thr (gate mode), or every candidate */
    for (int i = 0; i < cand; i++) {
        const float ai = a[idx[i] - j0];
        if (mode == PI_GATE && !(fabsf(ai) > thr)) continue;
        idx[k] = idx[i];
        h[k++] = ai;
    }
    row_dots(&c->up, d, idx, k, xqt, xdt, xs_ut, uv);
    int kept = 0;
    for (int i = 0; i < k; i++) {
        const float hv = h[i] * uv[i];
        if (mode == PI_ORACLE && !(fabsf(hv) > thr)) continue;
        idx[kept] = idx[i];
        h[kept++] = hv;
    }
    return kept;
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
        int32_t idx[64];
        float h[64];
        const int u0 = (int)((int64_t)units * p / parts), u1 = (int)((int64_t)units * (p + 1) / parts);
        for (int u = u0; u < u1; u++) {
            for (int t = 0; t < T; t++) {
                const int k = unit_active(c, u, t, xq + (size_t)t * d, xd + (size_t)t * (d / 32), xs_g + (size_t)t * (d / gate->group),
                                          xs_u + (size_t)t * (d / up->group), idx, h);
                counts[(size_t)p * T + t] += k;
                if (k) down_unit(&c->down, d, u, idx, h, k, scratch + ((size_t)p * T + t) * d);
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
void pi_ffn_acts(const float *x, int T, int d, int n, const pi_mat *gate, const pi_mat *up, int act, float *g, float *h,
                 float *scratch) {
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
            act_inplace(a, 8, act);
            for (int i = 0; i < m; i++) {
                g[(size_t)t * n + j0 + i] = a[i];
                h[(size_t)t * n + j0 + i] = a[i] * row_dot(up, d, j0 + i, xqt, xdt, xs_u + (size_t)t * (d / up->group));
            }
        }
    }
}

/* Threads of the OpenMP runtime this library resolved (native.py checks it is torch's). */
int pi_max_threads(void) {
#ifdef _OPENMP
    extern int omp_get_max_threads(void);
    return omp_get_max_threads();
#else
    return 1;
#endif
}
