// F32 GEMV/axpy (quant_ops.cuh): rows of K float32 (float model files, the predictor's MLP).
// Runs in: the GPU worker process.
#define SUFFIX f32
#include "common.cuh"

__host__ __device__ __forceinline__ float dq1(const unsigned char* row, int c) {
    return reinterpret_cast<const float*>(row)[c];  // rows start 4-byte aligned
}

// Weights 32 s .. 32 s + 31 (the block GEMV's decoder).
__host__ __device__ __forceinline__ void dq32(const unsigned char* row, int s, float* w) {
    const float* f = reinterpret_cast<const float*>(row) + 32 * s;
#pragma unroll
    for (int j = 0; j < 32; ++j) w[j] = f[j];
}

#include "quant_ops.cuh"
