// GEMV and axpy kernels over raw GGUF rows, instantiated once per weight type.
// Runs in: the GPU worker process. A type file defines SUFFIX (the kernel name suffix) and
//   __host__ __device__ float dq1(const unsigned char* row, int c)   // weight c of one row, dequantized
//   __host__ __device__ void dq32(const unsigned char* row, int s, float* w)  // weights 32 s .. 32 s + 31,
//                                                                              // each equal to dq1's
// (host too, so tests/gpu_worker checks every block decoder against numpy, and dq32 against dq1, on
// a machine without a GPU) then includes this file. Every kernel reads the file's own block bytes
// (no requantization).
//
// gemv_<t>: y[t, i] = sum_c W[r_i, c] * x[t, c] for i < n (r_i = rows[i], or i when rows is null;
//   n = min(*n_dev, n) when n_dev is given: a count produced on the device by `compact`, so a sparse
//   step needs no host round trip). One warp per output row; each lane takes whole 32-weight blocks
//   (lane l blocks l, l + 32, ...: a warp reads 32 consecutive blocks per pass), decodes a block's
//   scales once and reads its x slice as float4 where aligned; TILE tokens share each decoded block
//   (the batched variant: T > 1). Columns past the last whole block (float rows only) go weight by weight.
// gemv_lanes_<t>: the same result, the first kernel: lanes stride over single weights through dq1
//   (adjacent lanes read adjacent bytes). It reached 171 GB/s on Q4_0 on an H200 (4% of the card);
//   the backend keeps it as the reference the block kernel is checked against on first use.
// axpy_<t>: y[t, c] += sum_j h[t, j] * W[r_j, c] for j < n: the down projection over the transposed
//   (neuron-major) rows of the active neurons. Threads own columns; blockIdx.y takes a chunk of rows
//   and atomically adds its partial sums (the order of those float additions is not fixed).
// No include guard: each type file includes this once (tests/gpu_worker/gemv_host.cu, once per type).
#include "common.cuh"

#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
#define TILE 8

extern "C" __global__ void CAT(gemv_, SUFFIX)(const unsigned char* __restrict__ W, long long row_bytes,
                                             const int* __restrict__ rows, const int* __restrict__ n_dev, int n,
                                             const float* __restrict__ x, int K, int T, float* __restrict__ y, int ldy) {
    const int i = (int)((blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5);  // output row of this warp
    const int lane = threadIdx.x & 31;
    const int count = n_dev ? min(*n_dev, n) : n;
    if (i >= count) return;  // warp-uniform: the whole warp leaves together
    const unsigned char* row = W + (long long)(rows ? rows[i] : i) * row_bytes;
    const int nsub = K >> 5;
    // float4 loads of x: its base 16-byte aligned and every token's row a multiple of 4 floats
    const bool vec = ((reinterpret_cast<unsigned long long>(x) & 15ull) == 0) && ((K & 3) == 0);
    for (int t0 = 0; t0 < T; t0 += TILE) {
        const int nt = min(TILE, T - t0);
        float acc[TILE];
#pragma unroll
        for (int j = 0; j < TILE; ++j) acc[j] = 0.0f;
        for (int s = lane; s < nsub; s += 32) {
            float w[32];
            dq32(row, s, w);
#pragma unroll
            for (int j = 0; j < TILE; ++j) {
                if (j >= nt) break;
                const float* xs = x + (long long)(t0 + j) * K + 32 * s;
                float a = acc[j];
                if (vec) {
                    const float4* x4 = reinterpret_cast<const float4*>(xs);
#pragma unroll
                    for (int q = 0; q < 8; ++q) {
                        const float4 v = x4[q];
                        a += w[4 * q] * v.x;
                        a += w[4 * q + 1] * v.y;
                        a += w[4 * q + 2] * v.z;
                        a += w[4 * q + 3] * v.w;
                    }
                } else {
#pragma unroll
                    for (int c = 0; c < 32; ++c) a += w[c] * xs[c];
                }
                acc[j] = a;
            }
        }
        for (int c = 32 * nsub + lane; c < K; c += 32) {  // the tail of a float row (quantized rows have none)
            const float wt = dq1(row, c);
#pragma unroll
            for (int j = 0; j < TILE; ++j)
                if (j < nt) acc[j] += wt * x[(long long)(t0 + j) * K + c];
        }
#pragma unroll
        for (int j = 0; j < TILE; ++j) {
            const float s = warp_sum(acc[j]);
            if (lane == 0 && j < nt) y[(long long)(t0 + j) * ldy + i] = s;
        }
    }
}

extern "C" __global__ void CAT(gemv_lanes_, SUFFIX)(const unsigned char* __restrict__ W, long long row_bytes,
                                             const int* __restrict__ rows, const int* __restrict__ n_dev, int n,
                                             const float* __restrict__ x, int K, int T, float* __restrict__ y, int ldy) {
    const int i = (int)((blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5);  // output row of this warp
    const int lane = threadIdx.x & 31;
    const int count = n_dev ? min(*n_dev, n) : n;
    if (i >= count) return;  // warp-uniform: the whole warp leaves together
    const unsigned char* row = W + (long long)(rows ? rows[i] : i) * row_bytes;
    for (int t0 = 0; t0 < T; t0 += TILE) {
        const int nt = min(TILE, T - t0);
        float acc[TILE];
#pragma unroll
        for (int j = 0; j < TILE; ++j) acc[j] = 0.0f;
        for (int c = lane; c < K; c += 32) {
            const float w = dq1(row, c);
#pragma unroll
            for (int j = 0; j < TILE; ++j)
                if (j < nt) acc[j] += w * x[(long long)(t0 + j) * K + c];
        }
#pragma unroll
        for (int j = 0; j < TILE; ++j) {
            const float s = warp_sum(acc[j]);
            if (lane == 0 && j < nt) y[(long long)(t0 + j) * ldy + i] = s;
        }
    }
}

extern "C" __global__ void CAT(axpy_, SUFFIX)(const unsigned char* __restrict__ W, long long row_bytes,
                                             const int* __restrict__ rows, const int* __restrict__ n_dev, int n,
                                             const float* __restrict__ h, int ldh, int K, int T, float* __restrict__ y,
                                             int chunk) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;  // output column
    const int count = n_dev ? min(*n_dev, n) : n;
    const int j0 = blockIdx.y * chunk;
    if (c >= K || j0 >= count) return;
    const int j1 = min(j0 + chunk, count);
    for (int t0 = 0; t0 < T; t0 += TILE) {
        const int nt = min(TILE, T - t0);
        float acc[TILE];
#pragma unroll
        for (int j = 0; j < TILE; ++j) acc[j] = 0.0f;
        for (int r = j0; r < j1; ++r) {
            const float w = dq1(W + (long long)(rows ? rows[r] : r) * row_bytes, c);
#pragma unroll
            for (int j = 0; j < TILE; ++j)
                if (j < nt) acc[j] += h[(long long)(t0 + j) * ldh + r] * w;
        }
        for (int j = 0; j < nt; ++j) atomicAdd(&y[(long long)(t0 + j) * K + c], acc[j]);
    }
}
