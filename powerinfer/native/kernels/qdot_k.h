/* K-quant (super-blocks of 256) and float-weight dot products (the 32-element block types are in
 * qdot.h; every type's kernels are looked up through qtraits.h).
 *
 * Runs in: the process that loads decoder.c (included by it).
 */
#ifndef PI_QDOT_K_H
#define PI_QDOT_K_H

#include "qdot.h"
#include "qtile.h" /* SIMD builds: the quantized types' one-token dot products */

/* ---- K-quants, super-blocks of 256 (portable build; SIMD builds: qtile.h) ---- */

#ifndef PI_SIMD

/* Q4_K (144 B): f16 d, f16 dmin, scales[12], qs[128]; sub-block j (32 values) = low (j even) or
 * high (j odd) nibbles of qs[32 (j / 2) ...]; value = d sc_j q - dmin m_j. Q5_K (176 B) adds
 * qh[32] before qs: bit j of qh[i] is bit 4 of value i of sub-block j. */
static float dot_qk45(const uint8_t *w, const pi_act *x, int K, int five) {
    const int bytes = five ? 176 : 144;
    float acc_s = 0.0f, corr = 0.0f;
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
            const int8_t *xq = x->q + 32 * b;
            int32_t sum = 0;
            for (int i = 0; i < 32; i++) {
                int v = (j & 1) ? (q[i] >> 4) : (q[i] & 0xF);
                if (five) v |= ((qh[i] >> j) & 1) << 4;
                sum += v * xq[i];
            }
            acc_s += d * (float)sc * dx * (float)sum;
        }
    }
    return acc_s - corr;
}

static float dot_q4_k(const uint8_t *w, const pi_act *x, int K) { return dot_qk45(w, x, K, 0); }
static float dot_q5_k(const uint8_t *w, const pi_act *x, int K) { return dot_qk45(w, x, K, 1); }

/* Q6_K (210 B): ql[128], qh[64], int8 scales[16], f16 d; value = d sc_(e / 16) (q - 32), q 6-bit.
 * Element e in half h = e / 128, l = e % 128: low 4 bits are the low (l < 64) or high nibble of
 * ql[64 h + l % 64], the top 2 bits are bits 2 (l / 32) of qh[32 h + l % 32]. */
static float dot_q6_k(const uint8_t *w, const pi_act *x, int K) {
    float acc = 0.0f;
    for (int sb = 0; sb < K / 256; sb++, w += 210) {
        const uint8_t *ql = w, *qh = w + 128;
        const int8_t *sc = (const int8_t *)(w + 192);
        const float d = ld_h(w + 208);
        for (int blk = 0; blk < 8; blk++) {
            const int h = blk / 4, s = blk % 4, b = sb * 8 + blk;
            const uint8_t *l = ql + 64 * h + 32 * (s % 2), *hh = qh + 32 * h;
            const int8_t *xq = x->q + 32 * b;
            int32_t s0 = 0, s1 = 0;
            for (int i = 0; i < 32; i++) {
                int q = ((s >= 2 ? l[i] >> 4 : l[i] & 0xF) | (((hh[i] >> (2 * s)) & 3) << 4)) - 32;
                if (i < 16) s0 += q * xq[i]; else s1 += q * xq[i];
            }
            acc += d * x->d[b] * (float)(sc[2 * blk] * s0 + sc[2 * blk + 1] * s1);
        }
    }
    return acc;
}
#endif

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

#endif
