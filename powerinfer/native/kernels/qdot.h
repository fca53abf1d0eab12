/* Quantized dot products on the GGUF file's own blocks, one per tensor type, against activations
 * quantized on the fly to 8-bit blocks of 32 (llama.cpp pairs q4_0 with q8_0 the same way).
 *
 * Runs in: the process that loads decoder.c (which includes this file); native/decoder.py compiles
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

#include "half.h"
#if defined(PI_AVX2) || defined(PI_VNNI)
#include <immintrin.h>
#define PI_SIMD 1
#endif

/* GGML type ids (ggml.h) */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
       T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30 };

#include "qtypes.h" /* each type's block layout, in one table */

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
    return half_to_float(h);
#endif
}

static inline float ld_h(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return h2f(h); }

static inline float bf2f(uint16_t h) { uint32_t b = (uint32_t)h << 16; float f; memcpy(&f, &b, 4); return f; }

/* Quantize x [K] (K % 32 == 0) into q, d, s. The SIMD path gives the portable one's bytes: max
 * over |x| is exact in any order, and a NaN lane keeps the running maximum as fmaxf does
 * (maxps returns its second operand); |q| <= 127, so the saturating packs are exact. */
static void quantize_act(const float *x, int K, int8_t *q, float *d, float *s) {
    for (int b = 0; b < K / 32; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.0f;
#ifdef PI_SIMD
        __m256 v[4], m = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            m = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), m);
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#else
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xb[i]));
#endif
        float db = amax / 127.0f, id = db > 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
#ifdef PI_SIMD
        const __m256 vid = _mm256_set1_ps(id);
        __m256i r[4];
        for (int i = 0; i < 4; i++)
            r[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const __m256i acc = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        sum = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1)));
        /* packs work within 128-bit lanes: the permute puts the 32 bytes back in order */
        const __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
        _mm256_storeu_si256((__m256i *)(q + 32 * b), _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
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

/* ---- 32-element block types: Q4_0 (18 B), Q4_1 (20 B), Q5_0 (22 B), Q5_1 (24 B), Q8_0 (34 B) ----
 * The portable build's one-token dot products; SIMD builds generate theirs from qtile.h's
 * unpack functions (the same arithmetic, one token at a time). */

#ifndef PI_SIMD

static float dot_q4_0(const uint8_t *w, const pi_act *x, int K) {
    float corr = 0.0f;
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
}

static float dot_q4_1(const uint8_t *w, const pi_act *x, int K) {
    float corr = 0.0f;
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
}

/* Q5_0: f16 d, qh[4] (bit i = bit 4 of value i), qs[16]; value = d * (q - 16). */
static float dot_q5_0(const uint8_t *w, const pi_act *x, int K) {
    float corr = 0.0f;
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
}

/* Q5_1: f16 d, f16 m, qh[4], qs[16]; value = d * q + m. */
static float dot_q5_1(const uint8_t *w, const pi_act *x, int K) {
    float corr = 0.0f;
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
}

static float dot_q8_0(const uint8_t *w, const pi_act *x, int K) {
    float acc = 0.0f;
    for (int b = 0; b < K / 32; b++, w += 34) {
        const int8_t *wq = (const int8_t *)(w + 2), *xq = x->q + 32 * b;
        int32_t sum = 0;
        for (int i = 0; i < 32; i++) sum += wq[i] * xq[i];
        acc += ld_h(w) * x->d[b] * (float)sum;
    }
    return acc;
}
#endif

#endif
