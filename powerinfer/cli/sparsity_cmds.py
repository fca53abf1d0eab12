"""`powerinfer calibrate`, `powerinfer perplexity` and `powerinfer sparsity-curve`: make a predictor,
measure what it costs.

Runs in: the user's process.

    powerinfer calibrate -m smollm2 --sparsity 0.5 -o smollm2.predictor [--text FILE] [--mode gate]
    powerinfer perplexity -m smollm2 --text held_out.txt --predictor smollm2.predictor
"""

from __future__ import annotations

import math
import sys
from typing import Sequence

from powerinfer.flags import Parser, positive_int, progress, read_text


def _threads_flag(p: Parser) -> None:
    p.add_argument("-t", "--threads", type=positive_int, default=None,
                   help="CPU threads for the model's forward passes (default: torch's, one per core)")


def _use_threads(n: int | None) -> None:
    """These tools run the readable (torch) model in this process: -t caps its threads."""
    if n is not None:
        import torch

        torch.set_num_threads(n)


def run_calibrate(argv: Sequence[str]) -> int:
    from powerinfer.flags import CLIError, output_path

    p = Parser(prog="powerinfer calibrate", description="Profile FFN activations and write a .predictor file for a model.")
    p.add_argument("-m", "--model", required=True, help="GGUF file or known model name")
    p.add_argument("-o", "--output", required=True, help="predictor file to write (e.g. MODEL.predictor)")
    p.add_argument("--text", default=None, help="calibration text file (default: text the model generates itself)")
    p.add_argument("--max-ppl-increase", type=float, default=0.02,
                   help="quality budget (default 0.02 = +2%%): without --sparsity, the sparsest setting (per-layer levels allocated "
                        "by measured damage, each sparse layer at least 75%% sparse, where skipping starts to pay) whose perplexity "
                        "on a held-out fifth of the corpus stays within half of it (a margin for other text) at the upper end of a 95%% "
                        "interval over those tokens")
    p.add_argument("--sparsity", type=float, default=None,
                   help="force one share of FFN neurons skipped per token in every layer instead of the budget search")
    p.add_argument("--mode", choices=["auto", "gate", "predictor", "lowrank"], default="auto",
                   help="gate: dense gate, threshold on it; predictor: a trained low-rank MLP per sparse layer picks neurons (gate, "
                        "up, down skipped); lowrank (gated ReLU-family models): a predictor read off the gate matrix's leading "
                        "singular directions (--rank wide, or the least width keeping --recall), no training and no biases, so "
                        "that --powerinfer exports it exactly; auto (default): with the budget, lowrank (ReLU-family models), else "
                        "a trained predictor, where it stays within the budget and decodes at least 1.05x faster than gate mode (timed "
                        "here in paired rounds), or at least 0.95x as fast and more accurate, else gate; "
                        "with --sparsity, gate")
    p.add_argument("--tokens", type=positive_int, default=4096, help="calibration tokens (default 4096)")
    p.add_argument("--recall", type=float, default=0.97, help="share of activation mass the predicted set keeps (default 0.97)")
    p.add_argument("--rank", type=positive_int, default=None,
                   help="predictor mode: the predictor's hidden width (default d_model / 4 within [32, 128]; lowrank: the least "
                        "width whose choices keep --recall of the activation mass); it is read every token, so a smaller one costs "
                        "fewer bytes and may choose less well")
    p.add_argument("--steps", type=positive_int, default=300, help="predictor mode: training steps per layer (default 300)")
    p.add_argument("--seed", type=int, default=0, help="seed of the calibration text and the predictor's training (default 0)")
    _threads_flag(p)
    args = p.parse_args(argv)
    _use_threads(args.threads)
    from powerinfer.errors import PowerInferError
    from powerinfer.fetch import resolve_model
    from powerinfer.predictors.predictor_file import read_predictor, write_predictor
    from powerinfer.sparsity.calibrate import CalibrationSettings

    if args.seed < 0:
        raise CLIError(f"--seed must be >= 0, got {args.seed}")
    settings = CalibrationSettings(mode=args.mode, sparsity=0.5 if args.sparsity is None else args.sparsity, tokens=args.tokens,
                                   recall=args.recall, seed=args.seed, rank=args.rank or 0, steps=args.steps)
    text = read_text(args.text) if args.text else None
    from powerinfer.predictors.pwri_model import runnable_model

    given = resolve_model(args.model, progress=sys.stderr.isatty())
    model, _ = runnable_model(given)  # a PowerInfer file: calibrate its model (the default output is named after the file given)
    out = output_path(args.output, "-o", (str(given), args.text or ""))  # checked before minutes of work, not after
    if args.rank:
        from powerinfer.config import config_from_gguf
        from powerinfer.gguf_file import GGUFFile

        d_model = config_from_gguf(GGUFFile(model)).d_model
        if args.rank > d_model:  # wider than its input: more bytes a token than it can save, and slow to train
            raise CLIError(f"--rank {args.rank} exceeds the model's width {d_model}; the predictor is read every token (default d/4)")
    if out.exists():
        try:
            read_predictor(out)
        except (PowerInferError, ValueError, OSError):
            raise PowerInferError(f"-o {args.output} exists and is not a .predictor file: not overwritten; remove it or give another name") from None
    if args.sparsity is None:
        from powerinfer.sparsity.budget import calibrate_within_budget

        pf, point = calibrate_within_budget(model, settings, args.max_ppl_increase, text, progress=progress)
        progress(point.report())
    else:
        from powerinfer.sparsity.budget import FORCED_WARN, MIN_LEVEL, calibrate_forced

        if args.sparsity < MIN_LEVEL:  # said up front, at the default log level: the file will look like it works
            print(f"note: --sparsity {args.sparsity:g} is below {MIN_LEVEL:g}, the share of inactive neurons at which the native "
                  "decoder starts skipping rows; every layer will decode dense with this predictor (it still sets what "
                  "perplexity and the torch paths compute)", file=sys.stderr)
        pf, dense, sparse = calibrate_forced(model, settings, text, progress=progress)
        if dense is None or sparse is None:  # too little held-out text
            print("note: too few held-out tokens to score this predictor's quality (raise --tokens)", file=sys.stderr)
            change = 0.0
        else:
            change = sparse / dense - 1
            print(f"held-out perplexity {dense:.3f} dense -> {sparse:.3f} at --sparsity {args.sparsity:g} ({100 * change:+.1f}%)",
                  file=sys.stderr)
        if change > FORCED_WARN:
            print(f"warning: this predictor costs {100 * change:+.0f}% perplexity on held-out text: output will be visibly worse "
                  f"than the model's; a lower --sparsity, or --max-ppl-increase instead, keeps the quality", file=sys.stderr)
    write_predictor(args.output, pf)
    print(args.output)
    return 0


def run_perplexity(argv: Sequence[str]) -> int:
    p = Parser(prog="powerinfer perplexity", description="Dense vs sparse perplexity on a text, predictor recall/precision per layer.")
    p.add_argument("-m", "--model", required=True, help="GGUF file or known model name")
    p.add_argument("--text", required=True, help="text file to score (use text not seen in calibration)")
    p.add_argument("--predictor", default=None, help="predictor file; without it only the dense perplexity is computed")
    p.add_argument("-c", "--ctx-size", type=positive_int, default=512, help="window size in tokens (default 512)")
    p.add_argument("--max-tokens", type=int, default=0, help="score at most this many tokens (0: all)")
    p.add_argument("--decode-path", action="store_true",
                   help="feed every token as its own decode step through the engine generation uses in this process (the native "
                        "decoder's sparse kernels), dense and sparse, instead of the torch shards' masked batches (slower; no "
                        "per-layer recall)")
    _threads_flag(p)
    args = p.parse_args(argv)
    _use_threads(args.threads)
    from powerinfer.fetch import resolve_model
    from powerinfer.gguf_file import GGUFFile
    from powerinfer.predictors.predictor_file import read_predictor
    from powerinfer.sparsity.perplexity import perplexity

    from powerinfer.predictors.pwri_model import runnable_model

    model, pwri = runnable_model(resolve_model(args.model, progress=sys.stderr.isatty()))
    predictor = args.predictor or (pwri.predictor if pwri is not None else None)  # a PowerInfer file's own predictors
    if args.decode_path:
        from powerinfer.sparsity.perplexity import decode_perplexity

        dense, sparse, kind = decode_perplexity(model, read_text(args.text), predictor, n_ctx=args.ctx_size, max_tokens=args.max_tokens,
                                                n_threads=args.threads, progress=progress)
        print(f"decode path ({kind}, every token its own step)")
        print(f"dense perplexity:  {dense:.4f}")
        if sparse is not None:
            print(f"sparse perplexity: {sparse:.4f} ({100 * (sparse / dense - 1):+.2f}%)")
        return 0
    pf = read_predictor(predictor, model=GGUFFile(model)) if predictor else None
    rep = perplexity(model, read_text(args.text), pf, n_ctx=args.ctx_size, max_tokens=args.max_tokens, progress=progress)
    print(f"tokens scored: {rep.tokens}")
    print(f"dense perplexity:  {rep.dense_ppl:.4f}")
    if rep.sparse_ppl is not None:
        change = 100 * (rep.sparse_ppl / rep.dense_ppl - 1)
        print(f"sparse perplexity: {rep.sparse_ppl:.4f} ({change:+.2f}%), mean achieved sparsity {100 * rep.mean_sparsity:.1f}%")
        print(f"{'layer':>5} {'recall':>8} {'precision':>10} {'sparsity':>9}")
        for i, q in enumerate(rep.layers):
            print(f"{i:>5} {q.recall:>8.3f} {q.precision:>10.3f} {100 * q.sparsity:>8.1f}%")
    return 0


def run_sparsity_curve(argv: Sequence[str]) -> int:
    import json
    from dataclasses import asdict
    from pathlib import Path

    from powerinfer.flags import CLIError, report_paths
    from powerinfer.fetch import resolve_model
    from powerinfer.sparsity.curve import INPUT_MODES, operating_point, plot, sweep

    p = Parser(prog="powerinfer sparsity-curve", description="Perplexity against sparsity on held-out text: FFN neurons (gate, predictor) "
                                                                     "or every projection's inputs (input: one level for all; input-greedy: "
                                                                     "levels per layer and site by measured damage).")
    p.add_argument("-m", "--model", required=True, help="GGUF file or known model name")
    p.add_argument("--calib", required=True, help="calibration text file")
    p.add_argument("--held-out", required=True, help="text to score, not seen in calibration")
    p.add_argument("--targets", default="0.05,0.1,0.2,0.3,0.5", help="comma-separated target sparsities")
    p.add_argument("--modes", default="gate,predictor", help="comma-separated: gate, predictor, input, input-greedy (default gate,predictor)")
    p.add_argument("--tokens", type=positive_int, default=4096, help="calibration tokens")
    p.add_argument("--max-tokens", type=positive_int, default=2048, help="held-out tokens scored")
    p.add_argument("--budget", type=float, default=0.02, help="perplexity increase allowed at the operating point (default 0.02)")
    p.add_argument("--plot", default=None, help="PNG of the curve")
    p.add_argument("--json", default=None, help="write the points here")
    _threads_flag(p)
    args = p.parse_args(argv)
    _use_threads(args.threads)
    try:
        targets = [float(t) for t in args.targets.split(",")]
    except ValueError:
        raise CLIError(f"--targets must be comma-separated numbers, got {args.targets!r}") from None
    if any(not 0 < t < 1 for t in targets):
        raise CLIError("--targets must be in (0, 1)")
    report_paths(args.json, args.plot)
    if not 0.0 < args.budget < 1.0:  # also NaN
        raise CLIError(f"--budget must be in (0, 1), got {args.budget}")
    modes = args.modes.split(",")
    if any(m not in ("gate", "predictor", "input", "input-greedy") for m in modes):
        raise CLIError("--modes: any of gate, predictor, input, input-greedy")
    if "input-greedy" in modes and max(targets) > 0.7:
        raise CLIError("--targets: input-greedy targets are shares of the layers' weight bytes, at most 0.7")
    model = resolve_model(args.model, progress=sys.stderr.isatty())
    points = sweep(model, read_text(args.calib), read_text(args.held_out), targets, modes, args.tokens, args.max_tokens, progress)
    dense = {("readable model" if pt.mode.startswith("input") else "engine"): pt.dense_ppl for pt in points}
    print("dense perplexity " + ", ".join(f"{v:.3f} ({k})" for k, v in dense.items()) + f" on {args.max_tokens} held-out tokens")
    print(f"{'mode':<12} {'target':>6} {'achieved':>9} {'perplexity':>11} {'change':>8} {'recall':>7}")
    for pt in points:
        print(f"{pt.mode:<12} {pt.target:>6.2f} {100 * pt.achieved:>8.1f}% {pt.ppl:>11.3f} {100 * pt.increase:>+7.2f}% {pt.recall:>7.3f}")
    # one operating point per mode: "achieved" counts neurons for gate/predictor, weight bytes for input
    for mode in dict.fromkeys(pt.mode for pt in points):
        op = operating_point([pt for pt in points if pt.mode == mode], args.budget)
        if op is None:
            print(f"{mode}: no point within +{100 * args.budget:.1f}%")
        else:
            unit = "of the layers' weight bytes skipped" if mode in INPUT_MODES else "of FFN neurons skipped"
            print(f"{mode} operating point (+{100 * args.budget:.1f}% budget): target {op.target:.2f}, "
                  f"{100 * op.achieved:.1f}% {unit}, {100 * op.increase:+.2f}% perplexity")
    if args.plot:
        plot(points, args.plot, Path(model).name)
        print(f"plot: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps([{**asdict(pt), "increase": pt.increase} for pt in points], indent=1))
    return 0 if all(math.isfinite(pt.ppl) for pt in points) else 1
