// Q4_K GEMV/axpy (quant_ops.cuh). Super-block of 256 weights, 144 bytes: d f16, dmin f16,
// scales[12] (eight 6-bit scale/min pairs), qs[128]. Weight e: sub-block s = e / 32 uses nibble
// s & 1 of qs[32 * (s / 2) + e % 32]; weight = d * sc[s] * code - dmin * m[s] (ggml get_scale_min_k4).
// Runs in: the GPU worker process.
#define SUFFIX q4_k
#include "common.cuh"

// Sub-block s's 6-bit scale and min from the 12 packed bytes (ggml get_scale_min_k4).
__host__ __device__ __forceinline__ void scale_min_k4(const unsigned char* sc, int s, int* scale, int* mn) {
    if (s < 4) {
        *scale = sc[s] & 63;
        *mn = sc[s + 4] & 63;
    } else {
        *scale = (sc[s + 4] & 15) | ((sc[s - 4] >> 6) << 4);
        *mn = (sc[s + 4] >> 4) | ((sc[s] >> 6) << 4);
    }
}

__host__ __device__ __forceinline__ float dq1(const unsigned char* row, int c) {
    const unsigned char* b = row + (c >> 8) * 144;
    const int e = c & 255, s = e >> 5, l = e & 31;
    int scale, mn;
    scale_min_k4(b + 4, s, &scale, &mn);
    const int q = (b[16 + 32 * (s >> 1) + l] >> (4 * (s & 1))) & 15;
    return load_f16(b) * (float)scale * (float)q - load_f16(b + 2) * (float)mn;
}

// The 32 weights of sub-block s (super-block s / 8), as dq1 gives them (the block GEMV's decoder).
__host__ __device__ __forceinline__ void dq32(const unsigned char* row, int s, float* w) {
    const unsigned char* b = row + (s >> 3) * 144;
    const int u = s & 7;
    int scale, mn;
    scale_min_k4(b + 4, u, &scale, &mn);
    const float d = load_f16(b), dmin = load_f16(b + 2);
    const unsigned char* q = b + 16 + 32 * (u >> 1);
    const int shift = 4 * (u & 1);
#pragma unroll
    for (int l = 0; l < 32; ++l) w[l] = d * (float)scale * (float)((q[l] >> shift) & 15) - dmin * (float)mn;
}

#include "quant_ops.cuh"
