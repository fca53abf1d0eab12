// Test harness: runs the GEMV kernels themselves (gemv_<t> and gemv_lanes_<t> of
// powerinfer/gpu_worker/kernels/quant_ops.cuh) on the host CPU, a warp at a time as 32 std::threads
// whose __shfl_xor_sync is a pair of barriers, so tests/gpu_worker/test_kernels_compile.py runs
// their indexing (row lists, device counts, token tiles, strided output, float4 and scalar x, the
// float rows' tail) against numpy on a machine with nvcc but no GPU. Runs in: a subprocess of pytest.
// Usage: gemv_host KIND TYPE K ROW_BYTES N_ROWS N T LDY XOFF COUNT USE_ROWS
//   stdin: W (N_ROWS * ROW_BYTES bytes), x (XOFF + T * K float32; the kernel gets x + XOFF),
//          rows (N int32, when USE_ROWS); COUNT >= 0: the device count, else none
//   stdout: y (T * LDY float32, zero where the kernel writes nothing)
#include "host_warp.h"

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
    run_warps(((long)N * 32 + 127) / 128, 128, [&] {  // the backend launches ceil(32 N / 128) blocks of 128
        fn(W.data(), rb, use_rows ? rows.data() : nullptr, count >= 0 ? &dev_count : nullptr, N, x.data() + xoff, K, T, y.data(), ldy);
    });
    fwrite(y.data(), sizeof(float), y.size(), stdout);
    return 0;
}
