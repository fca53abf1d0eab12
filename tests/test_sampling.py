"""Sampler: greedy, each truncation rule, penalties, seeding, parameter validation."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from powerinfer.errors import InvalidArgumentError
from powerinfer.sampling import Sampler, SamplingParams

LOGITS = np.array([1.0, 3.0, 2.0, 0.5, 2.9, -1.0], dtype=np.float32)


def draws(n: int = 2000, history: tuple[int, ...] = (), **kw: float) -> Counter[int]:
    s = Sampler(SamplingParams(seed=123, **kw))  # type: ignore[arg-type]
    return Counter(s(LOGITS, history) for _ in range(n))


def test_greedy_is_argmax() -> None:
    assert Sampler(SamplingParams(temperature=0))(LOGITS) == 1


def test_top_k_limits_candidates() -> None:
    assert set(draws(top_k=2, top_p=1.0, min_p=0.0, temperature=1.0)) == {1, 4}


def test_top_p_keeps_smallest_set_reaching_mass() -> None:
    p = np.exp(LOGITS - LOGITS.max())
    p /= p.sum()
    order = np.argsort(-p)
    # the two best tokens carry < 0.8 of the mass, the three best more
    assert p[order[:2]].sum() < 0.8 < p[order[:3]].sum()
    assert set(draws(top_k=0, top_p=0.8, min_p=0.0, temperature=1.0)) == set(order[:3].tolist())


def test_min_p_drops_unlikely_tokens() -> None:
    # p_i >= 0.3 * p_max keeps logits within ln(0.3) ~ -1.2 of the best: tokens 1, 4, 2
    assert set(draws(top_k=0, top_p=1.0, min_p=0.3, temperature=1.0)) == {1, 4, 2}


def test_temperature_sharpens() -> None:
    cold = draws(top_k=0, top_p=1.0, min_p=0.0, temperature=0.2)
    hot = draws(top_k=0, top_p=1.0, min_p=0.0, temperature=2.0)
    assert cold[1] > hot[1]
    assert len(hot) > len(cold)


def test_repeat_penalty_like_llama_cpp() -> None:
    s = Sampler(SamplingParams(temperature=0, repeat_penalty=2.0, repeat_last_n=2))
    out = s.apply_penalties(LOGITS, [0, 1, 5])  # only the last 2 (1 and 5) are penalised
    assert out[1] == pytest.approx(1.5) and out[5] == pytest.approx(-2.0) and out[0] == pytest.approx(1.0)
    assert s(LOGITS, [1]) == 4  # 3.0 / 2 = 1.5 drops below 2.9


def test_frequency_and_presence_penalties() -> None:
    s = Sampler(SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=0.25))
    out = s.apply_penalties(LOGITS, [2, 2, 3])
    assert out[2] == pytest.approx(2.0 - 1.0 - 0.25) and out[3] == pytest.approx(0.5 - 0.5 - 0.25)


def test_seed_reproducible() -> None:
    s1, s2 = Sampler(SamplingParams(seed=7, temperature=1.5)), Sampler(SamplingParams(seed=7, temperature=1.5))
    assert [s1(LOGITS) for _ in range(50)] == [s2(LOGITS) for _ in range(50)]


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": -1.0},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"min_p": -0.1},
        {"repeat_penalty": 0.0},
        {"repeat_last_n": -2},
        {"frequency_penalty": 3.0},
        {"seed": -5},
    ],
)
def test_bad_params_rejected(kw: dict[str, float]) -> None:
    with pytest.raises(InvalidArgumentError):
        SamplingParams(**kw)  # type: ignore[arg-type]


def test_candidates_without_sorting_the_vocabulary() -> None:
    """top_indices and head_indices (a large vocabulary is never sorted whole) give what a full
    sort gives: the top k in order, and a sorted head that holds every token top_p / min_p keep."""
    from powerinfer.sampling import head_indices, top_indices

    rng = np.random.default_rng(0)
    for n in (300, 5000, 262144):
        logits = (rng.standard_normal(n) * 3).astype(np.float32)
        logits[rng.integers(0, n, 40)] = -np.inf
        logits[rng.integers(0, n, 5)] = logits.max()  # ties at the top
        order = np.argsort(-logits, kind="stable")
        for k in (1, 7, 40, 256):
            got = top_indices(logits, k)
            assert np.array_equal(np.sort(logits[got])[::-1], logits[order[:k]]) and np.all(np.diff(logits[got]) <= 0)
        full = np.exp(logits.astype(np.float64) - logits.max())
        probs = full[order] / full.sum()
        for top_p, min_p in ((0.5, 0.0), (0.95, 0.0), (0.999, 0.0), (1.0, 0.05), (0.9, 0.1)):
            head = head_indices(logits, full, top_p, min_p)
            need = int(np.searchsorted(np.cumsum(probs), top_p)) + 1 if min_p == 0 else int(np.count_nonzero(probs >= min_p * probs[0]))
            assert head.size >= need and np.array_equal(logits[head[:need]], logits[order[:need]])


def test_untruncated_sampling_follows_the_softmax() -> None:
    """top_k 0, top_p 1, min_p 0 (the server's defaults): every token, drawn in proportion to
    exp(logit / T), without a sort."""
    logits = np.random.default_rng(3).standard_normal(50).astype(np.float32) * 1.5
    p = np.exp((logits - logits.max()) / 0.8)
    p /= p.sum()
    s = Sampler(SamplingParams(seed=1, temperature=0.8, top_k=0, top_p=1.0, min_p=0.0))
    freq = np.bincount([s(logits) for _ in range(40000)], minlength=50) / 40000
    assert np.abs(freq - p).max() < 5 * np.sqrt(p.max() / 40000)
