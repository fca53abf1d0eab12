// GEMV and axpy kernels over raw GGUF rows, instantiated once per weight type.
// Runs in: the GPU worker process. A type file defines SUFFIX (the kernel name suffix) and
//   __host__ __device__ float dq1(const unsigned char* row, int c)   // weight c of one row, dequantized
// (host too, so tests/gpu_worker checks every block decoder against numpy on a machine without a GPU)
// then includes this file. Every kernel reads the file's own block bytes (no requantization).
//
// gemv_<t>: y[t, i] = sum_c W[r_i, c] * x[t, c] for i < n (r_i = rows[i], or i when rows is null;
//   n = min(*n_dev, n) when n_dev is given: a count produced on the device by `compact`, so a sparse
//   step needs no host round trip). One warp per output row, lanes stride over the columns (adjacent
//   lanes read adjacent bytes), TILE tokens share each dequantized weight (the batched variant: T > 1).
// axpy_<t>: y[t, c] += sum_j h[t, j] * W[r_j, c] for j < n: the down projection over the transposed
//   (neuron-major) rows of the active neurons. Threads own columns; blockIdx.y takes a chunk of rows
//   and atomically adds its partial sums (the order of those float additions is not fixed).
#pragma once
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
