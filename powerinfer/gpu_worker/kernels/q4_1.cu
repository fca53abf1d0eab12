// Q4_1 GEMV/axpy (quant_ops.cuh). Block of 32 weights, 20 bytes: d f16, m f16, qs[16];
// weight = nibble * d + m, nibbles laid out as in Q4_0. SmolLM2's weights are Q4_1.
// Runs in: the GPU worker process.
#define SUFFIX q4_1
#include "common.cuh"

__host__ __device__ __forceinline__ float dq1(const unsigned char* row, int c) {
    const unsigned char* b = row + (c >> 5) * 20;
    const int j = c & 31;
    const int q = j < 16 ? (b[4 + j] & 15) : (b[4 + j - 16] >> 4);
    return (float)q * load_f16(b) + load_f16(b + 2);
}

// The 32 weights of block s, as dq1 gives them (the block GEMV's decoder).
__host__ __device__ __forceinline__ void dq32(const unsigned char* row, int s, float* w) {
    const unsigned char* b = row + s * 20;
    const float d = load_f16(b), m = load_f16(b + 2);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int v = b[4 + j];
        w[j] = (float)(v & 15) * d + m;
        w[j + 16] = (float)(v >> 4) * d + m;
    }
}

#include "quant_ops.cuh"
