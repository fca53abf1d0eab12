/* Per-row arithmetic of the native sparse FFN kernel: the weight layout (pi_mat), x held as
 * int16, gate/up row dot products, the down projection of one unit of neurons, prefetching.
 *
 * Runs in: the process that loads sparse_ffn.c (which includes this file; native.py compiles
 * them as one translation unit). The layouts and the arithmetic are described in sparse_ffn.c.
 */
#ifndef PI_ROWS_H
#define PI_ROWS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "half.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PI_AVX2 1
#endif

typedef struct {
    const uint8_t *codes;   /* 4-bit packed or int8, see above; row j at codes + j * stride */
    const uint16_t *scale;  /* float16; row (gate/up) or unit (down) j at scale + j * sstride */
    const uint16_t *zero;   /* float16, same strides as scale; NULL: zero = zk * scale (Q4_0: -8, int8: 0) */
    int64_t stride;         /* bytes from one row's codes to the next */
    int64_t sstride;        /* float16 elements from one row's (unit's) scales to the next */
    int32_t bits;           /* 4 or 8 */
    int32_t group;          /* 4-bit: 32; 8-bit: 16 or 32 */
    float zk;               /* the zeros' multiple of the scales when zero is NULL */
} pi_mat;

/* Row j's codes. */
static inline const uint8_t *row_ptr(const pi_mat *m, int j) {
    return m->codes + (size_t)j * m->stride;
}

__attribute__((unused)) static float h2f(uint16_t h) { return half_to_float(h); }

#include "exp8.h"
#include "act.h"

/* act(g) in place for k gate values (k a multiple of 8; act.h's codes, thr FATReLU's threshold):
 * silu, or gelu's tanh form written as g * sigmoid(2z) (tanh(z) = 2 sigmoid(2z) - 1), so both
 * need only e^x; the ReLU family keeps g where g > thr (dReLU: thr 0; its up is rectified where
 * the up value multiplies, up_act). */
static void act_inplace(float *g, int k, int act, float thr) {
    if (act >= PI_ACT_RELU) {
        for (int i = 0; i < k; i++) g[i] = act_gate(g[i], act, thr);
        return;
    }
#ifdef PI_AVX2
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int i = 0; i < k; i += 8) {
        __m256 v = _mm256_loadu_ps(g + i), z = v;
        if (act == PI_ACT_GELU) {
            __m256 v3 = _mm256_mul_ps(_mm256_mul_ps(v, v), v);
            z = _mm256_mul_ps(_mm256_set1_ps(2.0f * 0.7978845608028654f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), v3, v));
        }
        _mm256_storeu_ps(g + i, _mm256_div_ps(v, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), z)))));
    }
#else
    for (int i = 0; i < k; i++) g[i] = act_gate(g[i], act, thr);
#endif
}

/* x [d] -> int16 codes xq [d] and one scale per 32 values xd [d / 32]: the row dots below are
 * then integer multiply-adds (madd_epi16), and 16 bits keep x to ~1.5e-5 of each block's largest
 * value (8-bit codes, as llama.cpp uses, measured ~5x the output error of the bf16 torch path). */
static void quantize_x(const float *x, int d, int16_t *xq, float *xd) {
    for (int b = 0; b < d / 32; b++) {
        const float *xb = x + b * 32;
        float amax = 0.0f;
        for (int k = 0; k < 32; k++) amax = fabsf(xb[k]) > amax ? fabsf(xb[k]) : amax;
        const float s = amax / 32767.0f, inv = s > 0.0f ? 1.0f / s : 0.0f;
        xd[b] = s;
        for (int k = 0; k < 32; k++) xq[b * 32 + k] = (int16_t)lrintf(xb[k] * inv);
    }
}

/* Row j of gate/up dotted with x, given as xq/xd (quantize_x) and its float group sums xs
 * [d / group] (for the zeros): sum_g scale_g * xd * sum(q * xq) + zero_g * xs_g. Portable form. */
static float row_dot(const pi_mat *m, int d, int j, const int16_t *xq, const float *xd, const float *xs) {
    const int ng = d / m->group, gs = m->group;
    const uint16_t *sc = m->scale + (size_t)j * m->sstride, *zr = m->zero ? m->zero + (size_t)j * m->sstride : NULL;
    float tot = 0.0f;
    for (int g = 0; g < ng; g++) {
        int64_t a = 0;
        for (int k = 0; k < gs; k++) {
            const int pos = g * gs + k;
            int q;
            if (m->bits == 4) {
                const uint8_t byte = row_ptr(m, j)[(pos / 32) * 16 + (pos % 16)];
                q = (pos % 32) < 16 ? (byte & 15) : (byte >> 4);
            } else {
                q = ((const int8_t *)row_ptr(m, j))[pos];
            }
            a += (int64_t)q * xq[pos];
        }
        tot += (float)a * (h2f(sc[g]) * xd[(g * gs) / 32]) + (zr ? h2f(zr[g]) : m->zk * h2f(sc[g])) * xs[g];
    }
    return tot;
}

/* Ask for a row's bytes (codes, scales, zeros) ahead of use. Decode streams the weights once,
 * faster than the hardware prefetcher ramps up at each 4 KiB page and each jump of a sparse row
 * set, so every row loop asks for the row PI_AHEAD bytes ahead of the one it computes. */
#define PI_AHEAD 2048
static inline void prefetch_bytes(const void *p, size_t n) {
    for (size_t o = 0; o < n; o += 64) __builtin_prefetch((const char *)p + o);
}
static inline size_t row_bytes(const pi_mat *m, int d) { return m->bits == 4 ? (size_t)d / 2 : (size_t)d; }
static inline void prefetch_row(const pi_mat *m, int d, int j) {
    prefetch_bytes(row_ptr(m, j), row_bytes(m, d));
    __builtin_prefetch(m->scale + (size_t)j * m->sstride);
    if (m->zero) __builtin_prefetch(m->zero + (size_t)j * m->sstride);
}
/* How many rows ahead PI_AHEAD bytes is (at least 2). */
static inline int rows_ahead(const pi_mat *m, int d) {
    const int r = (int)(PI_AHEAD / row_bytes(m, d));
    return r < 2 ? 2 : r;
}

#ifdef PI_AVX2
/* row_dot of row j with AVX2. One row at a time, start to end: a run of rows is then one
 * sequential stream, which the hardware prefetcher follows at full bandwidth; four rows
 * interleaved (sharing each x load) ran at ~half of it once the weights were out of cache
 * (1.1B gate matrix, 8 layers: 780 vs 390 µs). Four accumulators hide the multiply-add latency. */
static float row_dot1(const pi_mat *m, int d, int j, const int16_t *xq, const float *xd, const float *xs) {
    const int ng = d / m->group;
    const uint16_t *sc = m->scale + (size_t)j * m->sstride, *zr = m->zero ? m->zero + (size_t)j * m->sstride : NULL;
    float sf[512] __attribute__((aligned(32)));  /* each group's scale times its x block's scale */
    __m256 zt = _mm256_setzero_ps();
    int g8 = 0;
    if (m->group == 32) {
        const __m256 zk = _mm256_set1_ps(m->zk);
        for (; g8 + 8 <= ng; g8 += 8) {
            const __m256 s8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + g8)));
            const __m256 z8 = zr ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(zr + g8))) : _mm256_mul_ps(s8, zk);
            _mm256_store_ps(sf + g8, _mm256_mul_ps(s8, _mm256_loadu_ps(xd + g8)));
            zt = _mm256_fmadd_ps(z8, _mm256_loadu_ps(xs + g8), zt);
        }
    }
    float zs = 0.0f;
    for (; g8 < ng; g8++) {
        const float s1 = _cvtsh_ss(sc[g8]);
        sf[g8] = s1 * xd[(g8 * m->group) / 32];
        zs += (zr ? _cvtsh_ss(zr[g8]) : m->zk * s1) * xs[g8];
    }
    /* four accumulators, unrolled by hand so they stay in registers */
    __m256 a0 = zt, a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    const uint8_t *row = row_ptr(m, j);
    if (m->bits == 4) {
        const __m128i m0f = _mm_set1_epi8(0x0f);
#define PI_Q4_GROUP(g, acc)                                                                                                 \
    do {                                                                                                                    \
        const __m128i b = _mm_loadu_si128((const __m128i *)(row + (g) * 16));                                               \
        const __m256i lo = _mm256_cvtepu8_epi16(_mm_and_si128(b, m0f));                                                     \
        const __m256i hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), m0f));                                  \
        const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)(xq + (g) * 32))),    \
                                           _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xq + (g) * 32 + 16)))); \
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(sf + (g)), acc);                                   \
    } while (0)
        int g = 0;
        for (; g + 4 <= ng; g += 4) {
            PI_Q4_GROUP(g, a0);
            PI_Q4_GROUP(g + 1, a1);
            PI_Q4_GROUP(g + 2, a2);
            PI_Q4_GROUP(g + 3, a3);
        }
        for (; g < ng; g++) PI_Q4_GROUP(g, a0);
#undef PI_Q4_GROUP
    } else {
        /* int32 lane k of a madd over 16 codes holds values 2k, 2k+1: one group of 16 */
#define PI_Q8_CHUNK(c, acc)                                                                                                  \
    do {                                                                                                                     \
        const __m256i q = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + (c))));                               \
        const __m256i p = _mm256_madd_epi16(q, _mm256_loadu_si256((const __m256i *)(xq + (c))));                             \
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(sf + (c) / m->group), acc);                         \
    } while (0)
        int c = 0;
        for (; c + 64 <= d; c += 64) {
            PI_Q8_CHUNK(c, a0);
            PI_Q8_CHUNK(c + 16, a1);
            PI_Q8_CHUNK(c + 32, a2);
            PI_Q8_CHUNK(c + 48, a3);
        }
        for (; c < d; c += 16) PI_Q8_CHUNK(c, a0);
#undef PI_Q8_CHUNK
    }
    const __m256 s = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_movehdup_ps(v));
    return _mm_cvtss_f32(v) + zs;
}
#endif

/* out[i] = row_dot of rows j[i], i < k. Past the end of the list the prefetch guesses the rows
 * that follow j[k - 1] (the next unit's, which a dense gate pass reads next). */
static void row_dots(const pi_mat *m, int d, const int32_t *j, int k, const int16_t *xq, const float *xd, const float *xs, float *out) {
    const int ahead = rows_ahead(m, d);
    /* a dense-ish list (over half the rows it spans) is asked for by position, gaps included:
     * the hardware prefetchers stream the gaps' bytes anyway, and a stream that the software
     * prefetches break stalls more (SmolLM2, 80% active, out of cache: gate mode 110 -> 106 µs) */
    const int seq = k > 0 && 2 * k > j[k - 1] - j[0] + 1;
    for (int i = 0; i < k; i++) {
        prefetch_row(m, d, seq ? j[i] + ahead : i + ahead < k ? j[i + ahead] : j[k - 1] + (i + ahead - k + 1));
#ifdef PI_AVX2
        out[i] = row_dot1(m, d, j[i], xq, xd, xs);
#else
        out[i] = row_dot(m, d, j[i], xq, xd, xs);
#endif
    }
}

/* y [d] += scale[u] * sum_k h_k * row(idx_k) + zero[u] * sum_k h_k over one unit's active neurons
 * (see the header: h as int16 codes with one scale, integer sums, the scales applied once).
 * next[knext]: the rows the following call will read, asked for once this list runs out. */
static void down_unit(const pi_mat *m, int d, int u, const int32_t *idx, const float *h, int k, const int32_t *next, int knext, float *y) {
    const uint16_t *sc = m->scale + (size_t)u * m->sstride, *zr = m->zero ? m->zero + (size_t)u * m->sstride : NULL;
    float hsum = 0.0f, hmax = 0.0f;
    for (int a = 0; a < k; a++) {
        hsum += h[a];
        const float v = fabsf(h[a]);
        hmax = v > hmax ? v : hmax;  /* not fmaxf: a libm call at -O3 without -ffast-math */
    }
    const float hs = hmax / 32767.0f, inv = hs > 0.0f ? 1.0f / hs : 0.0f;
    int16_t hq[66];
    int32_t rows[66];
    for (int a = 0; a < k; a++) {
        hq[a] = (int16_t)lrintf(h[a] * inv);
        rows[a] = idx[a];
    }
    if (k & 1) { /* an odd count: pair the last row with itself at weight 0 */
        hq[k] = 0;
        rows[k] = idx[k - 1];
    }
    const int kp = (k + 1) & ~1, ahead = rows_ahead(m, d), seq = 2 * k > m->group;
    /* the unit's scales and zeros are read last: ask for them first */
    prefetch_bytes(sc, sizeof(uint16_t) * (size_t)d);
    if (zr) prefetch_bytes(zr, sizeof(uint16_t) * (size_t)d);
    int32_t acc[8192] __attribute__((aligned(32)));
    memset(acc, 0, sizeof(int32_t) * (size_t)d);
#ifdef PI_AVX2
    /* rows outer (each active row streams through once, acc [d] stays in L1), two rows per pass:
     * their codes interleaved byte by byte are the int16 pairs one madd_epi16 multiplies by
     * (hq_a, hq_b) and sums, so a pass costs about half the float version's operations. Sums
     * stay in int32: at most 64 rows * 128 * 32767 < 2^31. */
    const __m128i m0f = _mm_set1_epi8(0x0f);
    for (int a = 0; a < kp; a += 2) {
        if (seq) {  /* as in row_dots: a dense-ish unit is asked for by position */
            for (int r = rows[a] + ahead; r <= rows[a + 1] + ahead; r++) prefetch_bytes(row_ptr(m, r), row_bytes(m, d));
        } else {
            for (int b = a + ahead; b < a + ahead + 2; b++) {
                if (b < kp) prefetch_bytes(row_ptr(m, rows[b]), row_bytes(m, d));
                else if (b - kp < knext) prefetch_bytes(row_ptr(m, next[b - kp]), row_bytes(m, d));
            }
        }
        const __m256i hv = _mm256_set1_epi32((int32_t)((uint32_t)(uint16_t)hq[a] | ((uint32_t)(uint16_t)hq[a + 1] << 16)));
        if (m->bits == 4) {
            const uint8_t *p0 = row_ptr(m, rows[a]), *p1 = row_ptr(m, rows[a + 1]);
            for (int c = 0; c < d; c += 32) {
                const __m128i b0 = _mm_loadu_si128((const __m128i *)(p0 + c / 2)), b1 = _mm_loadu_si128((const __m128i *)(p1 + c / 2));
                const __m128i lo0 = _mm_and_si128(b0, m0f), lo1 = _mm_and_si128(b1, m0f);  /* values c .. c + 15 */
                const __m128i hi0 = _mm_and_si128(_mm_srli_epi16(b0, 4), m0f), hi1 = _mm_and_si128(_mm_srli_epi16(b1, 4), m0f);
                __m256i *o = (__m256i *)(acc + c);
                o[0] = _mm256_add_epi32(o[0], _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(lo0, lo1)), hv));
                o[1] = _mm256_add_epi32(o[1], _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_unpackhi_epi8(lo0, lo1)), hv));
                o[2] = _mm256_add_epi32(o[2], _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(hi0, hi1)), hv));
                o[3] = _mm256_add_epi32(o[3], _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_unpackhi_epi8(hi0, hi1)), hv));
            }
        } else {
            const int8_t *p0 = (const int8_t *)row_ptr(m, rows[a]), *p1 = (const int8_t *)row_ptr(m, rows[a + 1]);
            for (int c = 0; c < d; c += 16) {
                const __m128i b0 = _mm_loadu_si128((const __m128i *)(p0 + c)), b1 = _mm_loadu_si128((const __m128i *)(p1 + c));
                __m256i *o = (__m256i *)(acc + c);
                o[0] = _mm256_add_epi32(o[0], _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_unpacklo_epi8(b0, b1)), hv));
                o[1] = _mm256_add_epi32(o[1], _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_unpackhi_epi8(b0, b1)), hv));
            }
        }
    }
    const __m256 hsv = _mm256_set1_ps(hsum), hqs = _mm256_set1_ps(hs), zk = _mm256_set1_ps(m->zk);
    for (int c = 0; c < d; c += 8) {
        const __m256 s8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + c)));
        const __m256 sv = _mm256_mul_ps(s8, hqs);
        const __m256 zv = zr ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(zr + c))) : _mm256_mul_ps(s8, zk);
        const __m256 s = _mm256_cvtepi32_ps(_mm256_load_si256((const __m256i *)(acc + c)));
        _mm256_storeu_ps(y + c, _mm256_add_ps(_mm256_loadu_ps(y + c), _mm256_fmadd_ps(sv, s, _mm256_mul_ps(zv, hsv))));
    }
#else
    for (int a = 0; a < kp; a++) {
        for (int c = 0; c < d; c++) {
            int q;
            if (m->bits == 4) {
                const uint8_t byte = row_ptr(m, rows[a])[(c / 32) * 16 + (c % 16)];
                q = (c % 32) < 16 ? (byte & 15) : (byte >> 4);
            } else {
                q = ((const int8_t *)row_ptr(m, rows[a]))[c];
            }
            acc[c] += q * hq[a];
        }
    }
    for (int c = 0; c < d; c++) y[c] += h2f(sc[c]) * hs * (float)acc[c] + (zr ? h2f(zr[c]) : m->zk * h2f(sc[c])) * hsum;
#endif
}

#endif /* PI_ROWS_H */
