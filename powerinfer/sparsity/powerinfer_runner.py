"""PowerInfer's own CPU build timed on a PWRI file, for `powerinfer bench --sparse --vs-powerinfer PATH`.

Runs in: the benchmark's process, which starts PowerInfer's ``main`` once per round as a child
(its load is a memory map of a file the page cache already holds, so a round pays little for it)
and reads the timings it prints.

PowerInfer (SJTU-IPADS/PowerInfer, built from source on the CPU: docs/powerinfer-models.md) is a
fork of llama.cpp from late 2023: its ``main`` prints ``llama_print_timings`` lines with the
prompt's and the decode steps' milliseconds, which are its own clock of the same work we time
(prefill of the prompt in one batch, then greedy decode steps that ignore end-of-text).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from powerinfer.errors import PowerInferError

_PROMPT = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
_EVAL = re.compile(r"(?<!prompt )eval time =\s*([\d.]+) ms /\s*(\d+) runs")


def find_main(path: str | Path) -> Path:
    """PowerInfer's ``main``: the path itself, or build/bin/main under a checkout."""
    p = Path(path)
    for cand in (p, p / "build" / "bin" / "main"):
        if cand.is_file() and os.access(cand, os.X_OK):
            return cand
    raise PowerInferError(f"{path}: not PowerInfer's main binary nor a checkout with build/bin/main "
                          "(build it: docs/powerinfer-models.md)")


def parse_timings(text: str) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) from main's llama_print_timings lines."""
    prompt, steps = _PROMPT.search(text), _EVAL.search(text)
    if prompt is None or steps is None or float(prompt.group(1)) <= 0 or float(steps.group(1)) <= 0:
        raise PowerInferError("PowerInfer's main printed no prompt and decode timings")
    return int(prompt.group(2)) / (float(prompt.group(1)) / 1e3), int(steps.group(2)) / (float(steps.group(1)) / 1e3)


class PowerInferMain:
    """Runs ``main -m MODEL -p PROMPT -n N`` greedily at a thread count and times it."""

    def __init__(self, binary: str | Path, model: str | Path, threads: int, n_ctx: int, env: dict[str, str] | None = None) -> None:
        self.binary, self.model, self.threads, self.n_ctx = find_main(binary), Path(model), threads, n_ctx
        self.env = {**os.environ, **(env or {})}

    def run(self, prompt: str, gen_tokens: int) -> tuple[float, float]:
        """(prefill, decode) tokens/s of one run: prompt in one batch, then gen_tokens greedy steps."""
        cmd = [str(self.binary), "-m", str(self.model), "-p", prompt, "-n", str(gen_tokens), "-t", str(self.threads),
               "-c", str(self.n_ctx), "-b", str(self.n_ctx), "--temp", "0", "--repeat-penalty", "1.0", "--ignore-eos"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=900)
        except subprocess.TimeoutExpired:
            raise PowerInferError(f"PowerInfer's main on {self.model} ran past 15 minutes") from None
        if r.returncode != 0:
            tail = " | ".join(r.stderr.strip().splitlines()[-3:])
            raise PowerInferError(f"PowerInfer's main failed on {self.model} (exit {r.returncode}): {tail[:400]}")
        return parse_timings(r.stderr + r.stdout)
