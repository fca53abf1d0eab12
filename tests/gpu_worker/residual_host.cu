// Test harness: runs the residual-stream kernels of powerinfer/gpu_worker/kernels/residual.cu on
// the host CPU (host_warp.h), so tests/gpu_worker/test_kernels_compile.py holds them against the
// numpy oracles on a machine with nvcc but no GPU. Runs in: a subprocess of pytest.
// Usage: residual_host norm T D LDX LDY EPS < x (T * LDX float32), w (D float32) > y (T * LDY float32, zero elsewhere)
//        residual_host add T N LDX LDY < x (T * LDX float32), y (T * LDY float32) > y after y += x
#include "host_warp.h"

#include "residual.cu"

int main(int argc, char** argv) {
    if (argc < 6) return 2;
    const bool norm = !strcmp(argv[1], "norm");
    const int T = atoi(argv[2]), D = atoi(argv[3]), ldx = atoi(argv[4]), ldy = atoi(argv[5]);
    if ((norm && argc != 7) || (!norm && (argc != 6 || strcmp(argv[1], "add")))) return 2;
    std::vector<float> x((size_t)T * ldx), w(norm ? D : 0), y((size_t)T * ldy, 0.0f);
    if (fread(x.data(), sizeof(float), x.size(), stdin) != x.size()) return 4;
    std::vector<float>& second = norm ? w : y;
    if (fread(second.data(), sizeof(float), second.size(), stdin) != second.size()) return 4;
    if (norm) {
        const float eps = (float)atof(argv[6]);
        run_warps(T, 32, [&] { rms_norm_rows(x.data(), ldx, y.data(), ldy, T, D, w.data(), eps); });  // a warp per token
    } else {
        run_warps(((long)T * D + 127) / 128, 128, [&] { add_rows(y.data(), ldy, x.data(), ldx, T, D); });
    }
    fwrite(y.data(), sizeof(float), y.size(), stdout);
    return 0;
}
