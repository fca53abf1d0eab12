// RMSNorm and rotary embedding, in place over heads of a row-major activation buffer.
// Runs in: the GPU worker process. Layout: token t, head h starts at x + t * ld + h * D.
//
// rms_norm: x[t, h, :] *= w / sqrt(mean(x[t, h, :]^2) + eps): Gemma's per-head q/k norms (H heads
//   of width D), or a whole row (H = 1, D = d). One block per (head, token).
// rope: adjacent pairs (2i, 2i + 1) of the first rope_dim dims of each head rotated by
//   pos * inv_freq[i]. NEOX-style models reach here with their q/k rows permuted at upload (as the
//   CPU shards do, model/ops.py neox_to_norm_perm), so one kernel serves every architecture.
//   Angles in double precision like the CPU's rope table (positions reach 1e5, f32 would drift).
#include "common.cuh"

extern "C" __global__ void rms_norm(float* __restrict__ x, int ld, int T, int H, int D,
                                    const float* __restrict__ w, float eps) {
    __shared__ float part[32];
    const int h = blockIdx.x, t = blockIdx.y;
    if (h >= H || t >= T) return;
    float* v = x + (long long)t * ld + (long long)h * D;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < D; c += blockDim.x) ss += v[c] * v[c];
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        float s = threadIdx.x < (blockDim.x + 31) / 32 ? part[threadIdx.x] : 0.0f;
        s = warp_sum(s);
        if (threadIdx.x == 0) part[0] = rsqrtf(s / (float)D + eps);
    }
    __syncthreads();
    const float r = part[0];
    for (int c = threadIdx.x; c < D; c += blockDim.x) v[c] = v[c] * r * w[c];
}

extern "C" __global__ void rope(float* __restrict__ x, int ld, const long long* __restrict__ pos, int T, int H, int D,
                                int rope_dim, const double* __restrict__ inv_freq) {
    const int half = rope_dim / 2;
    const long long k = blockIdx.x * (long long)blockDim.x + threadIdx.x;  // (t, h, i) flattened
    if (k >= (long long)T * H * half) return;
    const int i = (int)(k % half);
    const int h = (int)((k / half) % H);
    const int t = (int)(k / ((long long)half * H));
    double s, c;
    sincos((double)pos[t] * inv_freq[i], &s, &c);
    float* p = x + (long long)t * ld + (long long)h * D + 2 * i;
    const float a = p[0], b = p[1];
    p[0] = a * (float)c - b * (float)s;
    p[1] = a * (float)s + b * (float)c;
}
