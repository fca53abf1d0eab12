"""The well-formed base files every fuzz case is derived from.

Runs in: the fuzzing parent process (it writes the small bases once into its scratch folder and
reads the header of each real model).

Small bases are complete files kept in memory: two synthetic models (a llama with a GPT-2 BPE
vocabulary and SmolLM2's chat template; a gemma3 with a SentencePiece vocabulary and no template),
a ``predictor`` and a ``gate`` ``.predictor`` for the llama, a PowerInfer ``PWRI`` model+predictor
file and a PowerInfer ``.gpuidx``. Real models are too big to copy per case: only their header
(everything before the tensor data) is kept, and a case file is that header, mutated, followed by
a sparse run of zeros as long as the original tensor data.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT
from gguf import GGUFWriter

from powerinfer.devtools.fuzz.gguf_layout import KV, Layout, enc_array, enc_scalar, enc_string, rebuild, scan
from powerinfer.gguf_file import GGUFFile
from powerinfer.predictors.predictor_file import LayerPredictor, PredictorFile, model_fingerprint, write_predictor
from powerinfer.synthetic import SyntheticSpec, write_synthetic_gguf

# SmolLM2-135M-Instruct's tokenizer.chat_template, so template mutations start from a real one.
CHATML_WITH_SYSTEM = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Base:
    """A base file: ``head`` is the whole file (small bases) or everything before the tensor data."""

    name: str
    kind: str  # "model" | "predictor"
    head: bytes
    layout: Layout
    size: int  # size of the complete original file
    path: Path  # the unmutated file on disk

    @property
    def tail_len(self) -> int:
        """Bytes after ``head`` in the original file (zeros in case files)."""
        return self.size - len(self.head)


def _load(name: str, kind: str, path: Path, whole: bool) -> Base:
    size = path.stat().st_size
    want = size if whole else min(size, 16 << 20)
    while True:
        with open(path, "rb") as fh:
            head = fh.read(want)
        try:
            lay = scan(head)
            break
        except (ValueError, struct.error):
            if want >= size:
                raise ValueError(f"{path}: not a well-formed GGUF base file") from None
            want = min(size, want * 2)
    return Base(name, kind, head if whole else head[: lay.data_start], lay, size, path)


def _spm_tokenizer_kvs(n_tokens: int) -> list[KV]:
    """A SentencePiece ('llama') vocabulary of exactly ``n_tokens`` tokens: specials, bytes, pieces."""
    pieces = ["\u2581", "a", "\u2581a"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(n_tokens - 3 - len(pieces))] + pieces
    types = [2, 3, 3] + [6] * (len(tokens) - 3 - len(pieces)) + [1] * len(pieces)
    scores = [0.0] * (len(tokens) - len(pieces)) + [-2.0, -1.0, -0.5]
    return [
        KV(b"tokenizer.ggml.model", VT.STRING, enc_string("llama")),
        KV(b"tokenizer.ggml.tokens", VT.ARRAY, enc_array(VT.STRING, [enc_string(t) for t in tokens])),
        KV(b"tokenizer.ggml.scores", VT.ARRAY, enc_array(VT.FLOAT32, [enc_scalar(VT.FLOAT32, s) for s in scores])),
        KV(b"tokenizer.ggml.token_type", VT.ARRAY, enc_array(VT.INT32, [enc_scalar(VT.INT32, t) for t in types])),
        KV(b"tokenizer.ggml.bos_token_id", VT.UINT32, enc_scalar(VT.UINT32, 1)),
        KV(b"tokenizer.ggml.eos_token_id", VT.UINT32, enc_scalar(VT.UINT32, 2)),
        KV(b"tokenizer.ggml.unknown_token_id", VT.UINT32, enc_scalar(VT.UINT32, 0)),
        KV(b"tokenizer.ggml.add_bos_token", VT.BOOL, enc_scalar(VT.BOOL, True)),
    ]


def _synthetic_models(folder: Path) -> tuple[Path, Path]:
    llama = write_synthetic_gguf(folder / "synthetic-llama.gguf", SyntheticSpec(qtype=QT.Q8_0))
    data = llama.read_bytes()
    lay = scan(data)
    kvs = [*lay.kvs, KV(b"tokenizer.chat_template", VT.STRING, enc_string(CHATML_WITH_SYSTEM))]
    llama.write_bytes(rebuild(data, lay, kvs))
    gemma = write_synthetic_gguf(folder / "synthetic-gemma3.gguf", SyntheticSpec(arch="gemma3", qtype=QT.F16, n_layers=2))
    data = gemma.read_bytes()
    lay = scan(data)
    n_tokens = len(GGUFFile(gemma).metadata["tokenizer.ggml.tokens"])
    kvs = [kv for kv in lay.kvs if not kv.key.startswith(b"tokenizer.")] + _spm_tokenizer_kvs(n_tokens)
    gemma.write_bytes(rebuild(data, lay, kvs))
    return llama, gemma


def _predictor(path: Path, model: Path, mode: str) -> Path:
    f = GGUFFile(model)
    rng = np.random.default_rng(0)
    d, n_ff, n_layers = 64, 160, 2  # SyntheticSpec's defaults
    layers = []
    for i in range(n_layers):
        r = 8 + 4 * i if mode == "predictor" else 0
        freq, mass = rng.random(n_ff).astype(np.float32), rng.random(n_ff).astype(np.float32)
        layers.append(LayerPredictor(
            fc1_w=rng.standard_normal((r, d)).astype(np.float32), fc1_b=rng.standard_normal(r).astype(np.float32),
            fc2_w=rng.standard_normal((n_ff, r)).astype(np.float32),
            fc2_b=rng.standard_normal(n_ff).astype(np.float32) * (r > 0),
            threshold=float(rng.random()), act_freq=freq, act_mass=(mass / mass.sum()).astype(np.float32)))
    pf = PredictorFile(mode=mode, model_name="synthetic-llama", fingerprint=model_fingerprint(f), n_layers=n_layers,
                       d_model=d, n_ff=n_ff, rank=max(lp.rank for lp in layers), target_sparsity=0.5,
                       calibration={"source": "generated", "tokens": 4096, "recall": 0.97}, layers=tuple(layers))
    write_predictor(path, pf)
    return path


def _write(w: GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _powerinfer_model(path: Path) -> Path:
    """A whole PWRI model (ReLU llama, its predictors inside) as ``powerinfer convert --powerinfer``
    writes it, which is PowerInfer's converter's layout: the model tensors with ffn_down_t, then
    blk.N.fc1/fc2 per layer (ranks 16 and 24), F16, the PWRI magic."""
    from powerinfer.convert.predictors import ResidualPredictors
    from powerinfer.convert.run import from_gguf
    from powerinfer.convert.writer import write_model
    from powerinfer.gguf_file import GGUFFile
    from powerinfer.synthetic import SyntheticSpec, write_synthetic_gguf

    rng = np.random.default_rng(3)
    src = write_synthetic_gguf(path.with_name("relu-source.gguf"), SyntheticSpec(activation="relu", seed=3))
    model, meta = from_gguf(GGUFFile(src))
    d, n_ff = model.d_model, model.n_ff
    preds = ResidualPredictors(tuple((rng.standard_normal((r, d)) / 8).astype(np.float32) for r in (16, 24)),
                               tuple((rng.standard_normal((n_ff, r)) / 4).astype(np.float32) for r in (16, 24)), 0.0)
    write_model(path, model, meta, "f16", preds, powerinfer=True)
    src.unlink()
    return path


def _gpuidx(path: Path) -> Path:
    """A PowerInfer ``.gpuidx`` (PWRI magic, legacy I32 type id 18, an empty bucket)."""
    n_ff = 160
    rng = np.random.default_rng(1)
    w = GGUFWriter(path, "generic.gpu_index")
    for i, idx in enumerate((rng.choice(n_ff, 40, replace=False), np.zeros(0, np.int64), np.arange(n_ff))):
        mask = np.zeros(n_ff, np.int32)
        mask[idx] = 1
        w.add_tensor(f"blk.{i}.gpu_idx", mask, raw_dtype=QT.I32)
        w.add_tensor(f"blk.{i}.gpu_bucket", np.sort(idx).astype(np.int32), raw_dtype=QT.I32)
    w.add_block_count(3)
    w.add_uint64("split.vram_capacity", 123_456_789)
    _write(w)
    data = bytearray(path.read_bytes())
    data[:4] = b"PWRI"
    for t in scan(bytes(data)).tensors:  # PowerInfer's gguf-py numbers I32 18
        at = t.start + 8 + len(t.name) + 4 + 8 * len(t.dims)
        struct.pack_into("<I", data, at, 18)
    path.write_bytes(bytes(data))
    return path


def make_bases(folder: Path, real_models: dict[str, Path] | None = None) -> dict[str, Base]:
    """Write the small bases into ``folder`` and read every base; ``real_models``: name -> path."""
    folder.mkdir(parents=True, exist_ok=True)
    llama, gemma = _synthetic_models(folder)
    bases = {
        "synthetic-llama": _load("synthetic-llama", "model", llama, True),
        "synthetic-gemma3": _load("synthetic-gemma3", "model", gemma, True),
        "predictor": _load("predictor", "predictor", _predictor(folder / "synthetic.predictor", llama, "predictor"), True),
        "predictor-gate": _load("predictor-gate", "predictor", _predictor(folder / "gate.predictor", llama, "gate"), True),
        "pwri": _load("pwri", "predictor", _powerinfer_model(folder / "relu.powerinfer.gguf"), True),
        "gpuidx": _load("gpuidx", "predictor", _gpuidx(folder / "model.generated.gpuidx"), True),
    }
    for name, path in (real_models or {}).items():
        bases[name] = _load(name, "model", Path(path), False)
    return bases
