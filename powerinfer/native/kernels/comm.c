/* The shared-memory segment's native code alone, for a process that is not a CPU rank: the GPU
 * worker serving as a rank of the native pool (powerinfer/gpu_worker/rank.py) waits for its
 * hand-offs and answers them through these entry points (handoff.h), without the decoder.
 *
 * Runs in: the GPU worker process (loaded with ctypes by powerinfer/native/comm_lib.py). The CPU
 * ranks and the coordinator get the same functions inside the decoder library (decoder.c
 * includes both headers).
 */
#include "comm.h"
#include "handoff.h"
