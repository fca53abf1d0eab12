"""GPU worker: hot neurons and offloaded layers on the GPU (PyCUDA kernels). Runs in the GPU worker
process. Not built yet: the engine core runs every shard on the CPU (see docs/architecture.md)."""
