"""llama.cpp decode timing in its own process, for `powerinfer bench --vs-dense --vs-llama-cpp`.

Runs in: a child process of the benchmark (``python -m powerinfer.sparsity.llama_cpp_runner MODEL
THREADS N_CTX``), so llama.cpp's thread pool and torch's OpenMP pool never share the process
(measured in one process, both pools' waiting threads compete for the cores: llama.cpp decoded
the 1.1B-shaped Q4_0 file at 36 tokens/s there against 87-106 on its own).

Protocol, one JSON object per line: the parent writes ``{"ids": [...], "gen_tokens": N}``, the
child answers ``{"tps": tokens_per_second}`` after prefilling ids (not timed) and greedily
decoding N tokens; ``{"error": "..."}`` on failure. End of input ends the child.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Sequence

import numpy as np


def decode_tps(llm: object, ids: list[int], gen_tokens: int) -> float:
    """Prefill ids, then decode gen_tokens greedy tokens; their tokens/s."""
    llm.reset()  # type: ignore[attr-defined]
    llm.eval(ids)  # type: ignore[attr-defined]
    token = int(np.argmax(llm.scores[llm.n_tokens - 1]))  # type: ignore[attr-defined]
    t = time.perf_counter()
    for _ in range(gen_tokens):
        llm.eval([token])  # type: ignore[attr-defined]
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))  # type: ignore[attr-defined]
    return gen_tokens / (time.perf_counter() - t)


def main(argv: Sequence[str]) -> int:
    import llama_cpp

    model, threads, n_ctx = argv[0], int(argv[1]), int(argv[2])
    llm = llama_cpp.Llama(model_path=model, n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        try:
            req = json.loads(line)
            reply: dict[str, object] = {"tps": decode_tps(llm, [int(i) for i in req["ids"]], int(req["gen_tokens"]))}
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
