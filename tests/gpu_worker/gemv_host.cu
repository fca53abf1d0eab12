// Test harness: runs the GEMV kernels themselves (gemv_<t> and gemv_lanes_<t> of
// powerinfer/gpu_worker/kernels/quant_ops.cuh) on the host CPU, a warp at a time as 32 std::threads
// whose __shfl_xor_sync is a pair of barriers, so tests/gpu_worker/test_kernels_compile.py runs
// their indexing (row lists, device counts, token tiles, strided output, float4 and scalar x, the
// float rows' tail) against numpy on a machine with nvcc but no GPU. Runs in: a subprocess of pytest.
// Usage: gemv_host KIND TYPE K ROW_BYTES N_ROWS N T LDY XOFF COUNT USE_ROWS
//   stdin: W (N_ROWS * ROW_BYTES bytes), x (XOFF + T * K float32; the kernel gets x + XOFF),
//          rows (N int32, when USE_ROWS); COUNT >= 0: the device count, else none
//   stdout: y (T * LDY float32, zero where the kernel writes nothing)
#include <atomic>
#include <barrier>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

#include "kernel_types.inc"

typedef void (*Gemv)(const unsigned char*, long long, const int*, const int*, int, const float*, int, int, float*, int);

int main(int argc, char** argv) {
    if (argc != 12) return 2;
    const char* names[] = {"q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q6_k", "f16", "f32"};
    Gemv blocks[] = {q4_0::gemv_q4_0, q4_1::gemv_q4_1, q5_0::gemv_q5_0, q5_1::gemv_q5_1, q8_0::gemv_q8_0,
                     q4_k::gemv_q4_k, q6_k::gemv_q6_k, f16::gemv_f16, f32::gemv_f32};
    Gemv lanes[] = {q4_0::gemv_lanes_q4_0, q4_1::gemv_lanes_q4_1, q5_0::gemv_lanes_q5_0, q5_1::gemv_lanes_q5_1,
                    q8_0::gemv_lanes_q8_0, q4_k::gemv_lanes_q4_k, q6_k::gemv_lanes_q6_k, f16::gemv_lanes_f16, f32::gemv_lanes_f32};
    Gemv fn = nullptr;
    for (int i = 0; i < 9; ++i)
        if (!strcmp(argv[2], names[i])) fn = !strcmp(argv[1], "lanes") ? lanes[i] : blocks[i];
    if (!fn) return 3;
    const int K = atoi(argv[3]), N = atoi(argv[6]), T = atoi(argv[7]), ldy = atoi(argv[8]);
    const long rb = atol(argv[4]), n_rows = atol(argv[5]), xoff = atol(argv[9]);
    const int count = atoi(argv[10]), use_rows = atoi(argv[11]);
    std::vector<unsigned char> W(n_rows * rb);
    std::vector<float> x(xoff + (long)T * K);  // exactly what the kernel may read: an over-read is out of bounds
    std::vector<int> rows(use_rows ? N : 0);
    int dev_count = count;
    if (fread(W.data(), 1, W.size(), stdin) != W.size()) return 4;
    if (fread(x.data(), sizeof(float), xoff + (long)T * K, stdin) != (size_t)(xoff + (long)T * K)) return 4;
    if (use_rows && fread(rows.data(), sizeof(int), N, stdin) != (size_t)N) return 4;
    std::vector<float> y((long)T * ldy, 0.0f);
    // x's allocation is 16-byte aligned (vector<float> from operator new), so XOFF % 4 != 0 takes the scalar path
    host_block_dim.x = 128;
    const long warps = ((long)N * 32 + 127) / 128 * 4;  // the backend launches ceil(32 N / 128) blocks of 128
    std::barrier<> bar(32);
    warp_barrier = &bar;
    for (long w = 0; w < warps; ++w) {
        std::vector<std::thread> lanes_run;
        for (int lane = 0; lane < 32; ++lane)
            lanes_run.emplace_back([&, w, lane] {
                host_block_idx.x = (unsigned)(w / 4);
                host_thread_idx.x = (unsigned)((w % 4) * 32 + lane);
                fn(W.data(), rb, use_rows ? rows.data() : nullptr, count >= 0 ? &dev_count : nullptr, N, x.data() + xoff, K, T,
                   y.data(), ldy);
            });
        for (auto& t : lanes_run) t.join();
    }
    fwrite(y.data(), sizeof(float), y.size(), stdout);
    return 0;
}
