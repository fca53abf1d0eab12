// Test harness: runs every weight type's block decoder (dq1, powerinfer/gpu_worker/kernels/<type>.cu)
// on the host CPU, so tests/gpu_worker/test_kernels_compile.py checks the bit layouts against numpy
// on a machine with nvcc but no GPU. Runs in: a subprocess of pytest.
// Usage: dq1_host TYPE K ROW_BYTES N < rows (N * ROW_BYTES bytes) > floats (N * K float32)
#include "common.cuh"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace q4_0 {
#include "q4_0.cu"
}
#undef SUFFIX
namespace q4_1 {
#include "q4_1.cu"
}
#undef SUFFIX
namespace q5_0 {
#include "q5_0.cu"
}
#undef SUFFIX
namespace q5_1 {
#include "q5_1.cu"
}
#undef SUFFIX
namespace q8_0 {
#include "q8_0.cu"
}
#undef SUFFIX
namespace q4_k {
#include "q4_k.cu"
}
#undef SUFFIX
namespace q6_k {
#include "q6_k.cu"
}
#undef SUFFIX
namespace f16 {
#include "f16.cu"
}
#undef SUFFIX
namespace f32 {
#include "f32.cu"
}

typedef float (*Dq)(const unsigned char*, int);

int main(int argc, char** argv) {
    if (argc != 5) return 2;
    const char* names[] = {"q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q6_k", "f16", "f32"};
    Dq fns[] = {q4_0::dq1, q4_1::dq1, q5_0::dq1, q5_1::dq1, q8_0::dq1, q4_k::dq1, q6_k::dq1, f16::dq1, f32::dq1};
    Dq dq = nullptr;
    for (int i = 0; i < 9; ++i)
        if (!strcmp(argv[1], names[i])) dq = fns[i];
    if (!dq) return 3;
    const int K = atoi(argv[2]);
    const long rb = atol(argv[3]), n = atol(argv[4]);
    std::vector<unsigned char> rows(n * rb);
    if (fread(rows.data(), 1, rows.size(), stdin) != rows.size()) return 4;
    std::vector<float> out(n * K);
    for (long r = 0; r < n; ++r)
        for (int c = 0; c < K; ++c) out[r * K + c] = dq(rows.data() + r * rb, c);
    fwrite(out.data(), sizeof(float), out.size(), stdout);
    return 0;
}
