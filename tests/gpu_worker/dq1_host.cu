// Test harness: runs every weight type's block decoders (dq1 and dq32, powerinfer/gpu_worker/kernels/<type>.cu)
// on the host CPU, so tests/gpu_worker/test_kernels_compile.py checks the bit layouts against numpy
// on a machine with nvcc but no GPU. Runs in: a subprocess of pytest.
// Usage: dq1_host TYPE K ROW_BYTES N [dq32] < rows (N * ROW_BYTES bytes) > floats (N * K float32)
// (with dq32: whole 32-weight blocks through dq32, K a multiple of 32)
#include "common.cuh"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernel_types.inc"

typedef float (*Dq)(const unsigned char*, int);
typedef void (*Dq32)(const unsigned char*, int, float*);

int main(int argc, char** argv) {
    if (argc != 5 && !(argc == 6 && !strcmp(argv[5], "dq32"))) return 2;
    const char* names[] = {"q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q6_k", "f16", "f32"};
    Dq fns[] = {q4_0::dq1, q4_1::dq1, q5_0::dq1, q5_1::dq1, q8_0::dq1, q4_k::dq1, q6_k::dq1, f16::dq1, f32::dq1};
    Dq32 blocks[] = {q4_0::dq32, q4_1::dq32, q5_0::dq32, q5_1::dq32, q8_0::dq32, q4_k::dq32, q6_k::dq32, f16::dq32, f32::dq32};
    Dq dq = nullptr;
    Dq32 dq32 = nullptr;
    for (int i = 0; i < 9; ++i)
        if (!strcmp(argv[1], names[i])) dq = fns[i], dq32 = blocks[i];
    if (!dq) return 3;
    const int K = atoi(argv[2]);
    const long rb = atol(argv[3]), n = atol(argv[4]);
    std::vector<unsigned char> rows(n * rb);
    if (fread(rows.data(), 1, rows.size(), stdin) != rows.size()) return 4;
    std::vector<float> out(n * K);
    if (argc == 6) {
        if (K % 32) return 5;
        for (long r = 0; r < n; ++r)
            for (int b = 0; b < K / 32; ++b) dq32(rows.data() + r * rb, b, out.data() + r * K + 32 * b);
    } else {
        for (long r = 0; r < n; ++r)
            for (int c = 0; c < K; ++c) out[r * K + c] = dq(rows.data() + r * rb, c);
    }
    fwrite(out.data(), sizeof(float), out.size(), stdout);
    return 0;
}
