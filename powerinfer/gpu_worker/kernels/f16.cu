// F16 GEMV/axpy (quant_ops.cuh): rows of K float16. Also the fallback format: weights of types
// without a kernel here (BF16, Q5_K) are dequantized to F16 once, at upload.
// Runs in: the GPU worker process.
#define SUFFIX f16
#include "common.cuh"

__host__ __device__ __forceinline__ float dq1(const unsigned char* row, int c) {
    return __half2float(reinterpret_cast<const __half*>(row)[c]);  // rows start 2-byte aligned
}

// Weights 32 s .. 32 s + 31 (the block GEMV's decoder).
__host__ __device__ __forceinline__ void dq32(const unsigned char* row, int s, float* w) {
    const __half* h = reinterpret_cast<const __half*>(row) + 32 * s;
#pragma unroll
    for (int j = 0; j < 32; ++j) w[j] = __half2float(h[j]);
}

#include "quant_ops.cuh"
