// Q8_0 GEMV/axpy (quant_ops.cuh). Block of 32 weights, 34 bytes: d f16, qs int8[32]; weight = q * d.
// Also the format of the transposed down projection rows the GPU worker builds for hot neurons.
// Runs in: the GPU worker process.
#define SUFFIX q8_0
#include "common.cuh"

__host__ __device__ __forceinline__ float dq1(const unsigned char* row, int c) {
    const unsigned char* b = row + (c >> 5) * 34;
    return (float)(signed char)b[2 + (c & 31)] * load_f16(b);
}

// The 32 weights of block s, as dq1 gives them (the block GEMV's decoder).
__host__ __device__ __forceinline__ void dq32(const unsigned char* row, int s, float* w) {
    const unsigned char* b = row + s * 34;
    const float d = load_f16(b);
#pragma unroll
    for (int j = 0; j < 32; ++j) w[j] = (float)(signed char)b[2 + j] * d;
}

#include "quant_ops.cuh"
