"""PowerInfer's own layout: ``convert --powerinfer`` writes it, ``-m`` runs it (embedded predictor,
transposed down projection, threshold), against transformers with PowerInfer's rule as a hook."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from powerinfer.api import LLM
from powerinfer.errors import ModelFileError
from powerinfer.convert.run import convert
from powerinfer.config import config_from_gguf
from powerinfer.gguf_file import GGUFFile
from powerinfer.model import reference
from powerinfer.predictors.powerinfer_formats import open_powerinfer_gguf
from powerinfer.predictors.predictor_file import read_predictor
from tests.convert.hf_models import hook_powerinfer_rule, load_oracle, make_checkpoint, oracle_logits, write_predictor_dir


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POWERINFER_CACHE", str(tmp_path / "cache"))


def _ids(seed: int = 1, n: int = 64) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(2, 290, n)]


def _run(path: Path, ids: list[int], **kw: object) -> tuple[np.ndarray, LLM]:
    llm = LLM(path, n_ctx=128, **kw)  # type: ignore[arg-type]
    try:
        return llm.logits(ids), llm
    finally:
        llm.close()


@pytest.mark.slow
@pytest.mark.parametrize("act", ["relu", "drelu"])
def test_powerinfer_layout_round_trip(tmp_path: Path, act: str) -> None:
    src = make_checkpoint(tmp_path / "hf", act, seed=5)
    preds = write_predictor_dir(tmp_path / "pred", src, seed=6, threshold=0.0)
    out = convert(src, tmp_path / "m.powerinfer.gguf", "f32", predictor=preds, powerinfer=True)[0]
    assert out.read_bytes()[:4] == b"PWRI"
    f = open_powerinfer_gguf(out)
    assert f.metadata["general.architecture"] == ("bamboo" if act == "drelu" else "llama")
    assert "blk.0.ffn_down" + ".weight" not in f.tensors and f.tensor("blk.0.ffn_down_t.weight").shape == (128, 64)
    assert f.tensor("blk.1.fc1.weight").shape == (16, 64) and f.tensor("blk.1.fc2.weight").shape == (128, 16)
    assert "output.weight" in f.tensors

    ids = _ids()
    dense_ref = oracle_logits(load_oracle(src), ids)
    sparse_ref = oracle_logits(hook_powerinfer_rule(load_oracle(src), preds), ids)
    span = dense_ref.max() - dense_ref.min()
    assert np.abs(sparse_ref - dense_ref).max() / span > 1e-2  # the rule really changes the output

    # The file's rule, made ours (the plain GGUF and the folded predictor), is PowerInfer's exactly
    # in float arithmetic: the numpy statement of a sparse forward pass with it equals the hook.
    runnable = LLM(out, n_ctx=128, executor="inprocess")
    pw = runnable.powerinfer_file
    runnable.close()
    assert pw is not None and pw.model.exists() and pw.predictor.exists()
    exact = _numpy_sparse(pw.model, pw.predictor, ids)
    assert np.abs(exact - sparse_ref).max() / span < 1e-4  # an f32 file: ffn_down_t exact

    for executor in ({"executor": "inprocess"}, {"executor": "process", "n_threads": 2}):
        sparse, llm = _run(out, ids, **executor)
        assert llm.sparse and llm.powerinfer_file is not None
        # The engine runs the predictor on 8-bit weights and activations (fast, as its FFN): about
        # 0.2-0.5% of the neurons, those whose logit is near 0, flip; each moves this tiny model's
        # logits by up to ~10% of their range (measured: median position 0.8%, worst 9.8%, top-1 95%).
        err = np.abs(sparse - sparse_ref).max(-1) / span
        assert np.median(err) < 2e-2 and err.max() < 0.15, f"sparse {executor}: median {np.median(err):.2e}, max {err.max():.2e}"
        assert (sparse.argmax(-1) == sparse_ref.argmax(-1)).mean() >= 0.9
        dense, llm = _run(out, ids, sparse=False, **executor)
        assert not llm.sparse
        assert np.abs(dense - dense_ref).max() / span < 1e-4  # --no-sparse: every neuron, ReLU


def _numpy_sparse(model: Path, predictor: Path, ids: list[int]) -> np.ndarray:
    """The sparse forward pass in plain numpy (model/reference.py's pieces), the predictor in float."""
    f = GGUFFile(model)
    cfg, pf = config_from_gguf(f), read_predictor(predictor)
    x = reference.weight(f, "token_embd.weight")[np.asarray(ids)][None]
    for i in range(cfg.n_layers):
        w = reference._Layer(f, i, np.float64)
        x = x + reference.attention(cfg, i, reference.rms_norm(x, w("attn_norm"), cfg.norm_eps), w)
        h = reference.rms_norm(x, w("ffn_norm"), cfg.norm_eps).reshape(-1, cfg.d_model)
        on = pf.layers[i].predict(h.astype(np.float32))
        hidden = reference.glu(h @ w("ffn_gate").T, h @ w("ffn_up").T, cfg.activation, cfg.act_threshold) * on
        x = x + (hidden @ w("ffn_down").T).reshape(x.shape)
    out = reference.rms_norm(x[0], reference.weight(f, "output_norm.weight"), cfg.norm_eps)
    return out @ reference.weight(f, "token_embd.weight" if cfg.tied_embeddings else "output.weight").T


def test_predictor_folder_becomes_our_predictor(tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "hf", "relu", seed=8)
    preds = write_predictor_dir(tmp_path / "pred", src, seed=9)
    model, pred = convert(src, tmp_path / "m.gguf", "f32", predictor=preds)
    assert pred == tmp_path / "m.predictor" and pred.exists()
    ids = _ids(2)
    ref = oracle_logits(hook_powerinfer_rule(load_oracle(src), preds), ids)
    assert np.abs(_numpy_sparse(model, pred, ids) - ref).max() / (ref.max() - ref.min()) < 1e-5
    ours, _ = _run(model, ids, executor="inprocess", predictor=pred)
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
    assert "powerinfer.ffn_activation" in GGUFFile(model).metadata


@pytest.mark.parametrize("outtype", ["f16", "q4_0"])
def test_powerinfer_files_in_its_usual_types_run(tmp_path: Path, outtype: str) -> None:
    """F16 and Q4_0 PWRI files (what PowerInfer's users have): a quantized ffn_down_t is widened to F16
    in the runnable form; the engine equals the numpy statement of that form."""
    src = make_checkpoint(tmp_path / "hf", "relu", seed=11)
    preds = write_predictor_dir(tmp_path / "pred", src, seed=12)
    out = convert(src, tmp_path / f"m-{outtype}.powerinfer.gguf", outtype, predictor=preds, powerinfer=True)[0]
    f = open_powerinfer_gguf(out)
    assert f.tensor("blk.0.ffn_down_t.weight").qtype.name == outtype.upper()
    assert f.tensor("blk.0.fc1.weight").qtype.name == "F16"
    ids = _ids(4)
    dense, llm = _run(out, ids, executor="inprocess", sparse=False)
    pw = llm.powerinfer_file
    assert pw is not None
    plain = GGUFFile(pw.model)
    assert plain.tensor("blk.0.ffn_down.weight").shape == (64, 128) and "blk.0.fc1.weight" not in plain.tensors
    want = reference.logits(plain, config_from_gguf(plain), ids)
    assert np.abs(dense - want).max() / (want.max() - want.min()) < 2e-2
    again, llm2 = _run(out, ids, executor="inprocess", sparse=False)  # the second open reuses the cache
    assert llm2.powerinfer_file == pw and np.array_equal(again, dense)


@pytest.mark.slow
def test_the_server_serves_a_powerinfer_file(tmp_path: Path) -> None:
    """powerinfer-server -m model.powerinfer.gguf: its predictor is on, a completion is the engine's greedy text."""
    import httpx

    from powerinfer.sampling import SamplingParams
    from tests.server.conftest import start_server

    src = make_checkpoint(tmp_path / "hf", "relu", seed=13)
    preds = write_predictor_dir(tmp_path / "pred", src, seed=14)
    out = convert(src, tmp_path / "m.powerinfer.gguf", "f16", predictor=preds, powerinfer=True)[0]
    texts = {}
    for sparse in (True, False):
        llm = LLM(out, n_ctx=128, executor="inprocess", sparse=sparse)
        try:
            texts[sparse] = "".join(c.text for c in llm.generate("The quick", 8, sampling=SamplingParams(temperature=0)))
        finally:
            llm.close()
    want = texts[True]
    assert want != texts[False]  # the predictor changes this model's text: the server's answer says which ran
    server = start_server(out, tmp_path, "-c", "128", "-t", "1", "--executor", "inprocess")
    try:
        r = httpx.post(server.base_url + "/completions", json={"prompt": "The quick", "max_tokens": 8, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
    finally:
        server.stop()


def _write_gpuidx(path: Path, hot: list[np.ndarray], n_ff: int) -> None:
    """PowerInfer's FILE.generated.gpuidx: PWRI magic, generic.gpu_index, per layer gpu_idx and gpu_bucket."""
    from gguf import GGMLQuantizationType as QT, GGUFWriter

    w = GGUFWriter(str(path), "generic.gpu_index")
    w.add_block_count(len(hot))
    w.add_uint64("split.vram_capacity", 1 << 20)
    for i, idx in enumerate(hot):
        mask = np.zeros(n_ff, np.int32)
        mask[idx] = 1
        w.add_tensor(f"blk.{i}.gpu_idx", mask, raw_dtype=QT.I32)
        w.add_tensor(f"blk.{i}.gpu_bucket", np.sort(idx).astype(np.int32), raw_dtype=QT.I32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(path, "r+b") as fh:
        fh.write(b"PWRI")


def test_powerinfer_gpu_index_beside_the_file_leads_the_gpu_split(tmp_path: Path) -> None:
    """FILE.generated.gpuidx: its GPU neurons are what our solver places first, under our budget."""
    from powerinfer.coordinator.placement import layer_costs, solve_neuron_split
    from powerinfer.predictors.pwri_model import prepare_pwri

    src = make_checkpoint(tmp_path / "hf", "relu", seed=15)
    preds = write_predictor_dir(tmp_path / "pred", src, seed=16)
    out = convert(src, tmp_path / "m.powerinfer.gguf", "f16", predictor=preds, powerinfer=True)[0]
    plain = prepare_pwri(out)
    hot = [np.array([3, 17, 40, 99], np.int64), np.array([5, 6, 120], np.int64)]
    _write_gpuidx(out.with_name(out.name + ".generated.gpuidx"), hot, 128)
    pw = prepare_pwri(out)
    assert pw.model != plain.model  # the index is part of the cache key
    f = GGUFFile(pw.model)
    cfg, pf = config_from_gguf(f), read_predictor(pw.predictor, model=f)
    assert all(float(lp.act_freq.sum()) == 0 for lp in pf.layers)  # the CPU's sparse-layer choice is unchanged
    costs = layer_costs(f, cfg, 128, predictor=pf)
    budget = int(costs.overhead + costs.first_neuron().sum() + costs.per_neuron[0] * 7)  # room for 7 neurons, no attention
    placed = solve_neuron_split(pf, costs, budget, cfg.n_layers)
    assert [h.tolist() for h in placed.hot] == [[3, 17, 40, 99], [5, 6, 120]]
    (out.with_name(out.name + ".generated.gpuidx")).write_bytes(b"PWRI" + b"\0" * 20)
    with pytest.raises(ModelFileError):
        prepare_pwri(out)
