// Q5_1 GEMV/axpy (quant_ops.cuh). Block of 32 weights, 24 bytes: d f16, m f16, qh u32, qs[16];
// code as Q5_0 (unsigned 0..31), weight = code * d + m.
// Runs in: the GPU worker process.
#define SUFFIX q5_1
#include "common.cuh"

__host__ __device__ __forceinline__ float dq1(const unsigned char* row, int c) {
    const unsigned char* b = row + (c >> 5) * 24;
    const int j = c & 31;
    const int lo = j < 16 ? (b[8 + j] & 15) : (b[8 + j - 16] >> 4);
    const int hi = (b[4 + (j >> 3)] >> (j & 7)) & 1;
    return (float)(lo | (hi << 4)) * load_f16(b) + load_f16(b + 2);
}

// The 32 weights of block s, as dq1 gives them (the block GEMV's decoder).
__host__ __device__ __forceinline__ void dq32(const unsigned char* row, int s, float* w) {
    const unsigned char* b = row + s * 24;
    const float d = load_f16(b), m = load_f16(b + 2);
    const unsigned int qh = b[4] | (b[5] << 8) | (b[6] << 16) | ((unsigned int)b[7] << 24);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int v = b[8 + j];
        w[j] = (float)((v & 15) | ((int)((qh >> j) & 1u) << 4)) * d + m;
        w[j + 16] = (float)((v >> 4) | ((int)((qh >> (j + 16)) & 1u) << 4)) * d + m;
    }
}

#include "quant_ops.cuh"
