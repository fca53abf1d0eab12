"""The command-line pieces both entry points share (``powerinfer`` and ``powerinfer-server``): the
argument parser class, argument types, the model and GPU flags and loading a model from them,
logging, progress lines on stderr, and reading a text file the user named.

Runs in: the user's process. A first-level module below both entry points, so that the server
does not import the CLI package (the CLI imports the server for ``powerinfer serve``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from powerinfer import __version__
from powerinfer.errors import InvalidArgumentError, PowerInferError
from powerinfer.phase import PHASE_LOGGER

if TYPE_CHECKING:  # imported when used: `fetch` and `--help` stay light
    from powerinfer.api import LLM
    from powerinfer.coordinator.cluster.options import ClusterOptions
    from powerinfer.coordinator.hybrid_executor import GpuOptions

log = logging.getLogger(__name__)


class Parser(argparse.ArgumentParser):
    """argparse, with its usage errors as one line like our other errors (status 2 as argparse's),
    and ``--version`` on every command."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.add_argument("--version", action="version", version=f"%(prog)s {__version__}", help="print the version and exit")

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def progress(msg: str) -> None:
    """A progress line for the user, on stderr (stdout carries the command's result)."""
    print(msg, file=sys.stderr, flush=True)


def read_text(path: str) -> str:
    """A UTF-8 text file the user named; a clear error when it cannot be read."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PowerInferError(f"cannot read text file {path}: {e}") from None


class CLIError(PowerInferError):
    """A bad command-line argument."""


USAGE_ERROR = 2  # argparse's own status for a bad command line; runtime failures exit 1


def exit_status(e: PowerInferError) -> int:
    """2 for a usage error (a flag's value refused, by the command or by the API it calls), else 1."""
    return USAGE_ERROR if isinstance(e, (CLIError, InvalidArgumentError)) else 1


def report_paths(json_path: str | None, plot_path: str | None) -> None:
    """--json / --plot, checked before a run rather than after it (a plot is PNG, SVG or PDF)."""
    if json_path is not None:
        output_path(json_path, "--json")
    if plot_path is not None:
        output_path(plot_path, "--plot")
        if Path(plot_path).suffix.lower() not in (".png", ".svg", ".pdf"):
            raise CLIError(f"--plot {plot_path}: name a .png, .svg or .pdf file")


def output_path(path: str, flag: str, inputs: tuple[str, ...] = ()) -> Path:
    """The file a command will write (checked before any work): not empty, not a directory or
    other non-regular file, not one of the command's inputs, in a directory that exists and is
    writable. CLIError otherwise."""
    if not path:
        raise CLIError(f"{flag}: give a file name")
    p = Path(path)
    if p.exists() and not p.is_file():
        raise CLIError(f"{flag} {path}: {'is a directory' if p.is_dir() else 'exists and is not a regular file'}; give a file name")
    real = os.path.realpath(p)
    for given in inputs:
        if given and os.path.exists(given) and os.path.realpath(given) == real:
            raise CLIError(f"{flag} {path} is the input {given}: writing it would destroy it; give another file name")
    parent = Path(real).parent
    if not parent.is_dir():
        raise PowerInferError(f"{flag} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PowerInferError(f"{flag} {path}: the directory {parent} is not writable")
    return p


def add_model_args(p: argparse.ArgumentParser, default_ctx: int = 4096, many: bool = False) -> None:
    """The model flags; default_ctx is the context a run gets without -c (capped by the model's trained context).
    many: -m may be repeated (the server's several models; args.model is then a list, or None)."""
    if many:
        p.add_argument("-m", "--model", action="append", default=None,
                       help="GGUF file, or a known model name to fetch (smollm2, gemma3-270m); repeat it to serve several")
    else:
        p.add_argument("-m", "--model", required=True, help="GGUF file, or a known model name to fetch (smollm2, gemma3-270m)")
    p.add_argument("-t", "--threads", type=positive_int, default=None, help="CPU threads (default: one per physical core)")
    p.add_argument("--worker-threads", type=positive_int, default=None,
                   help="threads per worker process, dividing --threads (default: one worker process per NUMA node and L3; in a VM per core)")
    p.add_argument("--executor", choices=["process", "inprocess"], default="process",
                   help="process: shards in CPU worker processes (default); inprocess: everything in this process")
    p.add_argument("--transport", choices=["auto", "shm", "zmq"], default="auto",
                   help="worker processes: shm = native ranks, one step per forward pass, merged in shared memory; zmq = torch "
                        "shards, one message per layer (the oracle); auto (default): shm when the native decoder runs the model")
    ray = p.add_argument_group("a Ray cluster (pip install 'powerinfer[ray]'; docs/distributed.md)")
    ray.add_argument("--ray-address", default=None, metavar="ADDR",
                     help="run the model's layers as pipeline stages on the Ray cluster at ADDR ('auto': the one this host joined)")
    ray.add_argument("--pipeline-stages", type=positive_int, default=None, metavar="N",
                     help="pipeline stages, one per Ray node (default with --ray-address: 2)")
    ray.add_argument("--replicas", type=positive_int, default=None, metavar="N",
                     help="N full copies of the model (each with --pipeline-stages stages) behind the one endpoint; the KV slots "
                          "(--parallel) alternate over them, so a conversation stays on the replica holding its prefix")
    ray.add_argument("--ray-placement", choices=["spread", "pack"], default="spread",
                     help="spread: one stage per node (default); pack: as few nodes as fit (a one-host test)")
    p.add_argument("-c", "--ctx-size", type=int, default=None,
                   help=f"context size in tokens; 0 = the model's trained context (default: {default_ctx}, or less if the model was "
                        "trained on less)")
    p.set_defaults(default_ctx=default_ctx)
    p.add_argument("-b", "--batch-size", type=positive_int, default=512, help="prompt tokens per prefill step (default 512)")
    p.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"], type=str.upper,
                   help="log level on stderr (default WARNING)")
    p.add_argument("--verbose", action="store_true", help="same as --log-level DEBUG")


def add_gpu_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=0,
                   help="layers that take part in GPU offload, from the first (default 0: CPU only; -1 or 99: all)")
    p.add_argument("--vram-budget", type=float, default=None, help="GiB of GPU memory to use (default: free memory minus a margin)")
    p.add_argument("--split", choices=["neuron", "layer"], default="neuron",
                   help="neuron: hot neurons on the GPU, cold on the CPU (PowerInfer, default); layer: whole layers (llama.cpp)")
    p.add_argument("--reset-gpu-index", action="store_true", help="re-solve the hot-neuron placement even if the cached one matches")
    p.add_argument("--gpu-backend", choices=["cuda", "cpu"], default="cuda",
                   help="cuda: the NVIDIA GPU (default); cpu: a numpy stand-in of the GPU worker, to check a placement without one")
    p.add_argument("--gpu-worker", choices=["process", "inprocess"], default="process",
                   help="process: the GPU runtime in its own supervised process (default: a CUDA fault cannot take this one down, "
                        "and a dead worker is replaced); inprocess: in this process, without ZeroMQ round trips (two per split "
                        "layer, one per run of whole GPU layers; docs/gpu.md)")


def check_gpu_flags(args: argparse.Namespace) -> None:
    """-ngl / --vram-budget need an NVIDIA GPU; say so plainly instead of failing deep inside."""
    if args.n_gpu_layers < -1:
        raise CLIError(f"-ngl must be >= 0 (or -1 for all layers), got {args.n_gpu_layers}")
    if args.vram_budget is not None and not 0 < args.vram_budget < float("inf"):
        raise CLIError(f"--vram-budget must be a positive, finite number of GiB, got {args.vram_budget}")
    if args.n_gpu_layers == 0 and args.vram_budget is None:
        return
    if getattr(args, "gpu_backend", "cuda") == "cpu":
        return
    from powerinfer.gpu_worker.device import find_gpu

    probe = find_gpu()
    if probe.name is None:
        raise PowerInferError(f"-ngl/--vram-budget need an NVIDIA GPU, and none was found ({probe.reason}); use -ngl 0")


def gpu_options(args: argparse.Namespace) -> "GpuOptions | None":
    if args.n_gpu_layers == 0 and args.vram_budget is None:
        return None
    from powerinfer.coordinator.hybrid_executor import GpuOptions

    ngl = -1 if args.n_gpu_layers in (0, -1) else args.n_gpu_layers  # only --vram-budget given: every layer may take part
    return GpuOptions(backend=args.gpu_backend, split=args.split, vram_budget_gib=args.vram_budget, n_gpu_layers=ngl,
                      reset_index=args.reset_gpu_index, process=args.gpu_worker == "process")


def configure_logging(level: str, verbose: bool) -> None:
    logging.basicConfig(level="DEBUG" if verbose else level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    # the slow first-run steps (a model's download, the C build, a PowerInfer file's runnable copy)
    # are said at the default level too, one line each, terminal or not; --log-level ERROR silences them
    # (NOTSET otherwise: a second call in one process, as in tests, must not keep the first one's level)
    promote = logging.getLevelName(level) == logging.WARNING or verbose
    logging.getLogger(PHASE_LOGGER).setLevel(logging.INFO if promote else logging.NOTSET)


def cluster_options(args: argparse.Namespace) -> "ClusterOptions | None":
    """The Ray pipeline the flags ask for, or None (then Ray is never imported)."""
    if args.ray_address is None and args.pipeline_stages is None and args.replicas is None:
        return None
    from powerinfer.coordinator.cluster.options import ClusterOptions

    stages = args.pipeline_stages or (1 if args.replicas else 2)  # replicas alone: each a whole model on one node
    return ClusterOptions(address=args.ray_address or "auto", stages=stages, replicas=args.replicas or 1, placement=args.ray_placement,
                          threads=args.threads, inprocess=args.executor == "inprocess")


def load_llm(args: argparse.Namespace, progress: bool = True) -> LLM:
    from powerinfer.api import LLM
    from powerinfer.fetch import MODELS, resolve_model

    if args.ctx_size is not None and args.ctx_size < 0:
        raise CLIError(f"--ctx-size must be >= 0, got {args.ctx_size}")
    if args.executor == "inprocess" and args.transport != "auto":
        log.warning("--transport %s applies to the worker processes; --executor inprocess has none, so it is ignored", args.transport)
    model = args.model
    if isinstance(model, list):  # the server's -m, given once (several are loaded one by one: server/main.py)
        if len(model) != 1:
            raise CLIError(f"one model is loaded here, {len(model)} were given")
        model = model[0]
    path = resolve_model(model, progress=progress and sys.stderr.isatty())
    if not os.path.exists(path) and os.sep not in model and not model.endswith(".gguf"):
        raise PowerInferError(f"model {model!r} is neither a file nor a known model name ({', '.join(MODELS)})")
    template = read_template(args.chat_template_file) if getattr(args, "chat_template_file", None) else None
    llm = LLM(path, n_ctx=args.ctx_size, default_ctx=getattr(args, "default_ctx", 4096), n_batch=args.batch_size, n_threads=args.threads, executor=args.executor,
              worker_threads=args.worker_threads, predictor=getattr(args, "predictor", None), sparse=not getattr(args, "no_sparse", False),
              progress=progress and sys.stderr.isatty(), n_slots=getattr(args, "n_slots", 1),
              gpu=gpu_options(args) if hasattr(args, "n_gpu_layers") else None, transport=args.transport, cluster=cluster_options(args))
    set_lookup(llm, getattr(args, "lookup", 0))
    if template is not None:  # the file's own template is replaced (llama-server's --chat-template-file)
        from powerinfer.chat import ChatTemplate

        try:
            llm.chat_template = ChatTemplate.for_model(llm.file.metadata, llm.tokenizer, source=template)
        except PowerInferError:
            llm.close()
            raise
    return llm


MAX_LOOKUP = 64


def _lookup(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 0 <= n <= MAX_LOOKUP:
        raise argparse.ArgumentTypeError(f"must be in 0..{MAX_LOOKUP}, got {n}")
    return n


def add_lookup_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lookup", type=_lookup, default=0, metavar="N",
                   help="prompt lookup decoding: draft up to N tokens from n-grams already in the context and check them in one "
                        "pass (faster when the reply quotes or edits its context; the same output as without it); 0 = off (default). "
                        "Used while one sequence decodes, on the native executors without a sparsity predictor")


def set_lookup(llm: "LLM", n: int) -> None:
    """Turn on prompt lookup decoding where a checked draft gives exactly the tokens decoding
    one at a time gives, and say why not elsewhere."""
    if not 0 <= n <= MAX_LOOKUP:
        raise CLIError(f"--lookup must be in 0..{MAX_LOOKUP}, got {n}")
    if n == 0:
        return
    if llm.sparse:
        log.warning("--lookup is off: with a sparsity predictor a pass over several tokens is computed unlike a decode step, "
                    "so the output would differ from decoding one token at a time")
    elif not llm.engine.executor.describe().steps_match_decode:
        log.warning("--lookup is off: this executor (torch) rounds a pass over several tokens differently from a decode step")
    else:
        llm.core.lookup = n


MAX_TEMPLATE_FILE = 1 << 20


def read_template(path: str) -> str:
    """A --chat-template-file's text, or a CLIError naming what is wrong with it."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_TEMPLATE_FILE + 1)
    except OSError as e:
        raise CLIError(f"cannot read --chat-template-file {path}: {e.strerror or e}") from None
    if len(raw) > MAX_TEMPLATE_FILE:
        raise CLIError(f"--chat-template-file {path} is over {MAX_TEMPLATE_FILE >> 20} MiB; a chat template is a few KiB")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise CLIError(f"--chat-template-file {path} is not UTF-8 text") from None
