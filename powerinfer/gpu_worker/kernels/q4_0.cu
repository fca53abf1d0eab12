// Q4_0 GEMV/axpy (quant_ops.cuh). Block of 32 weights, 18 bytes: d f16, qs[16];
// weight j < 16 = ((qs[j] & 15) - 8) * d, weight j + 16 = ((qs[j] >> 4) - 8) * d.
// Runs in: the GPU worker process.
#define SUFFIX q4_0
#include "common.cuh"

__host__ __device__ __forceinline__ float dq1(const unsigned char* row, int c) {
    const unsigned char* b = row + (c >> 5) * 18;
    const int j = c & 31;
    const int q = j < 16 ? (b[2 + j] & 15) : (b[2 + j - 16] >> 4);
    return (float)(q - 8) * load_f16(b);
}

#include "quant_ops.cuh"
