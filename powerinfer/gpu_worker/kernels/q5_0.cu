// Q5_0 GEMV/axpy (quant_ops.cuh). Block of 32 weights, 22 bytes: d f16, qh u32, qs[16];
// code j = nibble (as Q4_0) | bit j of qh << 4, weight = (code - 16) * d. Gemma's q/k/gate/up.
// Runs in: the GPU worker process.
#define SUFFIX q5_0
#include "common.cuh"

__host__ __device__ __forceinline__ float dq1(const unsigned char* row, int c) {
    const unsigned char* b = row + (c >> 5) * 22;
    const int j = c & 31;
    const int lo = j < 16 ? (b[6 + j] & 15) : (b[6 + j - 16] >> 4);
    const int hi = (b[2 + (j >> 3)] >> (j & 7)) & 1;  // bit j of the little-endian u32
    return (float)((lo | (hi << 4)) - 16) * load_f16(b);
}

// The 32 weights of block s, as dq1 gives them (the block GEMV's decoder).
__host__ __device__ __forceinline__ void dq32(const unsigned char* row, int s, float* w) {
    const unsigned char* b = row + s * 22;
    const float d = load_f16(b);
    const unsigned int qh = b[2] | (b[3] << 8) | (b[4] << 16) | ((unsigned int)b[5] << 24);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int v = b[6 + j];
        w[j] = (float)(((v & 15) | ((int)((qh >> j) & 1u) << 4)) - 16) * d;
        w[j + 16] = (float)(((v >> 4) | ((int)((qh >> (j + 16)) & 1u) << 4)) - 16) * d;
    }
}

#include "quant_ops.cuh"
