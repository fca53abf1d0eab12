"""`powerinfer bench --profile`: where a native decode step's time goes.

Runs in: the user's process (the in-process native executor).

Decodes greedily and splits each step's wall time into the decoder's layer phases (thread 0's
clock between the barriers of kernels/decoder.c, summed over layers), the rest of the one
native call a step makes (embedding lookup, entering the parallel region, final norm, output
head, float32 refinement of the best logits), greedy sampling (an argmax over the vocabulary),
and what is left: the engine's Python around the call (divided by the layer count, the
per-layer Python cost).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from powerinfer.errors import InvalidArgumentError
from powerinfer.sparsity.speed import PROMPT_TEXT


@dataclass(frozen=True)
class DecodeProfile:
    model: str
    threads: int
    steps: int
    step_us: float  # median-free mean wall time per decode step
    phases_us: dict[str, float]  # per step, summed over layers (and the decoder call's own overhead)
    head_us: float  # the native step call outside the layers: embedding, final norm, head, refinement
    rest_us: float  # outside the native call and the sampling: the engine's Python
    n_layers: int
    sampling_us: float  # greedy sampling (argmax over the vocabulary)

    def report(self) -> str:
        lines = [f"model: {self.model}  threads: {self.threads}  {self.steps} decode steps: {self.step_us:.0f} µs a step "
                 f"({1e6 / self.step_us:.1f} tokens/s)"]
        rows = [*self.phases_us.items(), ("embed, head, refine", self.head_us), ("sampling (argmax)", self.sampling_us),
                ("Python (engine)", self.rest_us)]
        for name, us in rows:
            lines.append(f"  {name:<20} {us:8.0f} µs  {us / self.step_us:6.1%}")
        lines.append(f"the engine's Python per layer: {self.rest_us / self.n_layers:.1f} µs")
        return "\n".join(lines)


def profile_decode(model: str, threads: int = 2, prompt_tokens: int = 64, gen_tokens: int = 128, predictor: str | None = None) -> DecodeProfile:
    """predictor: profile the sparse decoder (its predictor shows under gate+up, the sparse FFN under down)."""
    from powerinfer.api import LLM
    from powerinfer.coordinator.native_executor import NativeExecutor
    from powerinfer.native.decoder_lib import PHASES

    llm = LLM(model, n_ctx=prompt_tokens + gen_tokens + 8, n_threads=threads, executor="inprocess", predictor=predictor)
    try:
        ex = llm.engine.executor
        if not isinstance(ex, NativeExecutor):
            raise InvalidArgumentError("--profile needs the native decoder (in-process executor, dense, a C compiler)")
        spent = {"step": 0.0}
        real_step = ex.native_step

        def timed_step(*args: Any) -> np.ndarray:
            t = time.perf_counter()
            out = real_step(*args)
            spent["step"] += time.perf_counter() - t
            return out

        ex.native_step = timed_step  # type: ignore[method-assign]
        eng = llm.engine
        ids = llm.tokenize(PROMPT_TEXT * (1 + prompt_tokens // 20))[:prompt_tokens]
        token = int(np.argmax(eng.eval(ids)[-1]))
        for _ in range(4):  # warm
            token = int(np.argmax(eng.eval([token])[-1]))
        spent["step"] = 0.0
        prof = ex.decoder.profile(True)
        sampling = 0.0
        t0 = time.perf_counter()
        for _ in range(gen_tokens):
            logits = eng.eval([token])
            ts = time.perf_counter()
            token = int(np.argmax(logits[-1]))  # greedy sampling: the vocabulary's argmax
            sampling += time.perf_counter() - ts
        wall = time.perf_counter() - t0
        ex.decoder.profile(False)
        ex.native_step = real_step  # type: ignore[method-assign]
        per = 1e6 / gen_tokens
        phases = {name: float(v) * per for name, v in zip(PHASES, prof)}
        call = spent["step"] * per
        rest_of_call = call - sum(phases.values())  # embedding, region, final norm, head, refinement
        step = wall * per
        return DecodeProfile(llm.config.name, threads, gen_tokens, step, phases, rest_of_call, step - call - sampling * per,
                             llm.config.n_layers, sampling * per)
    finally:
        llm.close()


def as_dict(p: DecodeProfile) -> dict[str, Any]:
    return {"model": p.model, "threads": p.threads, "steps": p.steps, "step_us": p.step_us, "phases_us": p.phases_us,
            "head_us": p.head_us, "sampling_us": p.sampling_us, "rest_us": p.rest_us}
