/* Quantized dot products on the GGUF file's own blocks, one per tensor type, against activations
 * quantized on the fly to 8-bit blocks of 32 (llama.cpp pairs q4_0 with q8_0 the same way).
 *
 * Runs in: the process that loads decoder.c (which includes this file); native_model.py compiles
 * it once per instruction set: PI_VNNI (AVX-512 VL + VNNI on 256-bit vectors), PI_AVX2 (AVX2 +
 * FMA + F16C) or neither (portable C), and picks the build from the CPU's features at run time.
 *
 * Activations (pi_act, one row of K values per token):
 *   q  int8 [K]       round(x / d) per block of 32, d = max|x| / 127 (round half to even)
 *   d  float [K / 32] the block scales
 *   s  float [K / 32] d times the block sum of q, i.e. the block's sum of x as rounded (for the
 *      types whose weights carry an offset: offset * s is that part of the block's dot product)
 *   f  float [K]      x itself, for float weights (F32, F16, BF16)
 * A weight block's value w = scale * q_w (+ offset); the dot product of a block of 32 is then
 * scale * d_x * sum(q_w q_x) + offset * s_x, with the integer sum done in SIMD.
 * K-quants (super-blocks of 256) are met with 8 activation blocks of 32 each, one per sub-block
 * of Q4_K / Q5_K and two sub-blocks of Q6_K: the scales are the file's, applied per sub-block.
 */
#ifndef PI_QDOT_H
#define PI_QDOT_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(PI_AVX2) || defined(PI_VNNI)
#include <immintrin.h>
#define PI_SIMD 1
#endif

/* GGML type ids (ggml.h) */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
       T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30 };

typedef struct {
    const int8_t *q;
    const float *d;
    const float *s;
    const float *f;
} pi_act;

static inline float h2f(uint16_t h) {
#ifdef PI_SIMD
    return _cvtsh_ss(h);
#else
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
#endif
}

static inline float ld_h(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return h2f(h); }

static inline float bf2f(uint16_t h) { uint32_t b = (uint32_t)h << 16; float f; memcpy(&f, &b, 4); return f; }

/* Quantize x [K] (K % 32 == 0) into q, d, s. */
static void quantize_act(const float *x, int K, int8_t *q, float *d, float *s) {
    for (int b = 0; b < K / 32; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xb[i]));
        float db = amax / 127.0f, id = db > 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
#ifdef PI_SIMD
        __m256 vid = _mm256_set1_ps(id);
        __m256i acc = _mm256_setzero_si256();
        for (int i = 0; i < 32; i += 8) {
            __m256i v = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + i), vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            acc = _mm256_add_epi32(acc, v);
            int32_t tmp[8];
            _mm256_storeu_si256((__m256i *)tmp, v);
            for (int k = 0; k < 8; k++) q[32 * b + i + k] = (int8_t)tmp[k];
        }
        int32_t t8[8];
        _mm256_storeu_si256((__m256i *)t8, acc);
        for (int k = 0; k < 8; k++) sum += t8[k];
#else
        for (int i = 0; i < 32; i++) {
            int v = (int)nearbyintf(xb[i] * id);
            q[32 * b + i] = (int8_t)v;
            sum += v;
        }
#endif
        d[b] = db;
        s[b] = db * (float)sum;
    }
}

/* Q4_K / Q5_K 6-bit scale and min of sub-block j (llama.cpp's get_scale_min_k4). */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

#ifdef PI_SIMD
/* 8 int32 sums of 4 products u8 * s8 each. */
static inline __m256i dot_us(__m256i u, __m256i s) {
#ifdef PI_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline __m256i nibbles16(const uint8_t *p) { /* 16 bytes -> 32 values: low nibbles, then high */
    __m128i t = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
}

static inline __m256i bits32(const uint8_t *p) { /* bit i of 4 bytes -> byte i = 0xFF or 0 */
    uint32_t x32;
    memcpy(&x32, p, 4);
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x32), shuf);
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

static inline float hsum8(__m256 v) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}
#endif

/* ---- float helpers of the decoder: dot products, e^x, activations ---- */

#ifdef PI_SIMD
/* e^x for 8 floats (Cephes' polynomial; relative error ~2e-7, inputs clamped to +-88). */
static inline __m256 exp8(__m256 x) {
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

/* a . b over n floats (SIMD: 8-wide partial sums, so the order differs from the C loop's). */
static inline float dotf(const float *a, const float *b, int n) {
    int i = 0;
    float s = 0.0f;
#ifdef PI_SIMD
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), a1);
    }
    for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
    s = hsum8(_mm256_add_ps(a0, a1));
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* x[i] = e^(x[i] - mx) for n floats; returns their sum. */
static inline float exp_sub_sum(float *x, int n, float mx) {
    int i = 0;
    float s = 0.0f;
#ifdef PI_SIMD
    __m256 acc = _mm256_setzero_ps(), m = _mm256_set1_ps(mx);
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), m));
        _mm256_storeu_ps(x + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    s = hsum8(acc);
#endif
    for (; i < n; i++) {
        x[i] = expf(x[i] - mx);
        s += x[i];
    }
    return s;
}

/* g[i] = act(g[i]) * u[i]: silu (act 0), or ggml's tanh-form gelu (act 1) written as
 * g * sigmoid(2z) since tanh(z) = 2 sigmoid(2z) - 1, so both need only e^x. */
static inline void act_mul(float *g, const float *u, int n, int act) {
    int i = 0;
#ifdef PI_SIMD
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(g + i), z = v;
        if (act == 1) { /* 2z = 2 * 0.79788456 * (v + 0.044715 v^3) */
            __m256 v3 = _mm256_mul_ps(_mm256_mul_ps(v, v), v);
            z = _mm256_mul_ps(_mm256_set1_ps(1.5957691216057308f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), v3, v));
        }
        __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), z))));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_mul_ps(v, sig), _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) {
        float v = g[i], z = act == 1 ? 1.5957691216057308f * (v + 0.044715f * v * v * v) : v;
        g[i] = v / (1.0f + expf(-z)) * u[i];
    }
}

/* ---- 32-element block types: Q4_0 (18 B), Q4_1 (20 B), Q5_0 (22 B), Q5_1 (24 B), Q8_0 (34 B) ---- */

static float dot_q4_0(const uint8_t *w, const pi_act *x, int K) {
    float corr = 0.0f;
#ifdef PI_SIMD
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < K / 32; b++, w += 18) {
        float dd = ld_h(w) * x->d[b];
        __m256i v = nibbles16(w + 2);
        __m256i xq = _mm256_loadu_si256((const __m256i *)(x->q + 32 * b));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_us(v, xq)), _mm256_set1_ps(dd), acc);
        corr += ld_h(w) * x->s[b];
    }
    return hsum8(acc) - 8.0f * corr;
#else
    float acc = 0.0f;
    for (int b = 0; b < K / 32; b++, w += 18) {
        float dd = ld_h(w) * x->d[b];
        const int8_t *xq = x->q + 32 * b;
        int32_t sum = 0;
        for (int i = 0; i < 16; i++) sum += (w[2 + i] & 0xF) * xq[i] + (w[2 + i] >> 4) * xq[i + 16];
        acc += dd * (float)sum;
        corr += ld_h(w) * x->s[b];
    }
    return acc - 8.0f * corr;
#endif
}

static float dot_q4_1(const uint8_t *w, const pi_act *x, int K) {
    float corr = 0.0f;
#ifdef PI_SIMD
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < K / 32; b++, w += 20) {
        float dd = ld_h(w) * x->d[b];
        __m256i v = nibbles16(w + 4);
        __m256i xq = _mm256_loadu_si256((const __m256i *)(x->q + 32 * b));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_us(v, xq)), _mm256_set1_ps(dd), acc);
        corr += ld_h(w + 2) * x->s[b];
    }
    return hsum8(acc) + corr;
#else
    float acc = 0.0f;
    for (int b = 0; b < K / 32; b++, w += 20) {
        float dd = ld_h(w) * x->d[b];
        const int8_t *xq = x->q + 32 * b;
        int32_t sum = 0;
        for (int i = 0; i < 16; i++) sum += (w[4 + i] & 0xF) * xq[i] + (w[4 + i] >> 4) * xq[i + 16];
        acc += dd * (float)sum;
        corr += ld_h(w + 2) * x->s[b];
    }
    return acc + corr;
#endif
}

/* Q5_0: f16 d, qh[4] (bit i = bit 4 of value i), qs[16]; value = d * (q - 16). */
static float dot_q5_0(const uint8_t *w, const pi_act *x, int K) {
    float corr = 0.0f;
#ifdef PI_SIMD
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < K / 32; b++, w += 22) {
        float dd = ld_h(w) * x->d[b];
        __m256i v = _mm256_or_si256(nibbles16(w + 6), _mm256_and_si256(bits32(w + 2), _mm256_set1_epi8(0x10)));
        __m256i xq = _mm256_loadu_si256((const __m256i *)(x->q + 32 * b));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_us(v, xq)), _mm256_set1_ps(dd), acc);
        corr += ld_h(w) * x->s[b];
    }
    return hsum8(acc) - 16.0f * corr;
#else
    float acc = 0.0f;
    for (int b = 0; b < K / 32; b++, w += 22) {
        float dd = ld_h(w) * x->d[b];
        uint32_t qh;
        memcpy(&qh, w + 2, 4);
        const int8_t *xq = x->q + 32 * b;
        int32_t sum = 0;
        for (int i = 0; i < 16; i++) {
            int lo = (w[6 + i] & 0xF) | (((qh >> i) & 1) << 4), hi = (w[6 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
            sum += lo * xq[i] + hi * xq[i + 16];
        }
        acc += dd * (float)sum;
        corr += ld_h(w) * x->s[b];
    }
    return acc - 16.0f * corr;
#endif
}

/* Q5_1: f16 d, f16 m, qh[4], qs[16]; value = d * q + m. */
static float dot_q5_1(const uint8_t *w, const pi_act *x, int K) {
    float corr = 0.0f;
#ifdef PI_SIMD
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < K / 32; b++, w += 24) {
        float dd = ld_h(w) * x->d[b];
        __m256i v = _mm256_or_si256(nibbles16(w + 8), _mm256_and_si256(bits32(w + 4), _mm256_set1_epi8(0x10)));
        __m256i xq = _mm256_loadu_si256((const __m256i *)(x->q + 32 * b));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_us(v, xq)), _mm256_set1_ps(dd), acc);
        corr += ld_h(w + 2) * x->s[b];
    }
    return hsum8(acc) + corr;
#else
    float acc = 0.0f;
    for (int b = 0; b < K / 32; b++, w += 24) {
        float dd = ld_h(w) * x->d[b];
        uint32_t qh;
        memcpy(&qh, w + 4, 4);
        const int8_t *xq = x->q + 32 * b;
        int32_t sum = 0;
        for (int i = 0; i < 16; i++) {
            int lo = (w[8 + i] & 0xF) | (((qh >> i) & 1) << 4), hi = (w[8 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
            sum += lo * xq[i] + hi * xq[i + 16];
        }
        acc += dd * (float)sum;
        corr += ld_h(w + 2) * x->s[b];
    }
    return acc + corr;
#endif
}

static float dot_q8_0(const uint8_t *w, const pi_act *x, int K) {
#ifdef PI_SIMD
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < K / 32; b++, w += 34) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(w + 2));
        __m256i xq = _mm256_loadu_si256((const __m256i *)(x->q + 32 * b));
        /* u8 x s8 only: |w| against x carrying w's sign */
        __m256i p = dot_us(_mm256_sign_epi8(v, v), _mm256_sign_epi8(xq, v));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(ld_h(w) * x->d[b]), acc);
    }
    return hsum8(acc);
#else
    float acc = 0.0f;
    for (int b = 0; b < K / 32; b++, w += 34) {
        const int8_t *wq = (const int8_t *)(w + 2), *xq = x->q + 32 * b;
        int32_t sum = 0;
        for (int i = 0; i < 32; i++) sum += wq[i] * xq[i];
        acc += ld_h(w) * x->d[b] * (float)sum;
    }
    return acc;
#endif
}

/* ---- K-quants, super-blocks of 256 ---- */

/* Q4_K (144 B): f16 d, f16 dmin, scales[12], qs[128]; sub-block j (32 values) = low (j even) or
 * high (j odd) nibbles of qs[32 (j / 2) ...]; value = d sc_j q - dmin m_j. Q5_K (176 B) adds
 * qh[32] before qs: bit j of qh[i] is bit 4 of value i of sub-block j. */
static float dot_qk45(const uint8_t *w, const pi_act *x, int K, int five) {
    const int bytes = five ? 176 : 144;
    float acc_s = 0.0f, corr = 0.0f;
#ifdef PI_SIMD
    __m256 acc = _mm256_setzero_ps();
#endif
    for (int sb = 0; sb < K / 256; sb++, w += bytes) {
        const float d = ld_h(w), dmin = ld_h(w + 2);
        const uint8_t *scales = w + 4, *qh = w + 16, *qs = w + (five ? 48 : 16);
        for (int j = 0; j < 8; j++) {
            int sc, m;
            scale_min_k4(j, scales, &sc, &m);
            const int b = sb * 8 + j;
            const float dx = x->d[b];
            corr += dmin * (float)m * x->s[b];
            const uint8_t *q = qs + 32 * (j / 2);
#ifdef PI_SIMD
            __m256i raw = _mm256_loadu_si256((const __m256i *)q);
            __m256i v = _mm256_and_si256((j & 1) ? _mm256_srli_epi16(raw, 4) : raw, _mm256_set1_epi8(0x0F));
            if (five) {
                __m256i hb = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)qh), j), _mm256_set1_epi8(1));
                v = _mm256_or_si256(v, _mm256_slli_epi16(hb, 4));
            }
            __m256i xq = _mm256_loadu_si256((const __m256i *)(x->q + 32 * b));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_us(v, xq)), _mm256_set1_ps(d * (float)sc * dx), acc);
#else
            const int8_t *xq = x->q + 32 * b;
            int32_t sum = 0;
            for (int i = 0; i < 32; i++) {
                int v = (j & 1) ? (q[i] >> 4) : (q[i] & 0xF);
                if (five) v |= ((qh[i] >> j) & 1) << 4;
                sum += v * xq[i];
            }
            acc_s += d * (float)sc * dx * (float)sum;
#endif
        }
    }
#ifdef PI_SIMD
    acc_s = hsum8(acc);
#endif
    return acc_s - corr;
}

static float dot_q4_k(const uint8_t *w, const pi_act *x, int K) { return dot_qk45(w, x, K, 0); }
static float dot_q5_k(const uint8_t *w, const pi_act *x, int K) { return dot_qk45(w, x, K, 1); }

/* Q6_K (210 B): ql[128], qh[64], int8 scales[16], f16 d; value = d sc_(e / 16) (q - 32), q 6-bit.
 * Element e in half h = e / 128, l = e % 128: low 4 bits are the low (l < 64) or high nibble of
 * ql[64 h + l % 64], the top 2 bits are bits 2 (l / 32) of qh[32 h + l % 32]. */
static float dot_q6_k(const uint8_t *w, const pi_act *x, int K) {
#ifdef PI_SIMD
    __m256 acc = _mm256_setzero_ps();
#else
    float acc = 0.0f;
#endif
    for (int sb = 0; sb < K / 256; sb++, w += 210) {
        const uint8_t *ql = w, *qh = w + 128;
        const int8_t *sc = (const int8_t *)(w + 192);
        const float d = ld_h(w + 208);
        for (int blk = 0; blk < 8; blk++) {
            const int h = blk / 4, s = blk % 4, b = sb * 8 + blk;
            const uint8_t *l = ql + 64 * h + 32 * (s % 2), *hh = qh + 32 * h;
#ifdef PI_SIMD
            __m256i lo = _mm256_loadu_si256((const __m256i *)l);
            lo = _mm256_and_si256(s >= 2 ? _mm256_srli_epi16(lo, 4) : lo, _mm256_set1_epi8(0x0F));
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)hh), 2 * s), _mm256_set1_epi8(3));
            __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
            __m256i xq = _mm256_loadu_si256((const __m256i *)(x->q + 32 * b));
            /* int16 pair sums (lanes 0-7: values 0-15, 8-15: 16-31) times the two sub-scales */
            __m256i scv = _mm256_set_m128i(_mm_set1_epi16(sc[2 * blk + 1]), _mm_set1_epi16(sc[2 * blk]));
            __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(xq, q)), scv);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * x->d[b]), acc);
#else
            const int8_t *xq = x->q + 32 * b;
            int32_t s0 = 0, s1 = 0;
            for (int i = 0; i < 32; i++) {
                int q = ((s >= 2 ? l[i] >> 4 : l[i] & 0xF) | (((hh[i] >> (2 * s)) & 3) << 4)) - 32;
                if (i < 16) s0 += q * xq[i]; else s1 += q * xq[i];
            }
            acc += d * x->d[b] * (float)(sc[2 * blk] * s0 + sc[2 * blk + 1] * s1);
#endif
        }
    }
#ifdef PI_SIMD
    return hsum8(acc);
#else
    return acc;
#endif
}

/* ---- float weights against the float activations ---- */

static float dot_f32(const uint8_t *w, const pi_act *x, int K) {
    const float *wf = (const float *)w;
    float acc = 0.0f;
    int i = 0;
#ifdef PI_SIMD
    __m256 a = _mm256_setzero_ps();
    for (; i + 8 <= K; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(wf + i), _mm256_loadu_ps(x->f + i), a);
    acc = hsum8(a);
#endif
    for (; i < K; i++) acc += wf[i] * x->f[i];
    return acc;
}

static float dot_f16(const uint8_t *w, const pi_act *x, int K) {
    const uint16_t *wh = (const uint16_t *)w;
    float acc = 0.0f;
    int i = 0;
#ifdef PI_SIMD
    __m256 a = _mm256_setzero_ps();
    for (; i + 8 <= K; i += 8)
        a = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wh + i))), _mm256_loadu_ps(x->f + i), a);
    acc = hsum8(a);
#endif
    for (; i < K; i++) acc += h2f(wh[i]) * x->f[i];
    return acc;
}

static float dot_bf16(const uint8_t *w, const pi_act *x, int K) {
    const uint16_t *wh = (const uint16_t *)w;
    float acc = 0.0f;
    int i = 0;
#ifdef PI_SIMD
    __m256 a = _mm256_setzero_ps();
    for (; i + 8 <= K; i += 8) {
        __m256i v = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(wh + i))), 16);
        a = _mm256_fmadd_ps(_mm256_castsi256_ps(v), _mm256_loadu_ps(x->f + i), a);
    }
    acc = hsum8(a);
#endif
    for (; i < K; i++) acc += bf2f(wh[i]) * x->f[i];
    return acc;
}

typedef float (*dot_fn)(const uint8_t *, const pi_act *, int);

/* The registry: a type's dot product and the row length its blocks need (0: unsupported). */
static dot_fn dot_for(int type, int *align) {
    switch (type) {
        case T_F32: *align = 1; return dot_f32;
        case T_F16: *align = 1; return dot_f16;
        case T_BF16: *align = 1; return dot_bf16;
        case T_Q4_0: *align = 32; return dot_q4_0;
        case T_Q4_1: *align = 32; return dot_q4_1;
        case T_Q5_0: *align = 32; return dot_q5_0;
        case T_Q5_1: *align = 32; return dot_q5_1;
        case T_Q8_0: *align = 32; return dot_q8_0;
        case T_Q4_K: *align = 256; return dot_q4_k;
        case T_Q5_K: *align = 256; return dot_q5_k;
        case T_Q6_K: *align = 256; return dot_q6_k;
        default: *align = 0; return 0;
    }
}

#endif
