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

/* Units per block: a block's selected neurons are finished together (finish_block), so up and
 * down are walked in runs of 8 units rather than one (SmolLM2, 30 layers out of cache: 200 -> 126
 * µs a layer with 4 and 8; 1.1B at 15% active: 1661 -> 1432 µs all, 600 -> 558 given_gate). */
#define PI_BLOCK 8

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
    act_inplace(a, ug, c->act);
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
        act_inplace(h, (k + 7) & ~7, c->act);
    }
    if (mode != PI_GIVEN_H) {
        row_dots(&c->up, d, idx, k, xqt, xdt, xs_ut, uv);
        for (int i = 0; i < k; i++) h[i] *= uv[i];
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
