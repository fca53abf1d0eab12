"""What the `powerinfer` command tells the user: the load summary, the timing summary, per-layer figures.

Runs in: the user's process (the coordinator). Everything goes to stderr, so stdout carries only
the generated text and can be piped.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import TYPE_CHECKING, TextIO

from powerinfer.coordinator.stats import mib

if TYPE_CHECKING:
    from powerinfer.api import LLM


def _memory_of(pids: list[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def _mode_line(llm: LLM) -> str:
    pf = llm.predictor
    if pf is None:
        return "mode       dense: every FFN neuron is computed (no predictor loaded)"
    if not llm.sparse:
        return f"mode       dense (--no-sparse): predictor for {pf.model_name} loaded and checked, not used"
    how = "a low-rank predictor picks the neurons" if pf.mode == "predictor" else "gate computed, up/down for gated neurons"
    if pf.calibration.get("source") == "powerinfer":  # PowerInfer records no expected sparsity
        return f"mode       sparse ({pf.mode}): {how}; PowerInfer's predictor (no expected sparsity recorded)"
    return f"mode       sparse ({pf.mode}): {how}; calibrated for {100 * pf.target_sparsity:.0f}% of neurons skipped"


def mode_line(llm: LLM) -> str:
    """The one line saying whether sparse execution is on (printed even when the full summary is not)."""
    return _mode_line(llm).replace("mode       ", "", 1)


def load_summary(llm: LLM) -> str:
    """One screen: model, architecture, quant mix, mode, where each part lives, memory used."""
    cfg, f = llm.config, llm.file
    quant = Counter(t.qtype.name for t in f)
    mix = ", ".join(f"{name} x{n}" for name, n in quant.most_common())
    desc = llm.engine.executor.describe()
    pids = list(desc.pids)
    lines = [
        f"model      {cfg.name} ({cfg.arch}): {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads "
        f"({cfg.n_kv_heads} kv), FFN {cfg.n_ff}, vocab {cfg.vocab_size}",
        f"file       {f.path} ({mib(f.size)}); tensors: {mix}",
        f"context    {llm.n_ctx} tokens (trained: {cfg.context_length}); batch {llm.engine.n_batch}",
        _mode_line(llm),
    ]
    lines += desc.placement
    rss = _memory_of([os.getpid(), *pids])
    lines.append(f"memory     packed weights and KV cache {mib(llm.engine.weight_bytes)}; resident {mib(rss)} in {1 + len(pids)} process(es)")
    return "\n".join(lines)


def timing_summary(llm: LLM) -> str:
    """llama.cpp-style perf lines for the last generation."""
    t = llm.timings

    def line(label: str, seconds: float, n: int, unit: str, each: str = "token") -> str:
        per = seconds * 1000 / n if n else 0.0
        tps = n / seconds if seconds > 0 else 0.0
        plural = each + ("es" if each.endswith("s") else "s")
        return f"{label:<17}= {seconds * 1000:10.2f} ms / {n:5d} {unit:<6} ({per:8.2f} ms per {each}, {tps:8.2f} {plural} per second)"

    extra = []
    share = llm.engine.executor.describe().computed_share
    if llm.sparse and share is not None:
        extra.append(f"{'FFN computed':<17}= {100 * share:10.1f} % of neurons per decode step (average over layers)")
    core = llm.core
    if core.lookup and t.decode_s > 0:  # several tokens per pass: say how many, and the speed in tokens
        n = max(0, t.generated_tokens - 1)  # the first token came from the prompt's pass
        extra.append(f"{'lookup':<17}= {core.accepted:5d} of {core.drafted} drafted tokens accepted (since load); "
                     f"{n} tokens in {t.decode_evals} passes, {n / t.decode_s:.2f} tokens per second")
    return "\n".join(
        [
            f"{'load time':<17}= {t.load_s * 1000:10.2f} ms",
            line("prompt eval time", t.prompt_s, t.prompt_tokens, "tokens"),
            line("eval time", t.decode_s, t.decode_evals, "runs", "pass" if llm.core.lookup else "token"),
            f"{'total time':<17}= {(t.prompt_s + t.generate_s) * 1000:10.2f} ms / {t.prompt_tokens + t.generated_tokens:5d} tokens",
            *extra,
        ]
    )


def layer_figures(llm: LLM) -> str:
    """--verbose: where a layer's time goes (each executor says it: compute vs IPC, merges, the GPU's share)."""
    return "\n".join(llm.engine.executor.describe().figures)


def print_report(llm: LLM, out: TextIO, verbose: bool) -> None:
    print(timing_summary(llm), file=out)
    if verbose:
        print(layer_figures(llm), file=out)
