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

// The 32 weights of block s, as dq1 gives them (the block GEMV's decoder).
__host__ __device__ __forceinline__ void dq32(const unsigned char* row, int s, float* w) {
    const unsigned char* b = row + s * 18;
    const float d = load_f16(b);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int v = b[2 + j];
        w[j] = (float)((v & 15) - 8) * d;
        w[j + 16] = (float)((v >> 4) - 8) * d;
    }
}

#include "quant_ops.cuh"
