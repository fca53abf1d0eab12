"""Engine + in-process executor on synthetic models against the independent numpy forward pass."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from powerinfer.config import config_from_gguf
from powerinfer.coordinator.engine import Engine
from powerinfer.coordinator.inprocess import InProcessExecutor
from powerinfer.errors import ContextOverflowError, InvalidArgumentError
from powerinfer.gguf_file import GGUFFile
from powerinfer.model.reference import logits as reference_logits

IDS = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 65, 66, 67, 1, 2]


def build(path: Path, n_shards: int = 1, n_ctx: int = 64, n_batch: int = 512) -> Engine:
    f = GGUFFile(path)
    cfg = config_from_gguf(f)
    return Engine(f, cfg, InProcessExecutor(f, cfg, n_ctx, n_shards=n_shards), n_ctx=n_ctx, n_batch=n_batch)


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# bf16 activations and bf16 weights (float files) or int kernels: relative logit error bound.
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("qtype", [QT.F32, QT.Q8_0, QT.Q4_0])
def test_matches_reference_forward(make_model: Callable[..., Path], arch: str, qtype: QT) -> None:
    path = make_model(arch=arch, qtype=qtype, n_layers=2)
    eng = build(path)
    ours = eng.eval(IDS, all_logits=True)
    ref = reference_logits(eng.f, eng.cfg, IDS)
    assert ours.shape == (len(IDS), eng.cfg.vocab_size)
    # int8 requantization of Q8_0 adds the most error; F32/Q4_0 stay within bf16 rounding.
    assert rel_err(ours, ref) < 0.03
    assert np.mean(ours.argmax(-1) == ref.argmax(-1)) >= 0.9


def test_gemma3_sliding_window_is_applied(make_model: Callable[..., Path]) -> None:
    # window 8 in the synthetic gemma3: with 20 tokens, local layers must ignore far keys.
    path = make_model(arch="gemma3", n_layers=6, qtype=QT.F32)
    eng = build(path)
    assert eng.cfg.global_layers == (False, False, False, False, False, True)
    ours = eng.eval(IDS, all_logits=True)
    ref = reference_logits(eng.f, eng.cfg, IDS)
    assert rel_err(ours, ref) < 0.03


@pytest.mark.parametrize("n_shards", [2, 3, 5])
def test_shards_sum_to_unsharded(make_model: Callable[..., Path], n_shards: int) -> None:
    # 5 shards: more workers than kv heads (2) and a neuron count (160) they do not divide.
    path = make_model(arch="llama", qtype=QT.Q8_0)
    one = build(path).eval(IDS, all_logits=True)
    many = build(path, n_shards=n_shards).eval(IDS, all_logits=True)
    assert rel_err(many, one) < 0.01
    # random synthetic weights give near-tied logits; shard partials are summed in another order
    assert np.mean(many.argmax(-1) == one.argmax(-1)) >= 0.9


def test_incremental_decode_equals_full_pass(make_model: Callable[..., Path]) -> None:
    path = make_model(arch="qwen2", qtype=QT.F32)
    full = build(path).eval(IDS, all_logits=True)
    eng = build(path, n_batch=3)  # prefill in chunks of 3, then one token at a time
    prefix = eng.eval(IDS[:10], all_logits=True)
    steps = [eng.eval([t])[0] for t in IDS[10:]]
    inc = np.concatenate([prefix, np.stack(steps)])
    assert rel_err(inc, full) < 1e-3


def test_rewind_recomputes_same_logits(make_model: Callable[..., Path]) -> None:
    eng = build(make_model(arch="llama", qtype=QT.F32))
    first = eng.eval(IDS[:8])
    eng.eval(IDS[8:12])
    eng.rewind(7)
    again = eng.eval(IDS[7:8])
    np.testing.assert_allclose(again, first, rtol=1e-4, atol=1e-4)


def test_context_overflow_is_a_clear_error(make_model: Callable[..., Path]) -> None:
    eng = build(make_model(), n_ctx=8)
    with pytest.raises(ContextOverflowError, match="context of 8"):
        eng.eval(IDS[:9])
    eng.eval(IDS[:8])  # exactly full still works
    with pytest.raises(ContextOverflowError):
        eng.eval([1])


def test_bad_token_ids_rejected(make_model: Callable[..., Path]) -> None:
    eng = build(make_model())
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        eng.eval([1, 999999])
    with pytest.raises(InvalidArgumentError, match="empty"):
        eng.eval([])
    assert eng.tokens == []


def build_slots(path: Path, n_slots: int, n_ctx: int = 64) -> Engine:
    f = GGUFFile(path)
    cfg = config_from_gguf(f)
    return Engine(f, cfg, InProcessExecutor(f, cfg, n_ctx, n_slots=n_slots), n_ctx=n_ctx, n_batch=512, n_slots=n_slots)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_batched_decode_is_bit_identical_to_each_sequence_alone(make_model: Callable[..., Path], arch: str) -> None:
    """Continuous batching must not change any sequence's numbers: decode(B tokens, B slots) == B solo steps."""
    eng = build_slots(make_model(arch=arch, qtype=QT.Q4_0, n_layers=2), n_slots=3)
    prompts = [IDS[:7], IDS[3:15], IDS[10:12]]
    rng = np.random.default_rng(0)
    steps = [rng.integers(0, eng.cfg.vocab_size, 5).tolist() for _ in prompts]
    solo = []
    for p, s in zip(prompts, steps):
        eng.rewind(0, slot=0)
        eng.eval(p, slot=0)
        solo.append(np.concatenate([eng.eval([t], slot=0) for t in s]))
    for i, p in enumerate(prompts):
        eng.rewind(0, slot=i)
        eng.eval(p, slot=i)
    batched = np.stack([eng.decode([s[k] for s in steps], [0, 1, 2]) for k in range(5)], axis=1)  # [B, steps, V]
    for i in range(3):
        assert np.array_equal(batched[i], solo[i])
    assert [len(t) for t in eng.slot_tokens] == [12, 17, 7]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_cached_prefix_gives_bit_identical_logits_natively(make_model: Callable[..., Path], arch: str) -> None:
    """reusable_prefix keeps all but the last prompt token (llama-server's rule); on the native
    decoder (the default executors) the one-token pass that follows gives the very logits of the
    whole prompt evaluated at once, so a cached prefix never changes what a prompt generates."""
    from powerinfer.coordinator.native_executor import NativeExecutor
    from powerinfer.native.decoder_lib import decoder_lib

    lib = decoder_lib()
    if lib is None:
        pytest.fail("the native decoder did not build (see the log)")
    f = GGUFFile(make_model(arch=arch, qtype=QT.Q4_0, n_layers=2))
    cfg = config_from_gguf(f)
    eng = Engine(f, cfg, NativeExecutor(lib, f, cfg, 64, 1, max_tokens=64), n_ctx=64, n_batch=64)
    full = eng.eval(IDS)
    for cut in (5, 10, len(IDS)):
        keep = eng.reusable_prefix(IDS[:cut] + IDS[cut:])
        assert keep == len(IDS) - 1
        eng.rewind(keep)
        assert np.array_equal(eng.eval(IDS[keep:]), full)
    eng.rewind(3)  # a prompt that leaves the cache after 3 tokens keeps those 3
    assert eng.reusable_prefix(IDS[:3] + [5, 6]) == 3 and eng.reusable_prefix(IDS[:3]) == 2


def test_cached_prefix_on_torch_moves_logits_by_rounding_only(make_model: Callable[..., Path]) -> None:
    """The torch oracle takes another attention path for one query: the same best token, logits
    within bf16 rounding of the whole prompt's."""
    eng = build_slots(make_model(arch="llama", qtype=QT.Q4_0, n_layers=2), n_slots=1)
    full = eng.eval(IDS)
    keep = eng.reusable_prefix(IDS)
    assert keep == len(IDS) - 1
    eng.rewind(keep)
    again = eng.eval(IDS[keep:])
    assert again.argmax() == full.argmax() and np.abs(again - full).max() < 0.05 * np.abs(full).max()


def test_decode_checks_slots(make_model: Callable[..., Path]) -> None:
    eng = build_slots(make_model(arch="llama", qtype=QT.Q4_0, n_layers=2), n_slots=2, n_ctx=8)
    eng.eval(IDS[:4], slot=0)
    eng.eval(IDS[:8], slot=1)
    with pytest.raises(InvalidArgumentError, match="distinct"):
        eng.decode([1, 2], [0, 0])
    with pytest.raises(InvalidArgumentError, match="slot 2 out of range"):
        eng.decode([1], [2])
    with pytest.raises(ContextOverflowError, match="slot 1 is full"):
        eng.decode([1, 2], [0, 1])
    assert len(eng.slot_tokens[0]) == 4  # a refused step changes nothing
