/* Float helpers of the decoder: dot products, e^x, softmax sums, the gated activations (SIMD
 * where the build has it, C otherwise).
 *
 * Runs in: the process that loads decoder.c (included by it).
 */
#ifndef PI_VECMATH_H
#define PI_VECMATH_H

#include "qdot.h"

#include "exp8.h"
#include "act.h"

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

/* g[i] = act(g[i]) * up_act(u[i]): silu (act 0), or ggml's tanh-form gelu (act 1) written as
 * g * sigmoid(2z) since tanh(z) = 2 sigmoid(2z) - 1, so both need only e^x; the ReLU family
 * (acts 2, 3) is a compare and a select. thr: FATReLU's threshold (act 2). */
static inline void act_mul(float *g, const float *u, int n, int act, float thr) {
    int i = 0;
    if (act >= PI_ACT_RELU) {
        const float t = act == PI_ACT_RELU ? thr : 0.0f;
#ifdef PI_SIMD
        const __m256 tv = _mm256_set1_ps(t), zero = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) {
            __m256 v = _mm256_loadu_ps(g + i), w = _mm256_loadu_ps(u + i);
            v = _mm256_and_ps(v, _mm256_cmp_ps(v, tv, _CMP_GT_OQ));
            if (act == PI_ACT_DRELU) w = _mm256_and_ps(w, _mm256_cmp_ps(w, zero, _CMP_GT_OQ));
            _mm256_storeu_ps(g + i, _mm256_mul_ps(v, w));
        }
#endif
        for (; i < n; i++) g[i] = (g[i] > t ? g[i] : 0.0f) * up_act(u[i], act);
        return;
    }
#ifdef PI_SIMD
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(g + i), z = v;
        if (act == PI_ACT_GELU) { /* 2z = 2 * 0.79788456 * (v + 0.044715 v^3) */
            __m256 v3 = _mm256_mul_ps(_mm256_mul_ps(v, v), v);
            z = _mm256_mul_ps(_mm256_set1_ps(1.5957691216057308f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), v3, v));
        }
        __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), z))));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_mul_ps(v, sig), _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) {
        float v = g[i], z = act == PI_ACT_GELU ? 1.5957691216057308f * (v + 0.044715f * v * v * v) : v;
        g[i] = v / (1.0f + expf(-z)) * u[i];
    }
}

#endif
