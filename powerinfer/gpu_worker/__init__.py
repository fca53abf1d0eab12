"""GPU worker: offloaded layers' attention and the hot neurons on the GPU (our CUDA kernels through
pycuda, or the numpy backend that stands in for them). Runs in the GPU worker process (or the
coordinator, in-process); see docs/gpu.md."""
