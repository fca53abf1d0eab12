"""Tests of the ``.predictor`` file and of PowerInfer's own formats (PWRI model file, .gpuidx).

Runs in: the pytest process. Models are the small synthetic llamas of ``tests/conftest.py``;
PowerInfer files are written here with ``gguf.GGUFWriter`` in PowerInfer's layout, then given the
``PWRI`` magic (and, for the GPU index, PowerInfer's legacy I32 type id 18) by patching bytes.
"""

from __future__ import annotations

import logging
import math
import shutil
import struct
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from powerinfer.errors import ModelFileError
from powerinfer.gguf_file import GGUFFile
from powerinfer.sparsity import (
    LayerPredictor,
    PredictorFile,
    is_powerinfer_file,
    model_fingerprint,
    open_powerinfer_gguf,
    read_gpuidx,
    read_powerinfer_predictor,
    read_predictor,
    write_predictor,
)

D, N_FF, N_LAYERS = 64, 160, 2  # SyntheticSpec's defaults


def _layer(rng: np.random.Generator, d: int, n_ff: int, r: int) -> LayerPredictor:
    f32 = np.float32
    freq = rng.random(n_ff).astype(f32)
    mass = rng.random(n_ff).astype(f32)
    return LayerPredictor(
        fc1_w=rng.standard_normal((r, d)).astype(f32), fc1_b=rng.standard_normal(r).astype(f32),
        fc2_w=rng.standard_normal((n_ff, r)).astype(f32), fc2_b=rng.standard_normal(n_ff).astype(f32) * (r > 0),
        threshold=float(rng.random()), act_freq=freq, act_mass=(mass / mass.sum()).astype(f32))


def _pf(fingerprint: str = "", n_layers: int = N_LAYERS, d: int = D, n_ff: int = N_FF, ranks: tuple[int, ...] = (8, 8),
        mode: str = "predictor", seed: int = 0) -> PredictorFile:
    rng = np.random.default_rng(seed)
    ranks = (ranks * n_layers)[:n_layers]
    return PredictorFile(
        mode=mode, model_name="synthetic-llama", fingerprint=fingerprint, n_layers=n_layers, d_model=d, n_ff=n_ff,
        rank=max(ranks), target_sparsity=0.8, calibration={"source": "generated", "tokens": 4096, "seed": 0, "recall": 0.99},
        layers=tuple(_layer(rng, d, n_ff, r) for r in ranks))


def _assert_same(a: PredictorFile, b: PredictorFile) -> None:
    for name in ("mode", "model_name", "fingerprint", "n_layers", "d_model", "n_ff", "rank"):
        assert getattr(a, name) == getattr(b, name), name
    assert a.target_sparsity == pytest.approx(b.target_sparsity)
    assert dict(a.calibration) == dict(b.calibration)
    assert [type(v) for v in a.calibration.values()] == [type(v) for v in b.calibration.values()]
    for la, lb in zip(a.layers, b.layers, strict=True):
        for name in ("fc1_w", "fc1_b", "fc2_w", "fc2_b", "act_freq", "act_mass"):
            x, y = getattr(la, name), getattr(lb, name)
            assert x.dtype == y.dtype == np.float32 and x.shape == y.shape and np.array_equal(x, y), name
        assert la.threshold == pytest.approx(lb.threshold)


def _one_line_error(exc: pytest.ExceptionInfo[ModelFileError], *needles: str) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and msg
    for needle in needles:
        assert needle in msg, (needle, msg)
    return msg


# -- our format ------------------------------------------------------------------------------


def test_round_trip(tmp_path: Path, make_model: Any) -> None:
    model = GGUFFile(make_model())
    pf = _pf(fingerprint=model_fingerprint(model), ranks=(8, 12))
    path = tmp_path / "m.predictor"
    write_predictor(path, pf)
    _assert_same(pf, read_predictor(path, model=model))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.predictor"]  # no temp file left behind
    write_predictor(path, _pf(fingerprint=pf.fingerprint, seed=5))  # atomic replace of an existing file
    _assert_same(_pf(fingerprint=pf.fingerprint, seed=5), read_predictor(path))


def test_what_fc1_reads_round_trips(tmp_path: Path) -> None:
    """input: "normed" (the default, also when the key is absent: test_documented_layout_reads_like_the_writer)
    or "residual" (PowerInfer's predictors of a LayerNorm model), written and read back."""
    from dataclasses import replace

    pf = replace(_pf(), input="residual")
    write_predictor(tmp_path / "r.predictor", pf)
    back = read_predictor(tmp_path / "r.predictor")
    assert back.input == "residual" and back.reads_residual and not _pf().reads_residual
    assert not replace(back, mode="gate").reads_residual  # gate mode has no fc1 to feed
    with pytest.raises(ValueError, match="input"):
        write_predictor(tmp_path / "x.predictor", replace(_pf(), input="raw"))


def test_gate_mode_without_predictors(tmp_path: Path) -> None:
    pf = _pf(mode="gate", ranks=(0,))
    write_predictor(tmp_path / "g.predictor", pf)
    back = read_predictor(tmp_path / "g.predictor")
    _assert_same(pf, back)
    assert back.layers[0].fc1_w.shape == (0, D) and back.layers[0].fc2_b.shape == (N_FF,)
    with pytest.raises(ValueError, match="no predictor"):
        back.layers[0].predict(np.zeros((1, D), np.float32))


def test_documented_layout_reads_like_the_writer(tmp_path: Path) -> None:
    pf = _pf()
    _write_layout(tmp_path / "raw.predictor", *_layout(pf))
    _assert_same(pf, read_predictor(tmp_path / "raw.predictor"))


def test_predict_hand_checked() -> None:
    z = np.zeros(3, np.float32)
    lp = LayerPredictor(
        fc1_w=np.array([[1, 0], [0, 1]], np.float32), fc1_b=np.array([0, -1], np.float32),
        fc2_w=np.array([[1, 0], [0, 1], [-1, -1]], np.float32), fc2_b=np.array([-0.5, 0, 0.1], np.float32),
        threshold=0.0, act_freq=z, act_mass=z)
    x = np.array([[1, 2], [-1, 0.5]], np.float32)
    # token 0: h = relu([1, 1]) = [1, 1] -> logits [0.5, 1, -1.9]; token 1: h = [0, 0] -> logits = fc2_b
    out = lp.predict(x)
    assert out.dtype == bool and out.shape == (2, 3)
    assert out.tolist() == [[True, True, False], [False, False, True]]
    with pytest.raises(ValueError):
        lp.predict(np.zeros((2, 3), np.float32))


def test_fingerprint(tmp_path: Path, make_model: Any) -> None:
    path = make_model()
    fp = model_fingerprint(GGUFFile(path))
    assert len(fp) == 64 and fp == model_fingerprint(GGUFFile(path))
    assert model_fingerprint(GGUFFile(make_model(seed=1))) != fp
    changed = tmp_path / "changed.gguf"
    shutil.copy(path, changed)
    info = GGUFFile(path).tensor("blk.1.ffn_up.weight")
    with open(changed, "r+b") as fh:
        fh.seek(info.offset + info.nbytes - 3)  # one byte inside the tensor's last sampled page
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0x01]))
    assert model_fingerprint(GGUFFile(changed)) != fp


def test_predictor_for_another_model(tmp_path: Path, make_model: Any) -> None:
    a, b = GGUFFile(make_model()), GGUFFile(make_model(seed=1))
    path = tmp_path / "a.predictor"
    write_predictor(path, _pf(fingerprint=model_fingerprint(a)))
    with pytest.raises(ModelFileError) as e:
        read_predictor(path, model=b)
    _one_line_error(e, "made for model", model_fingerprint(a)[:12], model_fingerprint(b)[:12],
                    str(b.path))


@pytest.mark.parametrize(("field", "value", "needles"), [
    ("n_layers", 3, ("3 layers", "has 2")),
    ("n_ff", 128, ("128 FFN neurons", "has 160")),
    ("d_model", 32, ("32 model width", "has 64")),
])
def test_shape_mismatch_with_model(tmp_path: Path, make_model: Any, field: str, value: int, needles: tuple[str, ...]) -> None:
    model = GGUFFile(make_model())
    kwargs = {"n_layers": N_LAYERS, "n_ff": N_FF, "d": D} | {("d" if field == "d_model" else field): value}
    path = tmp_path / "bad.predictor"
    write_predictor(path, _pf(fingerprint=model_fingerprint(model), **kwargs))
    with pytest.raises(ModelFileError) as e:
        read_predictor(path, model=model)
    _one_line_error(e, *needles)


def test_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "t.predictor"
    write_predictor(path, _pf())
    data = path.read_bytes()
    for keep in (len(data) - 100, len(data) // 2, 40):
        path.write_bytes(data[:keep])
        with pytest.raises(ModelFileError) as e:
            read_predictor(path)
        _one_line_error(e, str(path))


def _layout(pf: PredictorFile) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The documented key/tensor layout, written out independently of write_predictor."""
    k = "powerinfer.predictor."
    meta: dict[str, Any] = {k + "version": 1, k + "mode": pf.mode, k + "model_name": pf.model_name,
                            k + "fingerprint": pf.fingerprint, k + "n_layers": pf.n_layers, k + "d_model": pf.d_model,
                            k + "n_ff": pf.n_ff, k + "rank": pf.rank, k + "target_sparsity": pf.target_sparsity}
    meta |= {k + "calibration." + key: v for key, v in pf.calibration.items()}
    tensors: dict[str, np.ndarray] = {}
    for i, lp in enumerate(pf.layers):
        p = f"blk.{i}."
        tensors |= {p + "fc1.weight": lp.fc1_w, p + "fc1.bias": lp.fc1_b, p + "fc2.weight": lp.fc2_w,
                    p + "fc2.bias": lp.fc2_b, p + "threshold": np.array([lp.threshold], np.float32),
                    p + "act_freq": lp.act_freq, p + "act_mass": lp.act_mass}
    return meta, tensors


def _write_out(w: GGUFWriter, tensors: dict[str, np.ndarray]) -> None:
    """Add tensors to w, then write the whole file and close it."""
    for name, a in tensors.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write_layout(path: Path, meta: dict[str, Any], tensors: dict[str, np.ndarray], arch: str = "powerinfer-predictor") -> None:
    w = GGUFWriter(path, arch)
    for key, v in meta.items():
        if isinstance(v, str):
            w.add_key_value(key, v, GGUFValueType.STRING)  # add_string would drop ""
        elif isinstance(v, int) and key.endswith(("version", "n_layers", "d_model", "n_ff", "rank")):
            w.add_uint32(key, v)
        elif isinstance(v, int):
            w.add_int64(key, v)
        elif key.endswith("target_sparsity"):
            w.add_float32(key, v)
        else:
            w.add_float64(key, v)
    _write_out(w, tensors)


@pytest.mark.parametrize(("mutate", "needles"), [
    (lambda m, t: t.pop("blk.1.act_mass"), ("blk.1.act_mass", "missing")),
    (lambda m, t: t.pop("blk.0.fc2.weight"), ("blk.0.fc2.weight", "missing")),
    (lambda m, t: t.__setitem__("blk.0.threshold", np.array([math.nan], np.float32)), ("layer 0", "threshold")),
    (lambda m, t: t.__setitem__("blk.1.threshold", np.array([-1.0], np.float32)), ("layer 1", "threshold")),
    (lambda m, t: t.__setitem__("blk.1.act_freq", np.full(N_FF, np.inf, np.float32)), ("layer 1", "act_freq")),
    (lambda m, t: t.__setitem__("blk.0.act_freq", np.zeros(N_FF, np.float16)), ("blk.0.act_freq", "F16")),
    (lambda m, t: t.__setitem__("blk.0.fc1.weight", np.zeros((8, 32), np.float32)), ("blk.0.fc1.weight", "[8, 32]")),
    (lambda m, t: t.__setitem__("blk.2.act_freq", np.zeros(N_FF, np.float32)), ("unexpected tensor", "blk.2.act_freq")),
    (lambda m, t: m.__setitem__("powerinfer.predictor.version", 2), ("version 2",)),
    (lambda m, t: m.__setitem__("powerinfer.predictor.mode", "oracle"), ("mode", "oracle")),
    (lambda m, t: m.__setitem__("powerinfer.predictor.input", "raw"), ("predictor input", "raw")),
    (lambda m, t: m.pop("powerinfer.predictor.n_ff"), ("powerinfer.predictor.n_ff", "missing")),
])
def test_malformed_predictor(tmp_path: Path, mutate: Any, needles: tuple[str, ...]) -> None:
    meta, tensors = _layout(_pf())
    mutate(meta, tensors)
    path = tmp_path / "bad.predictor"
    _write_layout(path, meta, tensors)
    with pytest.raises(ModelFileError) as e:
        read_predictor(path)
    _one_line_error(e, *needles)


def test_wrong_architecture_and_not_gguf(tmp_path: Path, make_model: Any) -> None:
    path = tmp_path / "arch.predictor"
    _write_layout(path, *_layout(_pf()), arch="llama")
    with pytest.raises(ModelFileError) as e:
        read_predictor(path)
    _one_line_error(e, "'llama'", "powerinfer-predictor")
    with pytest.raises(ModelFileError) as e:
        read_predictor(make_model())
    _one_line_error(e, "looks like a model file")
    junk = tmp_path / "junk.predictor"
    junk.write_text("this is not a GGUF file at all, just some text\n" * 3)
    with pytest.raises(ModelFileError) as e:
        read_predictor(junk)
    _one_line_error(e, "not a GGUF file")
    with pytest.raises(ModelFileError) as e:
        read_predictor(tmp_path / "missing.predictor")
    _one_line_error(e, "no such file")


def test_write_validates(tmp_path: Path) -> None:
    good = _pf()
    bad_layer = replace(good.layers[1], fc2_w=np.zeros((N_FF, 7), np.float32))
    cases = [
        PredictorFile(**{**good.__dict__, "layers": (good.layers[0], bad_layer)}),
        PredictorFile(**{**good.__dict__, "n_layers": 3}),
        PredictorFile(**{**good.__dict__, "rank": 9}),
        PredictorFile(**{**good.__dict__, "mode": "dense"}),
        PredictorFile(**{**good.__dict__, "target_sparsity": 1.5}),
        PredictorFile(**{**good.__dict__, "calibration": {"flag": True}}),
        PredictorFile(**{**good.__dict__, "layers": (good.layers[0], replace(good.layers[1], threshold=math.inf))}),
    ]
    for pf in cases:
        with pytest.raises(ValueError):
            write_predictor(tmp_path / "x.predictor", pf)
    assert list(tmp_path.iterdir()) == []


# -- PowerInfer's formats ---------------------------------------------------------------------


def _patch_magic(path: Path, version: int | None = None) -> None:
    with open(path, "r+b") as fh:
        fh.write(b"PWRI")
        if version is not None:
            fh.write(struct.pack("<I", version))


def _patch_tensor_type(path: Path, name: str, type_id: int) -> None:
    """Rewrite one tensor's type id in the header (emulates PowerInfer's own gguf-py type table)."""
    data = bytearray(path.read_bytes())
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(key) + len(key)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, type_id)
    path.write_bytes(bytes(data))


def _powerinfer_model(path: Path, threshold: float | None, ranks: tuple[int, ...] = (16, 24),
                      n_ff: int = N_FF) -> dict[str, np.ndarray]:
    """A PWRI model file as convert-hf-to-powerinfer-gguf.py lays it out (predictor part + norms)."""
    rng = np.random.default_rng(3)
    w = GGUFWriter(path, "llama")
    w.add_name("ReluLLaMA-tiny")
    w.add_block_count(len(ranks))
    w.add_embedding_length(D)
    w.add_feed_forward_length(n_ff)
    if threshold is not None:
        w.add_float32("powerinfer.sparse_threshold", threshold)
    arrays: dict[str, np.ndarray] = {}
    for i, r in enumerate(ranks):
        p = f"blk.{i}."
        arrays[p + "fc1.weight"] = (rng.standard_normal((r, D)) / 8).astype(np.float16)  # F16, like --outtype f16
        arrays[p + "fc2.weight"] = (rng.standard_normal((n_ff, r)) / 4).astype(np.float16)
        arrays[p + "ffn_norm.weight"] = (0.5 + rng.random(D)).astype(np.float32)
        arrays[p + "ffn_down_t.weight"] = rng.standard_normal((n_ff, D)).astype(np.float16)
    _write_out(w, arrays)
    _patch_magic(path)
    return arrays


def test_powerinfer_model_file(tmp_path: Path, make_model: Any, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "relu.powerinfer.gguf"
    arrays = _powerinfer_model(path, threshold=None)
    raw = path.read_bytes()
    assert is_powerinfer_file(path) and not is_powerinfer_file(make_model())
    with pytest.raises(ModelFileError):
        GGUFFile(path)  # the core reader still insists on GGUF
    f = open_powerinfer_gguf(path)
    assert f.powerinfer and f.tensor("blk.1.ffn_down_t.weight").shape == (N_FF, D)
    assert np.array_equal(f.raw("blk.0.fc1.weight"), arrays["blk.0.fc1.weight"])

    pf = read_predictor(path)
    assert path.read_bytes() == raw  # the copy-on-write mapping never touches the file
    assert (pf.mode, pf.fingerprint, pf.n_layers, pf.d_model, pf.n_ff, pf.rank) == ("predictor", "", 2, D, N_FF, 24)
    assert pf.model_name == "ReluLLaMA-tiny" and pf.input == "normed"
    assert [lp.rank for lp in pf.layers] == [16, 24] and all(lp.threshold == 0.0 for lp in pf.layers)
    assert all(not lp.act_freq.any() and not lp.act_mass.any() for lp in pf.layers)
    # folded onto the normed input: the same active set as PowerInfer's rule on the residual input
    rng = np.random.default_rng(7)
    x = rng.standard_normal((32, D)).astype(np.float32) * 3  # ffn_inp, the residual stream
    for i, lp in enumerate(pf.layers):
        p = f"blk.{i}."
        w1, w2 = arrays[p + "fc1.weight"].astype(np.float64), arrays[p + "fc2.weight"].astype(np.float64)
        logits = np.maximum(x @ w1.T, 0) @ w2.T  # PowerInfer: active iff logit >= threshold (0)
        normed = x / np.sqrt((x.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-5) * arrays[p + "ffn_norm.weight"]
        clear = np.abs(logits) > 1e-4  # float32 rounding may flip exact near-ties
        assert clear.mean() > 0.99
        assert np.array_equal(lp.predict(normed.astype(np.float32))[clear], (logits >= 0.0)[clear])

    caplog.set_level(logging.WARNING)
    read_predictor(path, model=GGUFFile(make_model()))  # shapes match: accepted, with a warning
    assert "no model fingerprint" in caplog.text
    with pytest.raises(ModelFileError) as e:
        read_predictor(path, model=GGUFFile(make_model(n_ff=128)))
    _one_line_error(e, "160 FFN neurons", "has 128")


def test_powerinfer_threshold_unfolded(tmp_path: Path) -> None:
    path = tmp_path / "t.powerinfer.gguf"
    arrays = _powerinfer_model(path, threshold=0.25)
    pf = read_powerinfer_predictor(path, fold_ffn_norm=False)
    assert pf.input == "residual" and pf.calibration["sparse_threshold"] == 0.25
    x = np.random.default_rng(1).standard_normal((16, D)).astype(np.float32)
    w1, w2 = arrays["blk.1.fc1.weight"].astype(np.float64), arrays["blk.1.fc2.weight"].astype(np.float64)
    logits = np.maximum(x @ w1.T, 0) @ w2.T
    clear = np.abs(logits - 0.25) > 1e-4
    assert np.array_equal(pf.layers[1].predict(x)[clear], (logits >= 0.25)[clear])


def test_powerinfer_missing_layer(tmp_path: Path) -> None:
    path = tmp_path / "m.powerinfer.gguf"
    w = GGUFWriter(path, "llama")
    w.add_block_count(3)
    w.add_tensor("blk.0.fc1.weight", np.zeros((4, D), np.float16))
    w.add_tensor("blk.0.fc2.weight", np.zeros((N_FF, 4), np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _patch_magic(path)
    with pytest.raises(ModelFileError) as e:
        read_predictor(path)
    _one_line_error(e, "layer 1 has no predictor")


def _gpuidx(path: Path, on_gpu: list[np.ndarray], n_ff: int = N_FF, bucket: bool = True, legacy: bool = True) -> None:
    """A .gpuidx as powerinfer-py's export_split.py writes it."""
    w = GGUFWriter(path, "generic.gpu_index")
    for i, idx in enumerate(on_gpu):
        mask = np.zeros(n_ff, np.int32)
        mask[idx] = 1
        w.add_tensor(f"blk.{i}.gpu_idx", mask, raw_dtype=GGMLQuantizationType.I32)
        if bucket:
            w.add_tensor(f"blk.{i}.gpu_bucket", np.sort(idx).astype(np.int32), raw_dtype=GGMLQuantizationType.I32)
    w.add_block_count(len(on_gpu))
    w.add_uint64("split.vram_capacity", 123_456_789)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _patch_magic(path, version=3)
    if legacy:
        for i in range(len(on_gpu)):
            _patch_tensor_type(path, f"blk.{i}.gpu_idx", 18)
            if bucket:
                _patch_tensor_type(path, f"blk.{i}.gpu_bucket", 18)


@pytest.mark.parametrize(("bucket", "legacy"), [(True, True), (True, False), (False, True)])
def test_gpuidx(tmp_path: Path, bucket: bool, legacy: bool) -> None:
    rng = np.random.default_rng(0)
    on_gpu = [rng.choice(N_FF, 40, replace=False), np.zeros(0, np.int64), np.arange(N_FF)]  # middle: no GPU neurons
    path = tmp_path / "model.gguf.generated.gpuidx"
    _gpuidx(path, on_gpu, bucket=bucket, legacy=legacy)
    split = read_gpuidx(path)
    assert split.n_ff == N_FF and split.vram_capacity == 123_456_789 and len(split.layers) == 3
    for got, want in zip(split.layers, on_gpu, strict=True):
        assert got.dtype == np.int32 and got.tolist() == sorted(want.tolist())
    assert split.mask(0).sum() == 40 and split.mask(0)[split.layers[0]].all() and not split.mask(1).any()


def test_gpuidx_errors(tmp_path: Path) -> None:
    path = tmp_path / "bad.gpuidx"
    w = GGUFWriter(path, "generic.gpu_index")
    w.add_block_count(1)
    mask = np.zeros(N_FF, np.int32)
    mask[[1, 2, 3]] = 1
    w.add_tensor("blk.0.gpu_idx", mask, raw_dtype=GGMLQuantizationType.I32)
    w.add_tensor("blk.0.gpu_bucket", np.array([1, 2, 4], np.int32), raw_dtype=GGMLQuantizationType.I32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _patch_magic(path, version=3)
    with pytest.raises(ModelFileError) as e:
        read_gpuidx(path)
    _one_line_error(e, "gpu_bucket", "disagrees")
    other = tmp_path / "other.gpuidx"
    write_predictor(other, _pf())
    with pytest.raises(ModelFileError) as e:
        read_gpuidx(other)
    _one_line_error(e, "not a PowerInfer GPU index")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])  # past the end padding, into the last tensor
    with pytest.raises(ModelFileError) as e:
        read_gpuidx(path)
    _one_line_error(e, "truncated")
