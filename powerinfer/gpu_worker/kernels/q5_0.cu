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

#include "quant_ops.cuh"
