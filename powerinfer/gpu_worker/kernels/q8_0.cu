// Q8_0 GEMV/axpy (quant_ops.cuh). Block of 32 weights, 34 bytes: d f16, qs int8[32]; weight = q * d.
// Also the format of the transposed down projection rows the GPU worker builds for hot neurons.
// Runs in: the GPU worker process.
#define SUFFIX q8_0
#include "common.cuh"

__host__ __device__ __forceinline__ float dq1(const unsigned char* row, int c) {
    const unsigned char* b = row + (c >> 5) * 34;
    return (float)(signed char)b[2 + (c & 31)] * load_f16(b);
}

#include "quant_ops.cuh"
