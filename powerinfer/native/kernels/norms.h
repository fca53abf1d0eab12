/* The decoder's norms: RMSNorm (llama, qwen2, gemma3) and LayerNorm with a bias (OPT), chosen by
 * the model (pi_model.layernorm), and the bias add of OPT's projections.
 *
 * Runs in: the process that loads decoder.c (included by it after model.h and vecmath.h; one
 * translation unit).
 */
#ifndef PI_NORMS_H
#define PI_NORMS_H

static void rmsnorm(const float *x, const float *w, int n, float eps, float *out) {
    const float ss = dotf(x, x, n);
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

/* out = (x - mean) / sqrt(var + eps) * w + b over n values (out may be x). */
static void layernorm(const float *x, const float *w, const float *b, int n, float eps, float *out) {
    float mean = 0.0f;
    for (int i = 0; i < n; i++) mean += x[i];
    mean /= (float)n;
    float var = 0.0f;
    for (int i = 0; i < n; i++) var += (x[i] - mean) * (x[i] - mean);
    const float r = 1.0f / sqrtf(var / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = (x[i] - mean) * r * w[i] + b[i];
}

/* The model's norm of one row x [d] into out: LayerNorm with bias b (OPT) or RMSNorm. */
static inline void norm_row(const pi_model *m, const float *x, const float *w, const float *b, float *out) {
    if (m->layernorm)
        layernorm(x, w, b, m->d, m->eps, out);
    else
        rmsnorm(x, w, m->d, m->eps, out);
}

/* x[0..n) += b[0..n) (b NULL: nothing). */
static inline void add_vec(float *x, const float *b, int n) {
    if (b)
        for (int i = 0; i < n; i++) x[i] += b[i];
}

#endif
