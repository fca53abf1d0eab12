"""Native code shared by the CPU workers and the GPU worker: the C build helper, the native pool's shared-memory segment and its merge and hand-off code."""
