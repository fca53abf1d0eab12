/* The FFN activations shared by the decoder (vecmath.h) and the sparse FFN kernel (pi_rows.h):
 * their codes (config.py's ACT_CODES) and the scalar forms the SIMD loops fall back to.
 *
 * Runs in: whichever process loads decoder.c or sparse_ffn.c (included by both).
 *
 *   PI_ACT_SILU   h = silu(g) * u                    (llama, qwen2)
 *   PI_ACT_GELU   h = gelu_tanh(g) * u               (gemma3; ggml's tanh form)
 *   PI_ACT_RELU   h = (g > thr ? g : 0) * u          (ReGLU at thr 0; FATReLU, ProSparse, above it)
 *   PI_ACT_DRELU  h = relu(g) * relu(u)              (dReLU: Bamboo, TurboSparse)
 */
#ifndef PI_ACT_H
#define PI_ACT_H

#include <math.h>

enum { PI_ACT_SILU = 0, PI_ACT_GELU = 1, PI_ACT_RELU = 2, PI_ACT_DRELU = 3 };

/* act(g) alone: what a gate value contributes before the up value multiplies it. */
static inline float act_gate(float v, int act, float thr) {
    switch (act) {
    case PI_ACT_SILU: return v / (1.0f + expf(-v));
    case PI_ACT_GELU: return 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
    case PI_ACT_RELU: return v > thr ? v : 0.0f;
    default: return v > 0.0f ? v : 0.0f;
    }
}

/* The up value as the activation multiplies it: dReLU rectifies it too. */
static inline float up_act(float u, int act) { return act == PI_ACT_DRELU && !(u > 0.0f) ? 0.0f : u; }

#endif
