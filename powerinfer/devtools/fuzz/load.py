"""What "loading" a fuzz case means: every reader we ship, stage by stage, with the outcome of each.

Runs in: the fuzz worker (child) process; also importable in-process by tests.

A model case is opened with :class:`GGUFFile`, then (each stage on its own, so one refusal does not
hide the next stage from the fuzzer) its metadata is rendered the way ``powerinfer inspect`` prints
it, the config is built, the tokenizer is built from the metadata and used, the chat template is
compiled and rendered, every tensor's first and last rows are read, a few rows are dequantized and
the model fingerprint is taken. A predictor case goes through ``read_predictor`` with and without a
model to check against, and PowerInfer's readers (``PWRI`` model file, ``.gpuidx``).

A stage passes or refuses cleanly (a :class:`PowerInferError` with a one-line, printable message);
anything else is a failure: another exception type (``uncaught``), a ``MemoryError`` (the worker
runs under an address-space limit, so an allocation sized by an unchecked count lands here),
an unprintable or multi-line message (``bad_message``), or, for small files, a parse whose traced
memory is out of proportion to the file (``memory``).
"""

from __future__ import annotations

import hashlib
import time
import tracemalloc
import traceback
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from powerinfer.errors import PowerInferError

OK, CLEAN, UNCAUGHT, MEMORY, BAD_MESSAGE = "ok", "clean", "uncaught", "memory", "bad_message"
FAILURES = (UNCAUGHT, MEMORY, BAD_MESSAGE)
MAX_MESSAGE = 2000  # characters; an error message is one line for a terminal, not a dump
SMALL_FILE = 8 << 20  # files up to this size also get the slower checks (traced memory, inspect)
PARSE_MEMORY_FACTOR = 32  # traced bytes per file byte a parse may use (Python objects for strings...)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_start|> \u2603"}]

_TOKENIZERS: OrderedDict[bytes, tuple[Any, BaseException | None]] = OrderedDict()
_MODELS: dict[str, Any] = {}


def _message_problem(e: BaseException) -> str | None:
    msg = str(e)
    if not msg:
        return "empty error message"
    if "\n" in msg or "\r" in msg:
        return "multi-line error message"
    if len(msg) > MAX_MESSAGE:
        return f"error message of {len(msg)} characters"
    try:
        msg.encode("utf-8")
    except UnicodeEncodeError:
        return "error message is not printable UTF-8"
    return None


def _short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= 300 else text[:297] + "..."


class Stages:
    """Runs named stages, recording ``(stage, status, detail)``; failures keep a traceback line."""

    def __init__(self) -> None:
        self.results: list[tuple[str, str, str]] = []

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        try:
            value = fn()
        except PowerInferError as e:
            problem = _message_problem(e)
            self.results.append((name, BAD_MESSAGE if problem else CLEAN, f"{problem}: {_short(e)}" if problem else str(e)))
            return None
        except MemoryError as e:
            self.results.append((name, MEMORY, f"MemoryError {e}".strip()))
            return None
        except Exception as e:  # noqa: BLE001 - any other exception type is exactly what we look for
            where = traceback.extract_tb(e.__traceback__)[-1]
            self.results.append((name, UNCAUGHT, f"{_short(e)} at {Path(where.filename).name}:{where.lineno}"))
            return None
        self.results.append((name, OK, ""))
        return value

    def status(self, name: str) -> str | None:
        return next((s for n, s, _ in self.results if n == name), None)


def _tokenizer_key(meta: Mapping[str, Any]) -> bytes:
    """Digest of every tokenizer value (not the template): equal digests, equal tokenizers."""
    h = hashlib.blake2b(digest_size=20)
    for key in sorted(k for k in meta if k.startswith("tokenizer.") and k != "tokenizer.chat_template"):
        value = meta[key]
        h.update(key.encode("utf-8", "surrogateescape") + b"\0" + type(value).__name__.encode())
        if isinstance(value, np.ndarray):
            h.update(f"{value.dtype.str}{value.shape}".encode() + value.tobytes())
        elif isinstance(value, list) and all(type(v) is str for v in value):
            h.update(f"{len(value)}\0".encode() + "\0".join(value).encode("utf-8", "surrogateescape"))
        else:
            h.update(repr(value).encode("utf-8", "surrogateescape"))
    return h.digest()


def build_tokenizer(meta: Mapping[str, Any]) -> Any:
    """GGUFTokenizer.from_metadata, remembered by :func:`_tokenizer_key` (Gemma's takes ~2 s).

    Only an identical set of tokenizer values is answered from memory (with the same tokenizer or
    the same exception), so the cache changes the speed of the fuzzer, not what it tests.
    """
    from powerinfer.tokenizer import GGUFTokenizer

    key = _tokenizer_key(meta)
    if key in _TOKENIZERS:
        _TOKENIZERS.move_to_end(key)
        tok, err = _TOKENIZERS[key]
        if err is not None:
            raise err
        return tok
    try:
        tok, err = GGUFTokenizer.from_metadata(meta), None
    except PowerInferError as e:
        tok, err = None, e
    _TOKENIZERS[key] = (tok, err)
    while len(_TOKENIZERS) > 3:
        _TOKENIZERS.popitem(last=False)
    if err is not None:
        raise err
    return tok


def _use_tokenizer(tok: Any) -> None:
    from powerinfer.tokenizer import StreamDecoder

    ids = tok.encode("Hello world, <|im_start|> caf\u00e9 \u2603 12345", special=True)
    tok.decode(ids)
    tok.decode(ids, skip_special=False)
    dec = StreamDecoder(tok)
    for i in [*range(min(16, tok.vocab_size)), *range(max(0, tok.vocab_size - 16), tok.vocab_size), *ids]:
        tok.token_text(i)
        tok.is_special(i)
        dec.push(i)
    dec.flush()


def _template(meta: Mapping[str, Any], tok: Any) -> str:
    from powerinfer.chat import ChatTemplate

    if tok is not None:
        tmpl = ChatTemplate.for_model(meta, tok)
    else:  # the tokenizer was refused: still compile and render the file's template
        source = meta.get("tokenizer.chat_template")
        if not isinstance(source, str):
            return ""
        tmpl = ChatTemplate(source)
    out = tmpl.render(CHAT)
    tmpl.render(CHAT[1:], add_generation_prompt=False)
    return out


def _metadata(f: Any) -> int:
    from powerinfer.cli.inspect_cmd import shown_name, show_value

    text = "\n".join(f"  {shown_name(k)} = {show_value(v)}" for k, v in f.metadata.items())
    return len(text.encode("utf-8"))  # the CLI prints it to stdout, which is strict UTF-8


def _tensors(f: Any) -> int:
    from powerinfer.quants.formats import SUPPORTED_TYPES, dequantize_rows

    touched = decoded = 0
    for info in f:
        view = f.raw(info.name)
        touched += int(np.asarray(view[0]).view(np.uint8).sum()) + int(np.asarray(view[-1]).view(np.uint8).sum())
        if decoded < 6 and info.qtype in SUPPORTED_TYPES:
            dequantize_rows(info.qtype, view[:2], info.n_cols)
            decoded += 1
    if "token_embd.weight" in f.tensors:
        rows = f.tensor("token_embd.weight").n_rows
        f.read_rows("token_embd.weight", np.array([0, rows - 1]))
    return touched


def _open_traced(path: Path, size: int, opener: Callable[[Path], Any]) -> Any:
    """Open with tracemalloc on (small files only): a parse may not use far more than the file."""
    tracemalloc.start()
    try:
        f = opener(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    limit = PARSE_MEMORY_FACTOR * size + (1 << 20)
    if peak > limit:
        raise MemoryError(f"parsing a {size}-byte file allocated {peak} bytes (limit {limit})")
    return f


def load_model(path: Path, stages: Stages, small: bool) -> None:
    from powerinfer.cli.inspect_cmd import inspect_text
    from powerinfer.config import config_from_gguf
    from powerinfer.gguf_file import GGUFFile
    from powerinfer.predictors.predictor_file import model_fingerprint

    size = path.stat().st_size
    f = stages.run("open", lambda: _open_traced(path, size, GGUFFile) if small else GGUFFile(path))
    if f is None:
        return
    stages.run("metadata", lambda: _metadata(f))
    if small:
        stages.run("inspect", lambda: inspect_text(str(path), tensors=True).encode("utf-8"))
    stages.run("config", lambda: config_from_gguf(f))
    tok = stages.run("tokenizer", lambda: build_tokenizer(f.metadata))
    if tok is not None:
        stages.run("tokenize", lambda: _use_tokenizer(tok))
    stages.run("template", lambda: _template(f.metadata, tok))
    stages.run("tensors", lambda: _tensors(f))
    stages.run("fingerprint", lambda: model_fingerprint(f))


def _check_model(model_path: str) -> Any:
    from powerinfer.gguf_file import GGUFFile

    if model_path not in _MODELS:
        _MODELS[model_path] = GGUFFile(model_path)
    return _MODELS[model_path]


def load_predictor(path: Path, model_path: str, stages: Stages) -> None:
    from powerinfer.predictors.powerinfer_formats import open_powerinfer_gguf, read_gpuidx, read_powerinfer_predictor
    from powerinfer.predictors.predictor_file import read_predictor

    size = path.stat().st_size
    f = stages.run("open_powerinfer", lambda: _open_traced(path, size, open_powerinfer_gguf))
    del f
    pf = stages.run("read_predictor", lambda: read_predictor(path))
    if pf is not None:
        x = np.ones((2, pf.d_model), np.float32)
        with np.errstate(over="ignore", invalid="ignore"):  # finite but huge weights overflow: allowed
            stages.run("predict", lambda: [lp.predict(x) for lp in pf.layers if lp.rank > 0])
    if model_path:
        stages.run("read_predictor_model", lambda: read_predictor(path, model=_check_model(model_path)))
    stages.run("read_powerinfer_predictor", lambda: read_powerinfer_predictor(path))
    stages.run("read_gpuidx", lambda: read_gpuidx(path))
    stages.run("runnable_model", lambda: _runnable(path))


def _runnable(path: Path) -> None:
    """What ``-m`` does with a PowerInfer model file: its runnable form written (to a scratch folder), then loaded."""
    import shutil
    import tempfile

    from powerinfer.config import config_from_gguf
    from powerinfer.gguf_file import GGUFFile
    from powerinfer.predictors.predictor_file import read_predictor
    from powerinfer.predictors.pwri_model import prepare_pwri

    scratch = Path(tempfile.mkdtemp(prefix="fuzz-pwri-"))
    try:
        pw = prepare_pwri(path, cache=scratch)
        f = GGUFFile(pw.model)
        config_from_gguf(f)
        build_tokenizer(f.metadata)
        read_predictor(pw.predictor, model=f)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def load_case(job: Mapping[str, Any]) -> dict[str, Any]:
    """Run the pipeline for ``job`` (keys: path, kind, model_path, small); the worker's entry point.

    ``small`` (a case made from a small base) adds the slower checks: traced parse memory,
    ``inspect``'s full text, and a model read by the predictor readers (which must refuse it).
    """
    t0 = time.perf_counter()
    stages = Stages()
    path = Path(job["path"])
    small = bool(job.get("small", True)) and path.stat().st_size <= SMALL_FILE
    if job["kind"] == "predictor":
        load_predictor(path, job.get("model_path", ""), stages)
    else:
        load_model(path, stages, small)
        if small:
            load_predictor(path, "", stages)
    return {"stages": stages.results, "elapsed": time.perf_counter() - t0}
