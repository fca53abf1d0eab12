"""The shared layer loop (model/layer_loop.py): norms, sub-layers and residual adds in the engine's
order, for any run of layers, with and without Gemma-3's post norms.

Runs in: the pytest process.
"""

from __future__ import annotations

import numpy as np

from powerinfer.model.layer_loop import LayerNorms, rms_norm, run_layers


def _norms(rng: np.random.Generator, d: int, n: int, post: bool) -> list[LayerNorms]:
    def w() -> np.ndarray:
        return rng.uniform(0.5, 1.5, d).astype(np.float32)

    return [LayerNorms(w(), w(), w() if post else None, w() if post else None) for _ in range(n)]


def test_a_run_of_layers_is_the_per_layer_recipe_and_runs_compose() -> None:
    rng = np.random.default_rng(0)
    d, n = 16, 4
    for post in (False, True):
        norms = _norms(rng, d, n, post)
        mats = [(rng.standard_normal((d, d)).astype(np.float32) / 4, rng.standard_normal((d, d)).astype(np.float32) / 4) for _ in range(n)]
        calls: list[tuple[str, int]] = []

        def attention(layer: int, h: np.ndarray, pos: np.ndarray, slots: np.ndarray) -> np.ndarray:
            calls.append(("attn", layer))
            assert pos.tolist() == [3, 4] and slots.tolist() == [0, 0]
            return h @ mats[layer][0]

        def ffn(layer: int, h: np.ndarray, resid: np.ndarray | None = None) -> np.ndarray:
            calls.append(("ffn", layer))
            return np.tanh(h @ mats[layer][1])

        class Cfg:
            norm_eps = 1e-6

        x = rng.standard_normal((2, d)).astype(np.float32)
        want = x.copy()
        for i, nm in enumerate(norms):  # the recipe, written out
            h = rms_norm(want, nm.attn, 1e-6) @ mats[i][0]
            want = want + (rms_norm(h, nm.post_attn, 1e-6) if post else h)
            h = np.tanh(rms_norm(want, nm.ffn, 1e-6) @ mats[i][1])
            want = want + (rms_norm(h, nm.post_ffn, 1e-6) if post else h)
        pos, slots = np.array([3, 4]), np.zeros(2, np.int64)
        whole = run_layers(Cfg, norms, 0, n, x, pos, slots, attention, ffn)  # type: ignore[arg-type]
        np.testing.assert_array_equal(whole, want)
        assert calls == [(k, i) for i in range(n) for k in ("attn", "ffn")]
        # two runs [0, 1) and [1, n) give the same bits as one
        split = run_layers(Cfg, norms, 1, n, run_layers(Cfg, norms, 0, 1, x, pos, slots, attention, ffn), pos, slots,  # type: ignore[arg-type]
                           attention, ffn)
        np.testing.assert_array_equal(split, whole)
        assert run_layers(Cfg, norms, 2, 2, x, pos, slots, attention, ffn) is x  # type: ignore[arg-type]  # an empty run
