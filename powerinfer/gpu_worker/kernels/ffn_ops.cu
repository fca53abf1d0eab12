// Element-wise FFN steps and the active-neuron compaction of a sparse decode step.
// Runs in: the GPU worker process. kind (config.py's ACT_CODES, native/kernels/act.h): 0 = SiLU,
// 1 = GELU (tanh approximation, as ggml), 2 = ReLU / FATReLU (g where g > athr, else 0), 3 = dReLU
// (relu(g) * relu(u)); athr is FATReLU's threshold (0 for the others).
//
// bias_act: y[t, j] += b[j] (q/k/v biases), then ReLU when relu != 0 (the predictor's hidden layer).
// act_mul: h[t, j] = act(g[t, j]) * up(u[t, j]), zeroed where the neuron is inactive: |act(g)| <= thr
//   (gate mode, thr >= 0) or logits[t, j] <= 0 (predictor mode, logits given). Used when every hot
//   neuron is computed (prefill, dense) so masking, not skipping, decides the output; with n_dev
//   (T = 1) only the first *n_dev entries, the compacted active neurons of a decode step.
//   u NULL: a gate-less FFN (OPT: act(fc1 x + b)), whose "up" is 1.
// act_inplace: g = act(g) (decode, gate mode: the gate of every hot neuron is needed to pick).
// compact: idx = [j for j < n if v[j] > thr] (|v[j]| > thr when use_abs), in increasing order,
//   and *count = len(idx). One block: each thread takes a contiguous run, a block-wide scan gives
//   each run its output offset, so the order is deterministic.
// gather_mul: h[j] = a[idx[j]] * up(u[j]) for j < *count (decode, gate mode; u NULL: 1).
// gather_add: y[j] += b[idx[j]] for j < *count (a gate-less FFN's fc1 bias on the compacted neurons).
#include "common.cuh"

__device__ __forceinline__ float act(float x, int kind, float athr) {
    if (kind == 0) return x / (1.0f + expf(-x));
    if (kind == 2) return x > athr ? x : 0.0f;
    if (kind == 3) return x > 0.0f ? x : 0.0f;
    const float k0 = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * x * (1.0f + tanhf(k0 * (x + 0.044715f * x * x * x)));
}

// The up value as the activation multiplies it: dReLU rectifies it too.
__device__ __forceinline__ float up(float u, int kind) { return kind == 3 && !(u > 0.0f) ? 0.0f : u; }

extern "C" __global__ void bias_act(float* __restrict__ y, int ld, const float* __restrict__ b, int T, int n, int relu) {
    const long long k = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (k >= (long long)T * n) return;
    const int t = (int)(k / n), j = (int)(k % n);
    float v = y[(long long)t * ld + j] + b[j];
    y[(long long)t * ld + j] = relu ? fmaxf(v, 0.0f) : v;
}

extern "C" __global__ void act_mul(const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ h,
                                   int T, int n, int kind, float athr, float thr, const float* __restrict__ logits,
                                   const int* __restrict__ n_dev) {
    const long long k = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (k >= (long long)T * (n_dev ? min(*n_dev, n) : n)) return;
    const float a = act(g[k], kind, athr);
    const bool on = logits ? logits[k] > 0.0f : (thr < 0.0f || fabsf(a) > thr);
    h[k] = on ? a * (u ? up(u[k], kind) : 1.0f) : 0.0f;
}

extern "C" __global__ void act_inplace(float* __restrict__ g, int n, int kind, float athr) {
    const int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k < n) g[k] = act(g[k], kind, athr);
}

extern "C" __global__ void compact(const float* __restrict__ v, int n, float thr, int use_abs, int* __restrict__ idx,
                                   int* __restrict__ count) {
    __shared__ int offs[1024];
    const int tid = threadIdx.x, nth = blockDim.x;
    const int per = (n + nth - 1) / nth, lo = min(n, tid * per), hi = min(n, lo + per);
    int mine = 0;
    for (int j = lo; j < hi; ++j) mine += (use_abs ? fabsf(v[j]) : v[j]) > thr;
    offs[tid] = mine;
    __syncthreads();
    for (int step = 1; step < nth; step <<= 1) {  // inclusive Hillis-Steele scan over the runs
        const int add = tid >= step ? offs[tid - step] : 0;
        __syncthreads();
        offs[tid] += add;
        __syncthreads();
    }
    int o = offs[tid] - mine;
    for (int j = lo; j < hi; ++j)
        if ((use_abs ? fabsf(v[j]) : v[j]) > thr) idx[o++] = j;
    if (tid == nth - 1) *count = offs[tid];
}

extern "C" __global__ void gather_mul(const float* __restrict__ a, const int* __restrict__ idx,
                                      const int* __restrict__ count, int n, const float* __restrict__ u,
                                      float* __restrict__ h, int kind) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j < min(*count, n)) h[j] = a[idx[j]] * (u ? up(u[j], kind) : 1.0f);
}

extern "C" __global__ void gather_add(float* __restrict__ y, const float* __restrict__ b, const int* __restrict__ idx,
                                      const int* __restrict__ count, int n) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j < min(*count, n)) y[j] += b[idx[j]];
}
