"""A Hugging Face checkpoint folder: its config and its tensors, read lazily and safely.

Runs in: the CLI process (``powerinfer convert``).

Weights come from safetensors files (parsed here: an 8-byte little-endian header size, a JSON
header of name -> dtype, shape, byte range, then the raw data, which is memory-mapped) or from
PyTorch pickles (``pytorch_model*.bin``, ``*.pt``) through ``torch.load(weights_only=True)``, whose
restricted unpickler refuses anything but tensors and plain containers: a pickle that would run
code is an error, never executed. A sharded checkpoint's index must name shards that exist, and
every tensor is read exactly from the shard the index names.
"""

from __future__ import annotations

import json
import logging
import math
import pickle
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from powerinfer.errors import ModelFileError, quoted

log = logging.getLogger(__name__)

# safetensors dtype -> numpy dtype (BF16 is read as uint16 and widened by hand)
_ST_DTYPES: dict[str, np.dtype[Any]] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_MAX_HEADER = 100 << 20  # a safetensors header past 100 MB is a corrupt or hostile file


def bf16_to_f32(u: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32: the same bits in the upper half."""
    return (u.astype(np.uint32) << 16).view(np.float32)


@dataclass(frozen=True)
class TensorSource:
    """Where one tensor's data lives and how to read it as float32 (numpy order, HF's shape)."""

    name: str
    shape: tuple[int, ...]
    read: Callable[[], np.ndarray]


def _safetensors(path: Path) -> dict[str, TensorSource]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ModelFileError(f"{path}: not a safetensors file (shorter than its 8-byte header size)")
            n = int.from_bytes(head, "little")
            if n > min(_MAX_HEADER, size - 8):
                raise ModelFileError(f"{path}: not a safetensors file (header size {n} for a file of {size} bytes)")
            header = json.loads(fh.read(n))
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(f"{path}: malformed safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise ModelFileError(f"{path}: malformed safetensors header (not a JSON object)")
    data_start, data_size = 8 + n, size - 8 - n
    mapped = np.memmap(path, dtype=np.uint8, mode="r") if data_size > 0 else np.zeros(0, np.uint8)
    out: dict[str, TensorSource] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = _ST_DTYPES[info["dtype"]], tuple(int(s) for s in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ModelFileError(f"{path}: tensor {quoted(name)} has a malformed entry {quoted(info)}") from None
        count = math.prod(shape)
        if any(s < 0 for s in shape) or not 0 <= a <= b <= data_size or b - a != count * dtype.itemsize:
            raise ModelFileError(f"{path}: tensor {quoted(name)} ({info['dtype']} {list(shape)}) does not fit bytes {a}..{b} "
                                 f"of the {data_size} the file holds")

        def read(a: int = a, count: int = count, dtype: np.dtype[Any] = dtype, shape: tuple[int, ...] = shape,
                 code: str = info["dtype"]) -> np.ndarray:
            raw = mapped[data_start + a : data_start + a + count * dtype.itemsize].view(dtype).reshape(shape)
            return bf16_to_f32(raw) if code == "BF16" else raw.astype(np.float32)

        out[name] = TensorSource(name, shape, read)
    return out


def _pickle(path: Path) -> dict[str, TensorSource]:
    import torch  # the pickle format is torch's; only weights_only loading is ever used

    try:
        # mmap for the zip format torch.save writes; a legacy pickle is read whole (still weights only)
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as e:
        raise ModelFileError(f"{path}: refused: the pickle holds more than tensors (only weights are loaded, never code): "
                             f"{str(e).splitlines()[0] if str(e) else 'unpickling error'}") from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        raise ModelFileError(f"{path}: cannot read as a PyTorch checkpoint: {str(e).splitlines()[0] if str(e) else e}") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ModelFileError(f"{path}: a PyTorch checkpoint of {type(state).__name__}, expected a dict of tensors")
    out: dict[str, TensorSource] = {}
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            raise ModelFileError(f"{path}: entry {quoted(name)} is {type(t).__name__}, not a tensor")
        out[str(name)] = TensorSource(str(name), tuple(t.shape), lambda t=t: t.detach().to(torch.float32).numpy())
    return out


def read_tensors(path: Path) -> dict[str, TensorSource]:
    """The tensors of one weights file (safetensors, or a PyTorch pickle)."""
    if path.suffix == ".safetensors":
        return _safetensors(path)
    return _pickle(path)


class HFCheckpoint:
    """A Hugging Face model folder: ``config`` (config.json) and ``tensors`` (name -> TensorSource)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise ModelFileError(f"{self.folder}: not a folder (a Hugging Face checkpoint is a folder with config.json)")
        self.config = self.json("config.json", required=True)
        self.tensors = self._load_tensors()

    def json(self, name: str, required: bool = False) -> dict[str, Any]:
        path = self.folder / name
        if not path.exists():
            if required:
                raise ModelFileError(f"{self.folder}: no {name}")
            return {}
        try:
            value = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelFileError(f"{path}: cannot read as JSON: {e}") from None
        if not isinstance(value, dict):
            raise ModelFileError(f"{path}: expected a JSON object, got {type(value).__name__}")
        return value

    def _load_tensors(self) -> dict[str, TensorSource]:
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            if (self.folder / index_name).exists():
                return self._sharded(index_name)
        files = sorted(self.folder.glob("*.safetensors")) or sorted(self.folder.glob("pytorch_model*.bin")) or \
            sorted(p for p in self.folder.glob("*.pt") if p.name.startswith(("model", "pytorch_model")))
        if not files:
            raise ModelFileError(f"{self.folder}: no weights (model.safetensors, pytorch_model.bin or a sharded index)")
        out: dict[str, TensorSource] = {}
        for path in files:
            for name, src in read_tensors(path).items():
                if name in out:
                    raise ModelFileError(f"{self.folder}: tensor {quoted(name)} appears in two files (the second: {path.name})")
                out[name] = src
        return out

    def _sharded(self, index_name: str) -> dict[str, TensorSource]:
        index = self.json(index_name)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelFileError(f"{self.folder / index_name}: no weight_map")
        shards = sorted(set(map(str, weight_map.values())))
        missing = [s for s in shards if not (self.folder / s).is_file() or "/" in s or s.startswith(".")]
        if missing:
            raise ModelFileError(f"{self.folder}: {index_name} names {len(missing)} shard(s) that are missing: {', '.join(missing[:4])}")
        loaded = {s: read_tensors(self.folder / s) for s in shards}
        out: dict[str, TensorSource] = {}
        for name, shard in weight_map.items():
            src = loaded[str(shard)].get(name)
            if src is None:
                raise ModelFileError(f"{self.folder}: {index_name} puts {quoted(name)} in {shard}, which does not hold it")
            out[name] = src
        return out

    def iter_names(self) -> Iterator[str]:
        return iter(self.tensors)
