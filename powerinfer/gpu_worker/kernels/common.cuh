// Shared helpers of the GPU worker's kernels (powerinfer/gpu_worker/kernels/).
// Runs in: the GPU worker process (compiled at run time by pycuda's SourceModule; CI compiles every
// .cu with `nvcc -arch=sm_90 -cubin` to catch errors and warnings without a GPU).
#pragma once
#include <cuda_fp16.h>

// Little-endian float16 at any byte address (host too: the block decoders are tested on the CPU): GGUF blocks (18, 22, 210 bytes...) do not keep
// 2-byte alignment for every field, so fields are assembled from bytes, never cast in place.
__host__ __device__ __forceinline__ float load_f16(const unsigned char* p) {
    return __half2float(__ushort_as_half((unsigned short)(p[0] | (p[1] << 8))));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
