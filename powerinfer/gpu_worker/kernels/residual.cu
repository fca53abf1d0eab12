// The residual stream on the device, for runs of layers that live wholly on the GPU (GpuModel.layers):
// the stream stays in GPU memory from the first layer of a run to its last, with no host round trip.
// Runs in: the GPU worker process.
//
// rms_norm_rows: y[t, :] = x[t, :] / sqrt(mean(x[t, :]^2) + eps) * w, out of place (x is the
//   stream, y the sub-layer's input). One warp (a block of 32 threads) per token: lanes stride over
//   the row and sum with shuffles, so no shared memory or block barrier is involved.
// add_rows: y[t, i] += x[t, i] for i < n (the residual add of a sub-layer's output). A thread an element.
#include "common.cuh"

extern "C" __global__ void rms_norm_rows(const float* __restrict__ x, int ldx, float* __restrict__ y, int ldy, int T, int D,
                                         const float* __restrict__ w, float eps) {
    const int t = blockIdx.x, lane = threadIdx.x & 31;
    if (t >= T) return;  // block-uniform
    const float* v = x + (long long)t * ldx;
    float* out = y + (long long)t * ldy;
    float ss = 0.0f;
    for (int c = lane; c < D; c += 32) ss += v[c] * v[c];
    ss = warp_sum(ss);
    const float r = rsqrtf(ss / (float)D + eps);
    for (int c = lane; c < D; c += 32) out[c] = v[c] * r * w[c];
}

extern "C" __global__ void add_rows(float* __restrict__ y, int ldy, const float* __restrict__ x, int ldx, int T, int n) {
    const long long k = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (k >= (long long)T * n) return;
    const long long t = k / n, i = k % n;
    y[t * ldy + i] += x[t * ldx + i];
}
