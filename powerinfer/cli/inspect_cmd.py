"""`powerinfer inspect MODEL`: a GGUF file's metadata, tensor types and sizes, without loading it.

Runs in: the user's process.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

import numpy as np

from powerinfer.errors import ModelFileError, UnsupportedModelError
from powerinfer.predictors.powerinfer_formats import open_powerinfer_gguf

_LONG = 8  # array values longer than this are summarised


def show_value(value: Any) -> str:
    if isinstance(value, (list, np.ndarray)):
        n = len(value)
        head = ", ".join(repr(v.item() if isinstance(v, np.generic) else v) for v in list(value[:_LONG]))
        return f"[{head}{', ...' if n > _LONG else ''}] ({n} items)"
    if isinstance(value, str) and (len(value) > 120 or "\n" in value):
        return repr(value[:120]) + f"... ({len(value)} chars)"
    return repr(value)


def shown_name(text: str, limit: int = 120) -> str:
    """A key or tensor name as printed: as is when plain text, else escaped (the name comes from the
    file: control characters would reach the terminal, invalid UTF-8 would make print() fail)."""
    shown = text if text.isprintable() else repr(text)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def inspect_text(path: str, tensors: bool) -> str:
    from powerinfer.config import config_from_gguf

    f = open_powerinfer_gguf(path)  # GGUF, or PowerInfer's PWRI (the same layout under another magic)
    lines = [f"file: {f.path} ({f.size / 2**20:.1f} MiB), {len(f.metadata)} metadata keys, {len(f.tensors)} tensors", "", "metadata:"]
    lines += [f"  {shown_name(k)} = {show_value(v)}" for k, v in f.metadata.items()]
    by_type: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for t in f:
        row = by_type[t.qtype.name]
        row[0] += 1
        row[1] += int(np.prod(t.shape))
        row[2] += t.nbytes
    lines += ["", "tensor types:", f"  {'type':<6} {'tensors':>8} {'params':>14} {'MiB':>10} {'bits/weight':>12}"]
    for name, (n, params, nbytes) in sorted(by_type.items(), key=lambda kv: -kv[1][2]):
        lines.append(f"  {name:<6} {n:>8} {params:>14,} {nbytes / 2**20:>10.1f} {8 * nbytes / params:>12.2f}")
    if tensors:
        lines += ["", "tensors:"]
        lines += [f"  {shown_name(t.name):<32} {t.qtype.name:<6} {str(list(t.shape)):<16} {t.nbytes / 2**10:>10.1f} KiB" for t in f]
    try:
        cfg = config_from_gguf(f)
    except (UnsupportedModelError, ModelFileError) as e:  # the file read: show what it holds, then why it cannot run
        lines += ["", f"not runnable here: {e}"]
    else:
        lines += ["", f"architecture: {cfg.arch} (supported); config: {cfg}"]
    return "\n".join(lines)


def run_inspect(argv: Sequence[str]) -> int:
    from powerinfer.flags import Parser

    p = Parser(prog="powerinfer inspect", description="Print a GGUF model's metadata, tensor types and sizes.")
    p.add_argument("model", help="GGUF file or known model name")
    p.add_argument("--tensors", action="store_true", help="also list every tensor")
    args = p.parse_args(argv)
    from powerinfer.fetch import resolve_model

    print(inspect_text(str(resolve_model(args.model)), args.tensors))
    return 0

