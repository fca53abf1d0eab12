// CUDA kernels as host functions, for the host harnesses (gemv_host.cu, residual_host.cu): include
// this, then a kernel file; every thread of a launch is a std::thread with its own blockIdx and
// threadIdx, a warp's __shfl_xor_sync a pair of barriers among its 32 threads (one warp at a time:
// run_warps), atomics std::atomic_ref, and a float4 load at an address a GPU would fault on aborts.
// Runs in: a subprocess of pytest (tests/gpu_worker/test_kernels_compile.py).
#pragma once
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

struct HostDim {
    unsigned x = 0, y = 0, z = 0;
};
static thread_local HostDim host_block_idx, host_thread_idx;
static HostDim host_block_dim;
static float shfl_slots[32];
static std::barrier<>* warp_barrier = nullptr;

static float host_shfl_xor(unsigned, float v, int offset) {
    const unsigned lane = host_thread_idx.x & 31u;
    shfl_slots[lane] = v;
    warp_barrier->arrive_and_wait();
    const float got = shfl_slots[lane ^ (unsigned)offset];
    warp_barrier->arrive_and_wait();
    return got;
}

#include "common.cuh"  // first, as the device build sees it; then the kernels become host functions
#undef __global__
#define __global__
#undef __device__
#define __device__
#define blockIdx host_block_idx
#define threadIdx host_thread_idx
#define blockDim host_block_dim
#define __shfl_xor_sync host_shfl_xor
#define warp_sum host_warp_sum
__host__ __forceinline__ float host_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
using std::min;
static float host_atomic_add(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }  // axpy (compiled, not run)
#define atomicAdd host_atomic_add
// A float4 load the GPU would fault on (an address not 16-byte aligned) aborts here: x86 would not.
struct host_float4 {
    float x, y, z, w;
    host_float4(const host_float4& o) : x(o.x), y(o.y), z(o.z), w(o.w) {
        if (reinterpret_cast<unsigned long long>(&o) & 15ull) {
            fprintf(stderr, "misaligned float4 load at %p\n", static_cast<const void*>(&o));
            abort();
        }
    }
};
#define float4 host_float4
static float host_rsqrtf(float v) { return 1.0f / std::sqrt(v); }
#define rsqrtf host_rsqrtf

// Runs `launch` as every thread of `blocks` blocks of `per_block` threads (a multiple of 32), one
// warp at a time: its 32 threads run together, so warp shuffles meet; nothing may sync a whole block.
static void run_warps(long blocks, unsigned per_block, const std::function<void()>& launch) {
    host_block_dim.x = per_block;
    std::barrier<> bar(32);
    warp_barrier = &bar;
    for (long w = 0; w < blocks * (per_block / 32); ++w) {
        std::vector<std::thread> lanes;
        for (unsigned lane = 0; lane < 32; ++lane)
            lanes.emplace_back([&, w, lane] {
                host_block_idx.x = (unsigned)(w / (per_block / 32));
                host_thread_idx.x = (unsigned)((w % (per_block / 32)) * 32 + lane);
                launch();
            });
        for (auto& t : lanes) t.join();
    }
}
