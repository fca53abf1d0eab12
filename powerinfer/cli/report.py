"""What the `powerinfer` command tells the user: the load summary, the timing summary, per-layer figures.

Runs in: the user's process (the coordinator). Everything goes to stderr, so stdout carries only
the generated text and can be piped.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import TYPE_CHECKING, TextIO

import numpy as np

if TYPE_CHECKING:
    from powerinfer.api import LLM


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


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
    ex = llm.engine.executor
    pids: list[int] = list(getattr(ex, "pids", []))
    lines = [
        f"model      {cfg.name} ({cfg.arch}): {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads "
        f"({cfg.n_kv_heads} kv), FFN {cfg.n_ff}, vocab {cfg.vocab_size}",
        f"file       {f.path} ({_mib(f.size)}); tensors: {mix}",
        f"context    {llm.n_ctx} tokens (trained: {cfg.context_length}); batch {llm.engine.n_batch}",
        _mode_line(llm),
    ]
    pl = getattr(ex, "placement", None)
    if pl is not None:  # hybrid: GPU worker + cold neurons here
        gpu_pids = list(getattr(getattr(ex, "gpu", None), "pids", []))
        hot = sum(len(h) for h in pl.hot)
        from powerinfer.gpu_worker.client import NoGpu

        none = isinstance(getattr(ex, "gpu", None), NoGpu)
        worker = " not started: the budget holds no part of any layer" if none else f" (pid {gpu_pids[0]})" if gpu_pids else " (in process)"
        lines.append(f"placement  GPU worker{worker}, {pl.mode} split: "
                     f"attention of {sum(pl.gpu_layers)}/{cfg.n_layers} layers, {hot}/{cfg.n_ff * cfg.n_layers} FFN neurons hot "
                     f"({100 * pl.mass_on_gpu:.0f}% of the activation mass), {_mib(pl.used)} of a {_mib(pl.budget)} budget")
        native = getattr(getattr(ex, "native", None), "only", None) or ()
        where = f"; {len(native)} layers with no GPU part: the native decoder, this process" if native else ""
        lines.append(f"           cold neurons and the other layers' attention: this process{where}; coordinator: embeddings, norms, head, "
                     "sampling")
    elif pids:
        placements = getattr(ex, "placements", ())
        where = ", ".join(f"w{p.worker}: node {p.node} cpus {','.join(map(str, p.cpus))}" for p in placements) or "not pinned"
        ranks = getattr(ex, "ranks", None)
        if ranks is not None:  # the native pool
            lines.append(f"placement  {len(ranks)} CPU worker processes ({where}), each a native rank of every layer, merging in shared "
                         "memory; coordinator: steps, refinement of the best logits, sampling")
            lines.append("shards     " + ", ".join(f"w{i}: q heads {r.q0}-{r.q1 - 1}, neurons {r.n0}-{r.n1 - 1}, rows {r.d0}-{r.d1 - 1}"
                                                   for i, r in enumerate(ranks)))
            spec = getattr(ex, "gpu_spec", None)
            if spec is not None:  # the GPU worker is one more rank (coordinator/gpu_rank.py)
                on, split = spec.layers, spec.split_layers
                hot = sum(len(spec.setup.plan.hot[i]) for i in split)
                parts = [f"{len(on)}/{cfg.n_layers} whole layers ({_runs(on)}) handed over as the residual stream"] if on else []
                if split:
                    parts.append(f"in {len(split)} layers ({_runs(split)}) the attention of {len(spec.attn_layers)} and {hot} hot "
                                 "neurons, the cold ones on the CPU ranks")
                lines.append(f"placement  GPU worker (pid {pids[-1]}) as a rank of the pool: {'; '.join(parts)}; "
                             f"{_mib(ex.gpu_bytes)} of a {_mib(spec.setup.budget)} budget")
        else:
            lines.append(f"placement  {len(pids)} CPU worker processes ({where}); coordinator: embeddings, norms, sampling")
            plan = ex.plan
            heads = ", ".join(f"w{i}: kv {h.kv_start}-{h.kv_stop - 1}" if h else f"w{i}: -" for i, h in enumerate(plan.heads))
            lines.append(f"shards     attention {heads}; FFN and output head split evenly")
    else:
        lines.append("placement  everything in this process (in-process executor)")
    rss = _memory_of([os.getpid(), *pids])
    lines.append(f"memory     packed weights and KV cache {_mib(llm.engine.weight_bytes)}; resident {_mib(rss)} in {1 + len(pids)} process(es)")
    return "\n".join(lines)


def _runs(layers: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) -> "0-2, 5"."""
    out: list[str] = []
    for i in layers:
        if out and out[-1].split("-")[-1] == str(i - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out)


def timing_summary(llm: LLM) -> str:
    """llama.cpp-style perf lines for the last generation."""
    t = llm.timings

    def line(label: str, seconds: float, n: int, unit: str, each: str = "token") -> str:
        per = seconds * 1000 / n if n else 0.0
        tps = n / seconds if seconds > 0 else 0.0
        plural = each + ("es" if each.endswith("s") else "s")
        return f"{label:<17}= {seconds * 1000:10.2f} ms / {n:5d} {unit:<6} ({per:8.2f} ms per {each}, {tps:8.2f} {plural} per second)"

    extra = []
    shares = getattr(llm.engine.executor, "decode_share", None)
    if llm.sparse and shares is not None:
        extra.append(f"{'FFN computed':<17}= {100 * shares():10.1f} % of neurons per decode step (average over layers)")
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
    """--verbose: where a layer's time goes (process executor: compute vs IPC per request kind)."""
    stats = getattr(llm.engine.executor, "stats", None)
    if stats is None:
        return "per-layer figures: in-process executor (no IPC); see `powerinfer bench` for speed"
    if hasattr(stats, "ffn_calls"):  # hybrid executor
        n, na = max(1, stats.ffn_calls), max(1, stats.attention_calls)
        pl = llm.engine.executor.placement  # type: ignore[attr-defined]
        ratio = sum(len(h) for h in pl.hot) / (llm.config.n_ff * llm.config.n_layers)
        lines = [f"hot-neuron ratio {100 * ratio:.1f}% ({100 * pl.mass_on_gpu:.0f}% of the activation mass)"]
        if stats.whole_layer_calls:
            lines.append(f"  layers wholly on the GPU: {stats.gpu_layers_s / stats.whole_layer_calls * 1e6:10.1f} µs per layer "
                         f"({stats.layer_runs} requests for {stats.whole_layer_calls} layer calls)")
        if stats.native_layer_calls:
            lines.append(f"  layers with no GPU part (native decoder): {stats.cpu_layers_s / stats.native_layer_calls * 1e6:10.1f} µs per layer "
                         f"({stats.native_layer_calls} layer calls)")
        if stats.ffn_calls:
            lines += [
                f"  split layers, per FFN call (n={stats.ffn_calls}): CPU cold neurons {stats.cpu_ffn_s / n * 1e6:10.1f} µs   "
                f"waiting for the GPU's hot partial {stats.gpu_ffn_wait_s / n * 1e6:10.1f} µs",
                f"  split layers' attention (n={stats.attention_calls}): GPU {stats.gpu_attention_s / na * 1e6:10.1f} µs, "
                f"CPU {stats.cpu_attention_s / na * 1e6:10.1f} µs per call",
            ]
        return "\n".join(lines)
    merge = getattr(llm.engine.executor, "merge_latencies_ns", None)
    if merge is not None:  # the native pool: one step per forward pass
        n = max(1, stats.calls)
        ranks = len(getattr(llm.engine.executor, "ranks", ())) or 1
        lat = merge() / 1e3
        med = f"{float(np.median(lat)):.1f}" if lat.size else "-"
        p99 = f"{float(np.percentile(lat, 99)):.1f}" if lat.size else "-"
        gpu = [f"waiting for the GPU rank (its runs of layers, attention and hot neurons, beyond the CPU ranks' own work): "
               f"{stats.gpu_us / n:.1f} µs a step"] * bool(stats.gpu_us)
        return "\n".join([
            f"per step (n={stats.calls}): round trip {stats.round_trip_us / n:.1f} µs, a rank's native time {stats.compute_us / n / ranks:.1f} µs, "
            f"of it {100 * stats.wait_share:.1f}% waiting in merges ({stats.syncs / n:.0f} merges a step)",
            f"merge latency per sync: median {med} µs, p99 {p99} µs",
            *gpu,
        ])
    rows = ["per request (averaged over this run)   calls   round trip µs   worker compute µs   IPC µs"]
    for name in ("attention", "ffn", "head"):
        st = getattr(stats, name)
        if st.calls:
            rows.append(
                f"  {name:<36} {st.calls:6d} {st.round_trip_us / st.calls:15.1f} {st.compute_us / st.calls:19.1f} {st.ipc_us / st.calls:8.1f}"
            )
    rows.append("  sparsity and GPU figures (hot-neuron ratio, predicted active share, transfer time): dense CPU run, none")
    return "\n".join(rows)


def print_report(llm: LLM, out: TextIO, verbose: bool) -> None:
    print(timing_summary(llm), file=out)
    if verbose:
        print(layer_figures(llm), file=out)
