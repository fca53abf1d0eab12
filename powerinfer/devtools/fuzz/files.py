"""File fuzzing entry point: ``python -m powerinfer.devtools.fuzz.files --cases 20000 --seed S [--model PATH]``.

Runs in: the user's (or the test's) process, which generates the cases; each case is loaded in a
child worker process (see :mod:`powerinfer.devtools.fuzz.runner`).

Prints a summary (cases per class and their outcomes, mutation operators tried, clean errors,
successful loads, crashes, hangs, the slowest case) and exits 1 when any case crashed the worker,
hung, raised something other than a PowerInferError, ran out of memory, produced an unprintable
error message, or contradicted its class's expectation. ``--only`` restricts the classes (a regex)
and ``--start`` picks the first case index, so one failing case can be re-run by its seed:index.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from powerinfer.devtools.fuzz.bases import Base, make_bases
from powerinfer.devtools.fuzz.cases import generate
from powerinfer.devtools.fuzz.runner import Runner, Summary, run_cases

log = logging.getLogger(__name__)

FAILURE_OUTCOMES = ("crash", "hang", "uncaught", "memory", "bad_message", "unexpected")


def default_real_models() -> dict[str, Path]:
    """The real models already in the cache (never downloads)."""
    from powerinfer.fetch import MODELS, cached_path

    out: dict[str, Path] = {}
    for name in MODELS:
        try:
            path = cached_path(name)
        except OSError:
            path = None
        if path is not None:
            out[name] = path
    return out


def _real_name(path: Path) -> str:
    from powerinfer.fetch import MODELS

    return next((name for name, spec in MODELS.items() if spec.filename == path.name), path.stem)


def fuzz(seed: int, n_cases: int, workdir: Path, real_models: dict[str, Path] | None = None, *, real_share: float = 0.15,
         timeout: float = 20.0, memory_headroom: int = 3 << 30, only: str | None = None, start: int = 0,
         save_failures: Path | None = None, progress_every: float = 0.0) -> tuple[Summary, dict[str, Base]]:
    """Make the bases in ``workdir``, generate and run the cases; returns the summary and the bases."""
    bases = make_bases(workdir / "bases", real_models)
    model_path = str(bases["synthetic-llama"].path)
    warmup = [{"path": str(b.path), "kind": b.kind, "model_path": model_path} for b in bases.values()]
    runner = Runner(workdir / "cases", timeout=timeout, memory_headroom=memory_headroom, warmup=warmup,
                    model_path=model_path)
    began = last = time.monotonic()

    def progress(s: Summary) -> None:
        nonlocal last
        if progress_every and time.monotonic() - last >= progress_every:
            last = time.monotonic()
            print(f"  {s.cases}/{n_cases} cases, {s.count(*FAILURE_OUTCOMES)} failures, {last - began:.0f} s",
                  file=sys.stderr, flush=True)

    cases = generate(seed, n_cases, bases, real_share=real_share, only=only, start=start)
    return run_cases(cases, runner, progress, save_failures), bases


def format_summary(s: Summary, seed: int, bases: dict[str, Base]) -> str:
    lines = [f"powerinfer file fuzz: {s.cases} cases, seed {seed}, {s.elapsed:.1f} s "
             f"({s.cases / max(s.elapsed, 1e-9):.1f} cases/s); worker address-space limit {s.memory_limit / 2**30:.2f} GiB"]
    lines.append("bases: " + ", ".join(
        f"{b.name} ({b.size / 2**20:.1f} MiB" + (f", header {len(b.head) / 2**20:.1f} MiB)" if b.tail_len else ")")
        for b in bases.values()))
    lines += ["", f"{'class':<28} {'cases':>7} {'loaded':>7} {'refused':>8} {'failed':>7}"]
    for cls in sorted(s.per_class):
        o = s.per_class_outcomes[cls]
        failed = sum(o[k] for k in FAILURE_OUTCOMES)
        lines.append(f"{cls:<28} {s.per_class[cls]:>7} {o['loaded']:>7} {o['clean_error']:>8} {failed:>7}")
    mutated = sum(n for cls, n in s.per_class.items() if cls.startswith("mutate."))
    lines += ["", f"mutations tried: {sum(s.ops.values())} in {mutated} mutated files ("
              + ", ".join(f"{op} {n}" for op, n in s.ops.most_common()) + ")"]
    lines.append("clean refusals by stage: " + ", ".join(f"{k} {n}" for k, n in s.stage_refusals.most_common()))
    lines.append(f"successful loads: {s.outcomes['loaded']}   clean errors: {s.outcomes['clean_error']}")
    lines.append(f"crashes: {s.outcomes['crash']}   hangs: {s.outcomes['hang']}   uncaught exceptions: "
                 f"{s.outcomes['uncaught']}   memory: {s.outcomes['memory']}   bad messages: {s.outcomes['bad_message']}   "
                 f"unexpected: {s.outcomes['unexpected']}")
    if s.slowest is not None:
        c = s.slowest.case
        lines.append(f"slowest case: {c.seed}:{c.index} {c.cls} on {c.base}{' ' + '+'.join(c.ops) if c.ops else ''} "
                     f"{s.slowest.elapsed:.2f} s ({s.slowest.outcome})")
    for r in s.failures[:20]:
        lines.append(f"FAILED {r.case.seed}:{r.case.index} {r.case.cls} on {r.case.base}: {r.outcome}: {r.detail}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m powerinfer.devtools.fuzz.files", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=2000, help="number of cases (default 2000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start", type=int, default=0, help="index of the first case (to re-run one: --start I --cases 1)")
    p.add_argument("--model", action="append", type=Path, default=None,
                   help="a real GGUF model to mutate (repeatable; default: the cached smollm2 / gemma3-270m)")
    p.add_argument("--no-real", action="store_true", help="only the small synthetic bases")
    p.add_argument("--real-share", type=float, default=0.15, help="share of cases on real models (default 0.15)")
    p.add_argument("--only", default=None, help="regex on class names (e.g. 'tensor\\.|mutate.smollm2')")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds one case may take (default 20)")
    p.add_argument("--memory-headroom", type=int, default=3072, help="MiB a case may allocate (default 3072)")
    p.add_argument("--save-failures", type=Path, default=None, help="copy failing case files into this folder")
    p.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a temporary one)")
    args = p.parse_args(argv)
    logging.basicConfig(level="WARNING", format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    real: dict[str, Path] = {}
    if not args.no_real:
        real = {_real_name(m): m for m in args.model} if args.model else default_real_models()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="powerinfer-fuzz-"))
    try:
        summary, bases = fuzz(args.seed, args.cases, workdir, real, real_share=args.real_share, timeout=args.timeout,
                              memory_headroom=args.memory_headroom << 20, only=args.only, start=args.start,
                              save_failures=args.save_failures, progress_every=30.0)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(format_summary(summary, args.seed, bases))
    return 1 if summary.count(*FAILURE_OUTCOMES) else 0


if __name__ == "__main__":
    sys.exit(main())
