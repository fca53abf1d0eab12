// Q6_K GEMV/axpy (quant_ops.cuh). Super-block of 256 weights, 210 bytes: ql[128], qh[64],
// scales int8[16], d f16. Weight e: half h = e / 128, r = e % 128, s = r / 32, l = r % 32;
// low 4 bits: nibble s / 2 of ql[64h + 32 (s & 1) + l]; high 2 bits: qh[32h + l] >> 2s;
// weight = d * scales[e / 16] * (code - 32) (ggml dequantize_row_q6_K).
// Runs in: the GPU worker process.
#define SUFFIX q6_k
#include "common.cuh"

__host__ __device__ __forceinline__ float dq1(const unsigned char* row, int c) {
    const unsigned char* b = row + (c >> 8) * 210;
    const int e = c & 255, h = e >> 7, r = e & 127, s = r >> 5, l = r & 31;
    const int lo = (b[64 * h + 32 * (s & 1) + l] >> (4 * (s >> 1))) & 15;
    const int hi = (b[128 + 32 * h + l] >> (2 * s)) & 3;
    return load_f16(b + 208) * (float)(signed char)b[192 + (e >> 4)] * (float)((lo | (hi << 4)) - 32);
}

// The 32 weights of sub-block s (super-block s / 8), as dq1 gives them (the block GEMV's decoder).
__host__ __device__ __forceinline__ void dq32(const unsigned char* row, int s, float* w) {
    const unsigned char* b = row + (s >> 3) * 210;
    const int u = s & 7, h = u >> 2, r = u & 3;
    const float d = load_f16(b + 208);
    const unsigned char* ql = b + 64 * h + 32 * (r & 1);
    const unsigned char* qh = b + 128 + 32 * h;
#pragma unroll
    for (int l = 0; l < 32; ++l) {
        const int lo = (ql[l] >> (4 * (r >> 1))) & 15, hi = (qh[l] >> (2 * r)) & 3;
        w[l] = d * (float)(signed char)b[192 + 2 * u + (l >> 4)] * (float)((lo | (hi << 4)) - 32);
    }
}

#include "quant_ops.cuh"
