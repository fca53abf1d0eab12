"""Run fuzz cases in a child process with a per-case time limit and an address-space limit.

Runs in: the fuzzing parent process (``Runner``) and the child worker process (``_worker_main``).

The parent writes each case's file (a sparse tail of zeros for real models), sends its path over a
pipe and waits at most ``timeout`` seconds. The child loads it (:func:`powerinfer.devtools.fuzz.load.load_case`
by default) under ``RLIMIT_AS`` = its own size after warming up + ``memory_headroom``, so that an
allocation sized by a count the parser failed to check raises MemoryError instead of exhausting the
machine. A child that dies (a signal, a C-level crash, os._exit) is a ``crash``; one that does not
answer in time is killed and counted as a ``hang``; either way a fresh child takes the next case.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import resource
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from powerinfer.devtools.fuzz.cases import SMALL_MODELS, SMALL_PREDICTORS, Case, check_expectation
from powerinfer.devtools.fuzz.load import CLEAN, FAILURES, OK

log = logging.getLogger(__name__)

CRASH, HANG, UNEXPECTED = "crash", "hang", "unexpected"


def _vm_size() -> int:
    """This process's virtual memory size in bytes (0 where /proc is unavailable)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _worker_main(conn: Connection, loader: str, warmup: list[dict[str, Any]], headroom: int) -> None:
    # Readers log warnings about odd-but-accepted files; thousands of them would drown the summary.
    logging.getLogger().addHandler(logging.NullHandler())
    logging.getLogger().setLevel(logging.ERROR)
    module, _, name = loader.partition(":")
    load: Callable[[Mapping[str, Any]], dict[str, Any]] = getattr(importlib.import_module(module), name)
    for job in warmup:  # imports, the tokenizers of the bases, the model a predictor is checked against
        load(job)
    limit = _vm_size() + headroom
    if headroom > 0 and limit > headroom:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    conn.send(("ready", limit))
    while True:
        job = conn.recv()
        if job is None:
            return
        conn.send(("done", load(job)))


@dataclass
class CaseResult:
    case: Case
    outcome: str  # "loaded", "clean_error", or a failure: uncaught, memory, bad_message, crash, hang, unexpected
    elapsed: float
    detail: str = ""  # first failing stage and why; for clean errors the open-stage message
    stages: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.outcome not in ("loaded", "clean_error")


# The stages that make up "loading" each kind of base; the others are cross-checks (a model read as
# a predictor, a predictor read as a GPU index), which are expected to refuse it cleanly.
_MODEL_STAGES = frozenset({"open", "metadata", "inspect", "config", "tokenizer", "tokenize", "template", "tensors",
                           "fingerprint"})
PRIMARY_STAGES: dict[str, frozenset[str]] = {
    "predictor": frozenset({"open_powerinfer", "read_predictor", "predict", "read_predictor_model"}),
    "predictor-gate": frozenset({"open_powerinfer", "read_predictor", "read_predictor_model"}),
    "pwri": frozenset({"open_powerinfer", "read_predictor", "predict", "read_predictor_model", "read_powerinfer_predictor",
                       "runnable_model"}),
    "gpuidx": frozenset({"open_powerinfer", "read_gpuidx"}),
}


def classify(case: Case, stages: list[tuple[str, str, str]]) -> tuple[str, str]:
    """(outcome, detail) of a case from its stage results."""
    for name, status, detail in stages:
        if status in FAILURES:
            return status, f"{name}: {detail}"
    opened = next(((s, d) for n, s, d in stages if n in ("open", "open_powerinfer")), (OK, ""))
    problem = check_expectation(case, opened[0] == OK, opened[1])
    if problem is not None:
        return UNEXPECTED, problem
    primary = PRIMARY_STAGES.get(case.base, _MODEL_STAGES)
    refused = [(n, d) for n, s, d in stages if s == CLEAN and n in primary]
    if refused:
        return "clean_error", f"{refused[0][0]}: {refused[0][1]}"
    return "loaded", ""


class Runner:
    """One child worker at a time; restarts it after a crash or a hang."""

    def __init__(self, workdir: Path, *, timeout: float = 20.0, memory_headroom: int = 3 << 30,
                 loader: str = "powerinfer.devtools.fuzz.load:load_case", warmup: Iterable[Mapping[str, Any]] = (),
                 model_path: str = "") -> None:
        self.workdir = workdir
        self.timeout, self.headroom, self.loader = timeout, memory_headroom, loader
        self.warmup = [dict(j) for j in warmup]
        self.model_path = model_path
        self.memory_limit = 0
        self._ctx = mp.get_context("spawn")
        self._proc: Any = None
        self._conn: Connection | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    def _start(self) -> None:
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_worker_main, args=(child, self.loader, self.warmup, self.headroom),
                                       daemon=True, name="powerinfer-fuzz-worker")
        self._proc.start()
        child.close()
        self._conn = parent
        # warming up loads every base once (Gemma's tokenizer: seconds); allow for a slow machine
        if not parent.poll(120 + 30 * len(self.warmup)):
            self.stop()
            raise RuntimeError("the fuzz worker did not start")
        _, self.memory_limit = parent.recv()

    def stop(self) -> None:
        if self._proc is None:
            return
        try:
            if self._conn is not None and self._proc.is_alive():
                self._conn.send(None)
                self._proc.join(5)
        except (OSError, EOFError):
            pass
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        if self._conn is not None:
            self._conn.close()
        self._proc, self._conn = None, None

    def _write(self, case: Case) -> Path:
        path = self.workdir / f"case-{case.seed}-{case.index}.bin"
        with open(path, "wb") as fh:
            fh.write(case.content)
            if case.zero_tail:
                fh.truncate(len(case.content) + case.zero_tail)  # a hole: no disk blocks are written
        return path

    def run(self, case: Case) -> CaseResult:
        if self._proc is None:
            self._start()
        assert self._conn is not None
        path = self._write(case)
        job = {"path": str(path), "kind": case.kind, "model_path": self.model_path if case.kind == "predictor" else "",
               "small": case.base in SMALL_MODELS + SMALL_PREDICTORS}
        t0 = time.perf_counter()
        try:
            self._conn.send(job)
            if not self._conn.poll(self.timeout):
                self.stop()
                return CaseResult(case, HANG, time.perf_counter() - t0, f"no answer within {self.timeout:g} s")
            _, answer = self._conn.recv()
        except (EOFError, OSError):
            code = self._proc.exitcode if self._proc is not None else None
            if self._proc is not None:
                self._proc.join(5)
                code = self._proc.exitcode
            self.stop()
            return CaseResult(case, CRASH, time.perf_counter() - t0, f"worker died (exit code {code})")
        finally:
            path.unlink(missing_ok=True)
        outcome, detail = classify(case, answer["stages"])
        return CaseResult(case, outcome, answer["elapsed"], detail, answer["stages"])


@dataclass
class Summary:
    """What a fuzz run did; ``failures`` must be empty."""

    cases: int = 0
    per_class: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    per_class_outcomes: dict[str, Counter[str]] = field(default_factory=dict)
    ops: Counter[str] = field(default_factory=Counter)
    stage_refusals: Counter[str] = field(default_factory=Counter)
    failures: list[CaseResult] = field(default_factory=list)
    slowest: CaseResult | None = None
    elapsed: float = 0.0
    memory_limit: int = 0

    def add(self, r: CaseResult) -> None:
        self.cases += 1
        self.per_class[r.case.cls] += 1
        self.outcomes[r.outcome] += 1
        self.per_class_outcomes.setdefault(r.case.cls, Counter())[r.outcome] += 1
        self.ops.update(r.case.ops)
        self.stage_refusals.update(n for n, s, _ in r.stages if s == CLEAN)
        if r.failed:
            self.failures.append(r)
        if self.slowest is None or r.elapsed > self.slowest.elapsed:
            self.slowest = r

    def count(self, *outcomes: str) -> int:
        return sum(self.outcomes[o] for o in outcomes)


def run_cases(cases: Iterable[Case], runner: Runner, progress: Callable[[Summary], None] | None = None,
              save_failures: Path | None = None) -> Summary:
    """Run every case; failing case files are copied into ``save_failures`` when given."""
    summary = Summary()
    t0 = time.perf_counter()
    try:
        for case in cases:
            r = runner.run(case)
            summary.add(r)
            if r.failed:
                log.warning("case %d:%d (%s) %s: %s", case.seed, case.index, case.cls, r.outcome, r.detail)
                if save_failures is not None:
                    save_failures.mkdir(parents=True, exist_ok=True)
                    out = save_failures / f"{case.cls}-{case.seed}-{case.index}.bin"
                    with open(out, "wb") as fh:
                        fh.write(case.content)
                        fh.truncate(case.size)
            if progress is not None:
                progress(summary)
    finally:
        summary.memory_limit = runner.memory_limit
        runner.stop()
        summary.elapsed = time.perf_counter() - t0
    return summary

