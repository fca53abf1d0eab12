"""The GPU runtime: offloaded layers' attention and hot neurons, on any :class:`Backend`.

Runs in: the GPU worker process (or the coordinator, for the in-process GPU worker).

``attention`` and ``ffn`` return partial sums in model space [T, d], like the CPU shards: the
attention of an offloaded layer is the whole layer's, the FFN partial covers the hot neurons, and
the coordinator adds the CPU workers' partial for the cold ones. Hot neurons are computed the way
:class:`powerinfer.cpu_workers.sparse_ffn.SparseFFNShard` computes its neurons, so hot + cold
is the layer's sparse FFN:

* dense (no predictor, or sparsity off) and prefill (T > 1): every hot neuron, masked when sparse;
* decode, ``gate`` mode: the gate of every hot neuron, then up and down only for |act(gate)| > thr;
* decode, ``predictor`` mode: the MLP picks the active hot neurons, only their rows are read.

The active list is compacted on the device (``compact``) and consumed through a device-side
count, so a sparse step has no host round trip. ``*_begin`` enqueue the work and return a pending
result (on CUDA: kernels and copies on a stream, the host is free meanwhile); prompts longer
than ``max_tokens`` run in chunks (each chunk's KV is written before the next one attends).

``layers`` runs a run of layers that live wholly here with the residual stream on the device
(kernels/residual.cu): the norms and residual adds of model/layer_loop.py as kernels; per chunk
the stream, positions and slots are copied in and the stream out once, where the per-layer path
copies every sub-layer's input in and output out and waits for it (two host round trips a layer).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from powerinfer.config import ACT_CODES, ModelConfig
from powerinfer.errors import ContextOverflowError, InvalidArgumentError
from powerinfer.gguf_file import GGUFFile
from powerinfer.gpu_worker.backend import Backend, Buf, PendingRead, PendingRows, disagreement
from powerinfer.gpu_worker.layout import GpuPlan, qkv_width
from powerinfer.gpu_worker.weights import (DeviceAttention, DeviceFfn, DeviceMat, DeviceMatrix, DeviceNorms, attention_arrays,
                                            hot_arrays, predictor_arrays)
from powerinfer.model.layer_loop import LayerNorms, load_layer_norms, run_layers
from powerinfer.predictors.predictor_file import PredictorFile

log = logging.getLogger(__name__)

DEVICE_RUN_AGREE = 1e-3  # the first run of whole layers: the device path's tolerance against the per-layer path


class GpuModel:
    def __init__(self, f: GGUFFile, cfg: ModelConfig, backend: Backend, plan: GpuPlan, n_ctx: int, n_slots: int = 1,
                 predictor: PredictorFile | None = None) -> None:
        if len(plan.hot) != cfg.n_layers or len(plan.gpu_layers) != cfg.n_layers:
            raise InvalidArgumentError(f"GPU plan has {len(plan.hot)} layers, the model {cfg.n_layers}")
        if n_slots < 1 or n_ctx < 1 or plan.max_tokens < 1:
            raise InvalidArgumentError("n_ctx, n_slots and max_tokens must be positive")
        self.cfg, self.b, self.plan, self.n_ctx, self.n_slots = cfg, backend, plan, n_ctx, n_slots
        self.mode = predictor.mode if predictor is not None and plan.sparse else "dense"
        self.kind, self.athr = ACT_CODES[cfg.activation], cfg.act_threshold
        ranks = [lp.rank for lp in predictor.layers] if predictor is not None and self.mode == "predictor" else [0] * cfg.n_layers
        self.attn: list[DeviceAttention | None] = [None] * cfg.n_layers
        self.ffns: list[DeviceFfn | None] = [None] * cfg.n_layers
        self.ws: dict[str, Buf] = {}
        if any(plan.gpu_layers) or any(len(h) for h in plan.hot):
            self._workspace(max(ranks))
        for i in range(cfg.n_layers):
            if plan.gpu_layers[i]:
                self.attn[i] = self._upload_attention(f, i)
            if len(plan.hot[i]):
                self.ffns[i] = self._upload_ffn(f, i, np.asarray(plan.hot[i], dtype=np.int64), predictor, ranks[i])
        # the norms of every layer whose attention is here (layout.attention_bytes counts them), for
        # runs of whole layers (a few KiB a layer)
        self.norms: list[DeviceNorms | None] | None = None
        self.host_norms: list[LayerNorms] = []
        # None: the first run of whole layers checks the device path; False: the per-layer path,
        # whose norms and biases run on the host (OPT: there is no LayerNorm kernel, and residual.cu
        # adds no output biases)
        self._device_run: bool | None = False if cfg.norm == "layer" or cfg.proj_bias else None
        if any(plan.gpu_layers):
            self.host_norms = load_layer_norms(f, cfg)
            self.norms = [self._upload_norms(self.host_norms[i], i) if plan.gpu_layers[i] else None for i in range(cfg.n_layers)]
        log.info("GPU (%s): %d attention layers, %d hot neurons, %.1f MiB", backend.name, sum(plan.gpu_layers),
                 sum(len(h) for h in plan.hot), self.nbytes / 2**20)

    @property
    def nbytes(self) -> int:
        return self.b.ledger.used

    # -- upload ------------------------------------------------------------------------------------

    def _workspace(self, max_rank: int) -> None:
        cfg, t, b = self.cfg, self.plan.max_tokens, self.b
        sizes: dict[str, tuple[int, Any]] = {
            "x": (t * cfg.d_model, np.float32), "y": (t * cfg.d_model, np.float32), "pos": (t, np.int64), "slots": (t, np.int64),
            "qkv": (t * qkv_width(cfg), np.float32), "att": (t * cfg.n_heads * cfg.v_head_dim, np.float32),
            "g": (t * cfg.n_ff, np.float32), "u": (t * cfg.n_ff, np.float32), "h": (t * cfg.n_ff, np.float32),
            "idx": (cfg.n_ff, np.int32), "count": (1, np.int32),
            "res": (t * cfg.d_model, np.float32), "h2": (t * cfg.d_model, np.float32),  # a run's stream, a normed output
        }
        if max_rank:
            sizes.update(z=(t * max_rank, np.float32), logits=(t * cfg.n_ff, np.float32))
        self.ws = {name: b.alloc(n, dt, f"scratch {name}") for name, (n, dt) in sizes.items()}

    def _mat(self, m: DeviceMatrix, what: str) -> DeviceMat:
        return DeviceMat(self.b.upload(m.data, what), m.suffix, m.row_bytes, m.n, m.k)

    def _upload_attention(self, f: GGUFFile, layer: int) -> DeviceAttention:
        cfg, b = self.cfg, self.b
        a = attention_arrays(f, cfg, layer)
        w = f"layer {layer} attention"
        kv = self.n_slots * cfg.n_kv_heads * self.n_ctx
        return DeviceAttention(
            q=self._mat(a.q, w), k=self._mat(a.k, w), v=self._mat(a.v, w), o=self._mat(a.o, w),
            bias=None if a.bias is None else b.upload(a.bias, w),
            q_norm=None if a.q_norm is None else b.upload(a.q_norm, w), k_norm=None if a.k_norm is None else b.upload(a.k_norm, w),
            inv_freq=b.upload(a.inv_freq if a.inv_freq.size else np.zeros(1), w), window=a.window,  # OPT: no rope
            k_cache=b.alloc(kv * cfg.head_dim, np.float16, f"layer {layer} KV cache"),
            v_cache=b.alloc(kv * cfg.v_head_dim, np.float16, f"layer {layer} KV cache"),
        )

    def _upload_norms(self, n: LayerNorms, layer: int) -> DeviceNorms:
        w, up = f"layer {layer} norms", self.b.upload
        return DeviceNorms(up(n.attn, w), up(n.ffn, w), None if n.post_attn is None else up(n.post_attn, w),
                         None if n.post_ffn is None else up(n.post_ffn, w))

    def _upload_ffn(self, f: GGUFFile, layer: int, hot: np.ndarray, predictor: PredictorFile | None, rank: int) -> DeviceFfn:
        h = hot_arrays(f, self.cfg, layer, hot)
        w = f"layer {layer}: {len(hot)} hot neurons"
        ffn = DeviceFfn(self._mat(h.gate, w), None if h.up is None else self._mat(h.up, w), self._mat(h.down_t, w),
                   float(predictor.layers[layer].threshold) if predictor is not None else 0.0,
                   None if h.bias is None else self.b.upload(h.bias, w))
        if rank:
            assert predictor is not None
            p = predictor_arrays(predictor.layers[layer], hot)
            ffn.fc1, ffn.fc1_b = self._mat(p.fc1, w), self.b.upload(p.fc1_b, w)
            ffn.fc2, ffn.fc2_b = self._mat(p.fc2, w), self.b.upload(p.fc2_b, w)
        return ffn

    # -- compute -----------------------------------------------------------------------------------

    def _gemv(self, m: DeviceMat, x: Buf, t: int, y: Buf, ldy: int, rows: Buf | None = None, n_dev: Buf | None = None) -> None:
        self.b.gemv(m.suffix, m.buf, m.row_bytes, rows, n_dev, m.n, x, m.k, t, y, ldy)

    def _tail(self, name: str, offset: int) -> Buf:
        buf = self.ws[name]
        return self.b.view(buf, offset, buf.size - offset)

    def _chunks(self, x: np.ndarray) -> list[tuple[int, int]]:
        if x.ndim != 2 or x.shape[1] != self.cfg.d_model:
            raise InvalidArgumentError(f"expected activations [T, {self.cfg.d_model}], got {list(x.shape)}")
        mt = self.plan.max_tokens
        return [(i, min(i + mt, x.shape[0])) for i in range(0, x.shape[0], mt)]

    def attention_begin(self, layer: int, x: np.ndarray, positions: np.ndarray, slots: np.ndarray | None = None) -> PendingRows:
        """x [T, d] normed, positions [T], slots [T] (None: slot 0) -> pending attention output [T, d]."""
        a = self.attn[layer]
        if a is None:
            raise InvalidArgumentError(f"layer {layer}'s attention is not on the GPU")
        pos, sl = self._positions(x, positions, slots)
        return PendingRows([self._attention_chunk(a, x[i:j], pos[i:j], sl[i:j]) for i, j in self._chunks(x)], self.cfg.d_model)

    def _positions(self, x: np.ndarray, positions: np.ndarray, slots: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """int64 positions [T] and slots [T] (None: slot 0), checked against x [T, d], the context and the slots."""
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        sl = np.zeros_like(pos) if slots is None else np.asarray(slots, dtype=np.int64).reshape(-1)
        if pos.shape[0] != x.shape[0] or sl.shape[0] != x.shape[0]:
            raise InvalidArgumentError(f"{x.shape[0]} tokens but {pos.shape[0]} positions and {sl.shape[0]} slots")
        if pos.size and pos.min() < 0:
            raise InvalidArgumentError(f"position {int(pos.min())} is negative")
        if pos.size and pos.max() >= self.n_ctx:
            raise ContextOverflowError(f"position {int(pos.max())} does not fit the context of {self.n_ctx} (raise -c/--ctx-size)")
        if sl.size and (sl.min() < 0 or sl.max() >= self.n_slots):
            raise InvalidArgumentError(f"KV-cache slot {int(sl.min() if sl.min() < 0 else sl.max())} out of range (the GPU worker holds {self.n_slots})")
        return pos, sl

    def _attention_chunk(self, a: DeviceAttention, x: np.ndarray, pos: np.ndarray, sl: np.ndarray) -> PendingRead:
        b, ws = self.b, self.ws
        b.write(ws["x"], x)
        b.write(ws["pos"], pos)
        b.write(ws["slots"], sl)
        self._attention_dev(a, x.shape[0])
        return b.read(ws["y"], x.shape[0] * self.cfg.d_model)

    def _attention_dev(self, a: DeviceAttention, t: int) -> None:
        """ws.y [t, d] = the layer's attention of ws.x [t, d] (normed) at ws.pos / ws.slots."""
        cfg, b, ws = self.cfg, self.b, self.ws
        Hq, Hkv, D, Dv, W = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.v_head_dim, qkv_width(cfg)
        # fused activations qkv [T, W]: q heads, then k heads, then v heads
        self._gemv(a.q, ws["x"], t, ws["qkv"], W)
        self._gemv(a.k, ws["x"], t, self._tail("qkv", Hq * D), W)
        self._gemv(a.v, ws["x"], t, self._tail("qkv", (Hq + Hkv) * D), W)
        if a.bias is not None:
            b.bias_act(ws["qkv"], W, a.bias, t, W, 0)
        if a.q_norm is not None and a.k_norm is not None:
            b.rms_norm(ws["qkv"], W, t, Hq, D, a.q_norm, cfg.norm_eps)
            b.rms_norm(self._tail("qkv", Hq * D), W, t, Hkv, D, a.k_norm, cfg.norm_eps)
        if cfg.rope_dim:  # OPT has learned positions instead (added to the embeddings)
            b.rope(ws["qkv"], W, ws["pos"], t, Hq + Hkv, D, cfg.rope_dim, a.inv_freq)  # q and k heads are adjacent
        b.kv_store(ws["qkv"], W, Hq * D, (Hq + Hkv) * D, ws["pos"], ws["slots"], t, Hkv, D, Dv, a.k_cache, a.v_cache, self.n_ctx)
        b.attend(ws["qkv"], W, ws["pos"], ws["slots"], t, Hq, Hkv, D, Dv, a.k_cache, a.v_cache, self.n_ctx, a.window,
                 cfg.attn_scale, ws["att"])
        self._gemv(a.o, ws["att"], t, ws["y"], cfg.d_model)  # [T, Hq * Dv] -> [T, d]

    def ffn_begin(self, layer: int, x: np.ndarray) -> PendingRows:
        """x [T, d] normed -> pending partial FFN output of this layer's hot neurons [T, d]."""
        ffn = self.ffns[layer]
        if ffn is None:
            raise InvalidArgumentError(f"layer {layer} has no hot neurons on the GPU")
        return PendingRows([self._ffn_chunk(ffn, x[i:j]) for i, j in self._chunks(x)], self.cfg.d_model)

    def _predict(self, ffn: DeviceFfn, t: int) -> None:
        """ws.logits [T, n_hot] = fc2(relu(fc1(x))) for the hot neurons (active where > 0)."""
        assert ffn.fc1 is not None and ffn.fc2 is not None and ffn.fc1_b is not None and ffn.fc2_b is not None
        b, ws, r, n = self.b, self.ws, ffn.fc1.n, ffn.gate.n
        self._gemv(ffn.fc1, ws["x"], t, ws["z"], r)
        b.bias_act(ws["z"], r, ffn.fc1_b, t, r, 1)
        self._gemv(ffn.fc2, ws["z"], t, ws["logits"], n)
        b.bias_act(ws["logits"], n, ffn.fc2_b, t, n, 0)

    def _ffn_chunk(self, ffn: DeviceFfn, x: np.ndarray) -> PendingRead:
        self.b.write(self.ws["x"], x)
        self._ffn_dev(ffn, x.shape[0])
        return self.b.read(self.ws["y"], x.shape[0] * self.cfg.d_model)

    def _ffn_dev(self, ffn: DeviceFfn, t: int) -> None:
        """ws.y [t, d] = the hot neurons' FFN partial of ws.x [t, d] (normed). A gate-less FFN (OPT)
        has fc1 in the gate's place, its bias added before the activation, and no up (u None: 1)."""
        b, ws, n, d = self.b, self.ws, ffn.gate.n, self.cfg.d_model
        u = None if ffn.up is None else ws["u"]
        b.zero(self.b.view(ws["y"], 0, t * d))  # axpy accumulates into y
        if self.mode == "dense" or t > 1:
            # every hot neuron; masked (not skipped) when sparse, as the CPU's sparse shard does
            self._gemv(ffn.gate, ws["x"], t, ws["g"], n)
            if ffn.up is not None:
                self._gemv(ffn.up, ws["x"], t, ws["u"], n)
            if ffn.bias is not None:
                b.bias_act(ws["g"], n, ffn.bias, t, n, 0)
            logits = None
            if self.mode == "predictor":
                self._predict(ffn, t)
                logits = ws["logits"]
            thr = ffn.threshold if self.mode == "gate" else -1.0
            b.act_mul(ws["g"], u, ws["h"], t, n, self.kind, self.athr, thr, logits)
            b.axpy(ffn.down_t.suffix, ffn.down_t.buf, ffn.down_t.row_bytes, None, None, n, ws["h"], n, d, t, ws["y"])
        else:
            idx, count = ws["idx"], ws["count"]
            if self.mode == "gate":
                self._gemv(ffn.gate, ws["x"], 1, ws["g"], n)
                if ffn.bias is not None:
                    b.bias_act(ws["g"], n, ffn.bias, 1, n, 0)
                b.act_inplace(ws["g"], n, self.kind, self.athr)
                b.compact(ws["g"], n, ffn.threshold, 1, idx, count)
                if ffn.up is not None:
                    self._gemv(ffn.up, ws["x"], 1, ws["u"], n, idx, count)
                b.gather_mul(ws["g"], idx, count, n, u, ws["h"], self.kind)
            else:
                self._predict(ffn, 1)
                b.compact(ws["logits"], n, 0.0, 0, idx, count)
                self._gemv(ffn.gate, ws["x"], 1, ws["g"], n, idx, count)
                if ffn.bias is not None:  # the compacted neurons' own biases
                    b.gather_add(ws["g"], ffn.bias, idx, count, n)
                if ffn.up is not None:
                    self._gemv(ffn.up, ws["x"], 1, ws["u"], n, idx, count)
                b.act_mul(ws["g"], u, ws["h"], 1, n, self.kind, self.athr, -1.0, None, count)
            # down projection over the active neurons' transposed rows only
            b.axpy(ffn.down_t.suffix, ffn.down_t.buf, ffn.down_t.row_bytes, idx, count, n, ws["h"], n, d, 1, ws["y"])

    def attention(self, layer: int, x: np.ndarray, positions: np.ndarray, slots: np.ndarray | None = None) -> np.ndarray:
        return self.attention_begin(layer, x, positions, slots).result()

    def ffn(self, layer: int, x: np.ndarray, resid: np.ndarray | None = None) -> np.ndarray:
        """(resid unused: the GPU worker refuses predictors that read the residual.)"""
        return self.ffn_begin(layer, x).result()

    def whole(self, layer: int) -> bool:
        """Whether the layer lives wholly here: its attention and every FFN neuron."""
        ffn = self.ffns[layer]
        return self.attn[layer] is not None and ffn is not None and len(self.plan.hot[layer]) == self.cfg.n_ff

    def layers(self, first: int, stop: int, x: np.ndarray, positions: np.ndarray, slots: np.ndarray | None = None) -> np.ndarray:
        """x [T, d] the residual stream entering layer `first` -> leaving layer stop - 1, for a run of
        layers that live wholly here, with the stream on the device (the module docstring): the
        recipe of model/layer_loop.py, the norms and adds as kernels (on the numpy backend the same
        float32 operations, so the same bits as the engine's loop). The first run also runs the
        per-layer path and keeps the device path only if the two agree."""
        if not 0 <= first < stop <= self.cfg.n_layers:
            raise InvalidArgumentError(f"a run of layers [{first}, {stop}) is empty or outside the model's {self.cfg.n_layers} layers")
        if not all(self.whole(i) for i in range(first, stop)):
            part = [i for i in range(first, stop) if not self.whole(i)]
            raise InvalidArgumentError(f"layers {first}..{stop - 1} do not all live wholly on the GPU (not: {part[:8]})")
        if self.norms is None:
            raise InvalidArgumentError("this GPU runtime was built without the layers' norms")
        x = np.asarray(x, dtype=np.float32)
        pos, sl = self._positions(x, positions, slots)
        if self._device_run is False:
            return self._host_run(first, stop, x, pos, sl)
        if self._device_run is None:
            # the first run: residual.cu has run on the host CPU only, so the device path must agree
            # with the per-layer path on this card before it is trusted (both rewrite the same KV)
            host, dev = self._host_run(first, stop, x, pos, sl), self._device_layers(first, stop, x, pos, sl)
            err = disagreement(dev, host)
            self._device_run = bool(err <= DEVICE_RUN_AGREE)
            if not self._device_run:
                log.warning("runs of whole layers with the stream on the device differ from the per-layer path by %.2e of its "
                            "scale on %s; using the per-layer path (slower; please report this card)", err, self.b.name)
            return dev if self._device_run else host
        return self._device_layers(first, stop, x, pos, sl)

    def _host_run(self, first: int, stop: int, x: np.ndarray, pos: np.ndarray, sl: np.ndarray) -> np.ndarray:
        """The per-layer path: the engine's loop (model/layer_loop.py) over attention() and ffn()."""
        at = [first]

        def attention(layer: int, h: np.ndarray, p: np.ndarray, s: np.ndarray) -> np.ndarray:
            at[0] = layer
            return self.attention(layer, h, p, s)

        try:
            return run_layers(self.cfg, self.host_norms, first, stop, x, pos, sl, attention, self.ffn)
        except Exception as e:
            e.failed_layer = at[0]  # type: ignore[attr-defined]
            raise

    def _device_layers(self, first: int, stop: int, x: np.ndarray, pos: np.ndarray, sl: np.ndarray) -> np.ndarray:
        b, ws, d = self.b, self.ws, self.cfg.d_model
        out = np.empty_like(x)
        layer = first  # the layer being computed, for an error's report (processes/worker_runtime.py reads failed_layer)
        try:
            for i, j in self._chunks(x):
                t, layer = j - i, first
                b.write(ws["res"], x[i:j])
                b.write(ws["pos"], pos[i:j])
                b.write(ws["slots"], sl[i:j])
                for layer in range(first, stop):
                    n, a, ffn = self.norms[layer], self.attn[layer], self.ffns[layer]
                    assert n is not None and a is not None and ffn is not None  # whole(), checked above
                    self._norm(n.attn, t)
                    self._attention_dev(a, t)
                    self._add(n.post_attn, t)
                    self._norm(n.ffn, t)
                    self._ffn_dev(ffn, t)
                    self._add(n.post_ffn, t)
                # on CUDA a kernel's asynchronous error surfaces here, charged to the run's last layer
                out[i:j] = b.read(ws["res"], t * d).result().reshape(t, d)
        except Exception as e:
            e.failed_layer = layer  # type: ignore[attr-defined]
            raise
        return out

    def _norm(self, w: Buf, t: int) -> None:
        """ws.x [t, d] = rms_norm(the stream ws.res) * w: a sub-layer's input."""
        d = self.cfg.d_model
        self.b.rms_norm_rows(self.ws["res"], d, self.ws["x"], d, t, d, w, self.cfg.norm_eps)

    def _add(self, post: Buf | None, t: int) -> None:
        """The stream ws.res += the sub-layer's output ws.y (post-normed first when the layer has a post norm)."""
        b, ws, d = self.b, self.ws, self.cfg.d_model
        out = ws["y"]
        if post is not None:
            b.rms_norm_rows(ws["y"], d, ws["h2"], d, t, d, post, self.cfg.norm_eps)
            out = ws["h2"]
        b.add_rows(ws["res"], d, out, d, t, d)

    def close(self) -> None:
        self.attn = [None] * self.cfg.n_layers
        self.ffns = [None] * self.cfg.n_layers
        self.norms, self.host_norms = None, []
        self.ws = {}
        self.b.close()
