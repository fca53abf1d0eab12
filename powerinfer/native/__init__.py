"""Native code: every C source and its ctypes bindings, and the one build helper.

Runs in: any process that calls native code (the coordinator, CPU worker ranks, the GPU worker as
a rank). Grouped by concept:

* build.py: compile a C library once per machine (the system compiler, a cache keyed by content);
* kernels/: the C sources (quant dot products qdot*.h, the dense decoder decoder.c and its headers,
  the sparse FFN rows sparse_rows.h, the torch shards' sparse kernel sparse_ffn.c, the merge comm.c/h
  and GPU hand-off handoff.h);
* decoder_lib.py (the decoder library and the C structs it takes), decoder.py (a model described to
  it, its KV cache), sparse_layers.py (sparse FFNs inside it with their predictors);
* sparse_kernel.py, neuron_major.py: the torch shards' sparse FFN kernel and its weight layout;
* segment.py (the shared-memory segment's layout and mapping), comm.py (creating it, a rank's merge
  handle, latencies), comm_lib.py (the merge alone, for the GPU worker as a rank).
"""
