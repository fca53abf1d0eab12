// KV-cache writes and attention over the cache, for decode (T = 1) and batched steps (T > 1).
// Runs in: the GPU worker process.
//
// Cache layout, float16: k_cache [n_slots, Hkv, n_ctx, D], v_cache [n_slots, Hkv, n_ctx, Dv],
// indexed by (slot, head, absolute position) like the CPU shards' caches. Token t of a step sits in
// slot slots[t] at position pos[t]: one slot with consecutive positions for a prompt chunk, one
// token per slot for a batched decode step. kv_store writes every token first, so attend can let
// token t see positions [lo_t, pos[t]] of its own slot, which is causal inside a chunk.
//
// attend: one block of 4 warps per (query head, token). Each warp walks every 4th position with an
// online softmax (running max m, sum l, accumulator acc over Dv, lanes own dims c = lane + 32 i),
// then warp 0 merges the four (m, l, acc). No score buffer, so any context length fits.
// D and Dv are at most MAX_D (the host checks).
#include "common.cuh"

#define MAX_D 256
#define PER_LANE (MAX_D / 32)
#define WARPS 4

extern "C" __global__ void kv_store(const float* __restrict__ qkv, int ld, int k_off, int v_off,
                                    const long long* __restrict__ pos, const long long* __restrict__ slots, int T,
                                    int Hkv, int D, int Dv, __half* __restrict__ k_cache, __half* __restrict__ v_cache,
                                    int n_ctx) {
    const int t = blockIdx.y, h = blockIdx.x;
    if (t >= T || h >= Hkv) return;
    const long long base = ((long long)slots[t] * Hkv + h) * n_ctx + pos[t];
    const float* row = qkv + (long long)t * ld;
    for (int c = threadIdx.x; c < D; c += blockDim.x) k_cache[base * D + c] = __float2half(row[k_off + h * D + c]);
    for (int c = threadIdx.x; c < Dv; c += blockDim.x) v_cache[base * Dv + c] = __float2half(row[v_off + h * Dv + c]);
}

extern "C" __global__ void attend(const float* __restrict__ qkv, int ld, const long long* __restrict__ pos,
                                  const long long* __restrict__ slots, int T, int Hq, int Hkv, int D, int Dv,
                                  const __half* __restrict__ k_cache, const __half* __restrict__ v_cache, int n_ctx,
                                  int window, float scale, float* __restrict__ out) {
    __shared__ float sm[WARPS], sl[WARPS], sacc[WARPS][MAX_D];
    const int hq = blockIdx.x, t = blockIdx.y;
    if (hq >= Hq || t >= T) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int hk = hq / (Hq / Hkv);  // grouped-query: query heads of a group share one kv head
    const long long p_hi = pos[t];
    const long long p_lo = window > 0 ? max(0LL, p_hi - window + 1) : 0LL;
    const float* q = qkv + (long long)t * ld + (long long)hq * D;
    float qr[PER_LANE], acc[PER_LANE];
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        const int c = lane + 32 * i;
        qr[i] = c < D ? q[c] * scale : 0.0f;
        acc[i] = 0.0f;
    }
    const long long head = (long long)slots[t] * Hkv + hk;
    const __half* kh = k_cache + head * n_ctx * D;
    const __half* vh = v_cache + head * n_ctx * Dv;
    float m = -INFINITY, l = 0.0f;
    for (long long p = p_lo + warp; p <= p_hi; p += WARPS) {
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            const int c = lane + 32 * i;
            if (c < D) s += qr[i] * __half2float(kh[p * D + c]);
        }
        s = warp_sum(s);
        const float m_new = fmaxf(m, s);
        const float corr = expf(m - m_new), e = expf(s - m_new);
        l = l * corr + e;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            const int c = lane + 32 * i;
            if (c < Dv) acc[i] = acc[i] * corr + e * __half2float(vh[p * Dv + c]);
        }
        m = m_new;
    }
    if (lane == 0) {
        sm[warp] = m;
        sl[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        const int c = lane + 32 * i;
        if (c < Dv) sacc[warp][c] = acc[i];
    }
    __syncthreads();
    if (warp != 0) return;
    float M = sm[0];
    for (int w = 1; w < WARPS; ++w) M = fmaxf(M, sm[w]);
    float L = 0.0f, f[WARPS];
    for (int w = 0; w < WARPS; ++w) {
        f[w] = sm[w] == -INFINITY ? 0.0f : expf(sm[w] - M);  // a warp that saw no position adds nothing
        L += sl[w] * f[w];
    }
    float* o = out + (long long)t * Hq * Dv + (long long)hq * Dv;
    for (int c = lane; c < Dv; c += 32) {
        float v = 0.0f;
        for (int w = 0; w < WARPS; ++w) v += sacc[w][c] * f[w];
        o[c] = v / L;
    }
}
