"""llama.cpp timing in its own process, for `powerinfer bench --vs-llama-cpp` (dense and sparse).

Runs in: a child process of the benchmark (``python -m powerinfer.sparsity.llama_cpp_runner MODEL
THREADS N_CTX``; :class:`LlamaCppClient` starts and drives it from the benchmark's process), so
llama.cpp's thread pool and our OpenMP pool never share the process
(measured in one process, both pools' waiting threads compete for the cores: llama.cpp decoded
the 1.1B-shaped Q4_0 file at 36 tokens/s there against 87-106 on its own).

Protocol, one JSON object per line: the parent writes ``{"ids": [...], "gen_tokens": N}``, the
child answers ``{"tps": decode_tokens_per_second, "prefill_tps": prompt_tokens_per_second}``
after prefilling ids (from an empty cache, in one batch) and greedily decoding N tokens;
``{"error": "..."}`` on failure. End of input ends the child.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from typing import Any, Sequence

import numpy as np

from powerinfer.errors import PowerInferError


def timed(llm: object, ids: list[int], gen_tokens: int) -> tuple[float, float]:
    """Prefill ids, then decode gen_tokens greedy tokens: (prefill tokens/s, decode tokens/s)."""
    llm.reset()  # type: ignore[attr-defined]
    t = time.perf_counter()
    llm.eval(ids)  # type: ignore[attr-defined]
    prefill = len(ids) / (time.perf_counter() - t)
    token = int(np.argmax(llm.scores[llm.n_tokens - 1]))  # type: ignore[attr-defined]
    t = time.perf_counter()
    for _ in range(gen_tokens):
        llm.eval([token])  # type: ignore[attr-defined]
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))  # type: ignore[attr-defined]
    return prefill, gen_tokens / (time.perf_counter() - t)


def main(argv: Sequence[str]) -> int:
    import llama_cpp

    model, threads, n_ctx = argv[0], int(argv[1]), int(argv[2])
    llm = llama_cpp.Llama(model_path=model, n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        try:
            req = json.loads(line)
            prefill, decode = timed(llm, [int(i) for i in req["ids"]], int(req["gen_tokens"]))
            reply: dict[str, object] = {"tps": decode, "prefill_tps": prefill}
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)
    llm.close()
    return 0


class LlamaCppClient:
    """llama.cpp (llama-cpp-python) in a child process decoding the same tokens: see llama_cpp_runner."""

    def __init__(self, model: str, threads: int, n_ctx: int) -> None:
        if importlib.util.find_spec("llama_cpp") is None:
            raise PowerInferError("--vs-llama-cpp needs llama-cpp-python (pip install llama-cpp-python)")
        self.proc = subprocess.Popen([sys.executable, "-m", "powerinfer.sparsity.llama_cpp_runner", model, str(threads), str(n_ctx)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._read()  # {"ready": true} once the model is loaded

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise PowerInferError(f"llama.cpp runner exited: {(err.strip().splitlines() or ['no output'])[-1]}")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise PowerInferError(f"llama.cpp runner: {reply['error']}")
        return reply

    def run(self, ids: list[int], gen_tokens: int) -> tuple[float, float]:
        """(prefill tokens/s of ids, decode tokens/s of gen_tokens greedy steps after them)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"ids": ids, "gen_tokens": gen_tokens}) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        return float(reply["prefill_tps"]), float(reply["tps"])

    def decode_tps(self, ids: list[int], gen_tokens: int) -> float:
        return self.run(ids, gen_tokens)[1]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
