"""The pipeline executor: a model's layers in N stages on N Ray nodes, micro-batches flowing through them.

Runs in: the coordinator (Ray's driver). Ray is imported here, and only when this executor is built.

A step goes to stage 0 and comes back from the last stage, one ZeroMQ hop per stage (wire.py):

    coordinator --ids--> stage 0 --hidden--> stage 1 ... stage N-1 --answer--> coordinator

A batch of several rows (decode of several sequences, or a prompt's chunk; not a perplexity pass,
whose every row's logits should be what one process gives) is cut into up to N micro-batches sent back to back, so stage 0 computes the second while stage 1 computes the first;
each stage keeps its messages in order, so a sequence's rows meet its KV cache in order. Ray places
the stages (a placement group, one bundle per stage: STRICT_SPREAD, one per node, or PACK) and
starts them; each stage beats every 0.5 s. A stage whose actor call ends (its node died, its
process was killed) or that stops beating for STAGE_SILENT_S fails the step in flight with
WorkerDiedError within seconds; the engine core then restarts the executor: the stages are placed
again, waiting up to ``place_timeout_s`` for a node to return, and a restart that cannot place them
says so instead of hanging (the next request tries again).
"""

from __future__ import annotations

import importlib
import logging
import time
from typing import Any, NoReturn

import numpy as np
import zmq

from powerinfer.config import ModelConfig
from powerinfer.coordinator.cluster.options import PLACEMENTS, ClusterOptions
from powerinfer.coordinator.cluster.plan import StageRange, layer_bytes, split_layers
from powerinfer.coordinator.cluster.stage import Stage, StageSpec
from powerinfer.coordinator.cluster.wire import StageMsg, decode, heartbeat_stage
from powerinfer.coordinator.executor import Batch, Description, Want, no_kv
from powerinfer.errors import InvalidArgumentError
from powerinfer.gguf_file import GGUFFile
from powerinfer.protocol import ProtocolError, WorkerDiedError

log = logging.getLogger(__name__)

STAGE_SILENT_S = 5.0  # a stage that has not beaten for this long is lost
POLL_MS = 50
HEALTH_EVERY_S = 0.25  # how often a waiting step asks Ray whether a stage's call has ended
SPARSE_ROWS_T = 4  # kernels/sparse_rows.h's PI_SPARSE_T: up to this many tokens a sparse FFN reads rows, above it masks a dense pass
STAGE_START_S = 900.0  # a stage loading its layers (a 70B model's quarter: ~10 GB mapped and repacked) may take minutes
CALL_S = 30.0  # a stage's small calls between steps (counters, the sparse switch)
STEP_TIMEOUT_S = 600.0  # a step that has not come back in this long fails (no stage reported lost: a hang)


def _ray() -> Any:
    try:
        return importlib.import_module("ray")  # by name: Ray is an optional extra, not a type-checked dependency
    except ImportError:
        raise InvalidArgumentError("a Ray cluster (--ray-address, --pipeline-stages) needs Ray: pip install 'powerinfer[ray]'") from None


class PipelineExecutor:
    """The layers in stages on Ray nodes (see the module docstring)."""

    def __init__(self, path: str, f: GGUFFile, cfg: ModelConfig, n_ctx: int, n_slots: int, n_batch: int, opts: ClusterOptions,
                 predictor: str = "") -> None:
        """predictor: a .predictor file (at the same path on every node): the stages' FFNs run sparsely."""
        opts.check()
        self.predictor = predictor
        self.ray = _ray()
        self.path, self.cfg, self.opts = path, cfg, opts
        self.n_ctx, self.n_slots, self.n_batch = n_ctx, n_slots, n_batch
        self._own_ray = False
        if not self.ray.is_initialized():
            self.ray.init(address=opts.address, log_to_driver=False, configure_logging=False)
            self._own_ray = True
        self.per_layer, self.embd, self.head = layer_bytes(f, cfg)
        self.ranges: list[StageRange] = []
        self.actors: list[Any] = []
        self.nodes: list[str] = []
        self.node_ids: list[str] = []
        self.held = 0  # bytes the stages hold
        self.serving: list[Any] = []
        self.pg: Any = None
        self.ctx = zmq.Context()
        self.results: zmq.Socket[bytes] | None = None
        self.beats: zmq.Socket[bytes] | None = None
        self.pushes: list[zmq.Socket[bytes]] = []  # to each replica's stage 0
        self.sent: list[int] = []  # micro-batches sent to each replica, for describe()
        self.last_beat: list[float] = []
        self.broken: str | None = None  # why the stages cannot take a step until restart()
        self.step = 0
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    # -- placing and wiring the stages ------------------------------------------------------------

    def _memory(self) -> list[int]:
        """Each stage's node memory, largest nodes first (the bundles ask for what their range needs)."""
        alive = [n for n in self.ray.nodes() if n.get("Alive")]
        mem = sorted((int(n.get("Resources", {}).get("memory", 0)) for n in alive), reverse=True)
        n, want = self.opts.stages, self.opts.stages * self.opts.replicas
        if self.opts.placement == "spread" and len(mem) < want:
            raise WorkerDiedError(f"{self.opts.replicas} replica(s) of {n} pipeline stage(s) need {want} Ray nodes (one stage per node), "
                                  f"the cluster has {len(mem)} alive")
        if self.opts.placement == "pack":
            return [mem[0] if mem else 0] * n
        return mem[want - n : want]  # the smallest of the nodes the stages will take: every replica's split must fit them

    def _start(self) -> None:
        ray = self.ray
        placement_group = importlib.import_module("ray.util.placement_group").placement_group
        remove_placement_group = importlib.import_module("ray.util.placement_group").remove_placement_group
        PlacementGroupSchedulingStrategy = importlib.import_module("ray.util.scheduling_strategies").PlacementGroupSchedulingStrategy

        memory = self._memory()
        if self.opts.placement == "pack":  # one host: the weights are mapped once per stage from the same page cache
            memory = [max(memory[0], sum(self.per_layer) + self.embd + self.head)] * len(memory)
        self.ranges = split_layers(self.per_layer, self.embd, self.head, memory)
        S, R = len(self.ranges), self.opts.replicas
        bundles = [{"CPU": 1.0} for _ in range(S * R)]
        pg = placement_group(bundles, strategy=PLACEMENTS[self.opts.placement])
        try:
            ray.get(pg.ready(), timeout=self.opts.place_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)
            raise WorkerDiedError(f"could not place {len(bundles)} pipeline stages ({self.opts.placement}) within {self.opts.place_timeout_s:.0f} s: "
                                  "too few Ray nodes alive with a free CPU") from None
        self.pg = pg
        actor = ray.remote(Stage)
        self.actors = []
        slots = -(-self.n_slots // R)  # replica r holds the engine's slots r, r + R, ...: its own slot s // R
        for k in range(S * R):
            r = self.ranges[k % S]
            spec = StageSpec(r.index, S, self.path, r.first, r.stop, self.n_ctx, slots, self.n_batch,
                             self.opts.threads or 0, replica=k // S, predictor=self.predictor,  # threads 0: the node's cores
                             pool=not self.opts.inprocess, pin=self.opts.pin)
            strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=k)
            self.actors.append(actor.options(num_cpus=1, max_concurrency=4, scheduling_strategy=strategy, max_restarts=0).remote(spec))
        endpoints = self._get([a.endpoint.remote() for a in self.actors], "starting")
        host = str(ray.util.get_node_ip_address())
        self.results = self.ctx.socket(zmq.PULL)
        self.beats = self.ctx.socket(zmq.PULL)
        res_at = f"tcp://{host}:{self.results.bind_to_random_port(f'tcp://{host}')}"
        hb_at = f"tcp://{host}:{self.beats.bind_to_random_port(f'tcp://{host}')}"
        self.pushes = []
        for rep in range(R):
            push = self.ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(endpoints[rep * S])
            self.pushes.append(push)
        onward = [endpoints[k + 1] if (k + 1) % S else res_at for k in range(S * R)]  # each replica's last stage answers here
        self._get([a.connect.remote(nxt, hb_at) for a, nxt in zip(self.actors, onward)], "connecting")
        self.nodes = [e.split("//", 1)[1].rsplit(":", 1)[0] for e in endpoints]
        self.node_ids = self._get([a.node_id.remote() for a in self.actors], "starting")  # Ray's node ids, for tools and tests
        self.held = sum(self._get([a.weight_bytes.remote() for a in self.actors], "starting"))
        self.serving = [a.serve.remote() for a in self.actors]
        self.last_beat = [time.monotonic()] * len(self.actors)
        self.sent = [0] * R
        self.broken = None
        log.info("pipeline: %s", "; ".join(self._placement_lines()))

    def _get(self, refs: list[Any], what: str, timeout: float = STAGE_START_S) -> list[Any]:
        """ray.get of the stages' answers (placed already: the timeout is for loading, not for waiting on
        nodes); a stage that fails or does not answer is a WorkerDiedError naming what it was doing."""
        try:
            return list(self.ray.get(refs, timeout=timeout))
        except self.ray.exceptions.GetTimeoutError:
            raise WorkerDiedError(f"pipeline stages did not answer within {timeout:.0f} s while {what}") from None
        except self.ray.exceptions.RayError as e:
            raise WorkerDiedError(f"a pipeline stage failed while {what}: {_cause(e)}") from None

    def _name(self, k: int) -> str:
        """Actor k's name: its stage, and its replica when there are several."""
        S = len(self.ranges)
        return f"replica {k // S} stage {k % S}" if self.opts.replicas > 1 else f"stage {k % S}"

    def _placement_lines(self) -> list[str]:
        S = len(self.ranges)
        return [f"{self._name(k)}: layers {self.ranges[k % S].first}..{self.ranges[k % S].stop - 1} "
                f"({self.ranges[k % S].weight_bytes / 2**20:.0f} MiB) on {node}" for k, node in enumerate(self.nodes)]

    # -- a step ------------------------------------------------------------------------------------

    def execute(self, batch: Batch) -> np.ndarray:
        if self.broken is not None:
            raise WorkerDiedError(f"the pipeline is down ({self.broken}); it restarts before the next request")
        ids, pos, slots = batch.arrays()
        T, S, R = len(ids), len(self.ranges), self.opts.replicas
        self.step += 1
        # rows to their slot's replica, cut into micro-batches there; Want.ALL (perplexity, scoring) goes
        # whole: the head's unrefined entries of a row depend on how many rows share its matmul
        # (several-token tiles), and a pass should give what one process gives
        plan: list[tuple[int, np.ndarray]] = []  # (replica, rows) per micro-batch
        for rep in range(R):
            rows = np.flatnonzero(slots % R == rep)
            cut = len(rows) > 1 and S > 1 and batch.want is not Want.ALL
            n_parts = min(S, len(rows))
            if self.predictor and len(rows) > SPARSE_ROWS_T:
                # a sparse FFN computes up to SPARSE_ROWS_T tokens by rows, more by a masked dense pass whose
                # numbers depend on the pass's tokens: such a batch goes whole, as one process computes it
                n_parts = 1
            plan += [(rep, part) for part in (np.array_split(rows, n_parts) if cut and n_parts > 1 else [rows]) if len(part)]
        for i, (rep, part) in enumerate(plan):
            want = batch.want if batch.want is not Want.LAST or part[-1] == T - 1 else Want.CACHE
            msg = StageMsg(self.step, i, len(plan), want.value, "ids", pos[part], slots[part] // R, ids[part])
            self.pushes[rep].send_multipart(msg.frames(), copy=False)
            self.sent[rep] += 1
        parts = [part for _, part in plan]
        outs: list[np.ndarray] = [np.zeros(0, dtype=np.float32)] * len(parts)
        errors: list[StageMsg] = []
        for _ in parts:
            m = self._receive()
            if m.kind == "error":
                errors.append(m)
            else:
                outs[m.mb] = m.payload
        if any(e.fatal for e in errors):  # a stage's pool broke: every stage restarts (their KV caches with them)
            self._lost(next(e.error for e in errors if e.fatal))
        if errors:  # a stage refused its input (the pipeline itself is fine)
            raise InvalidArgumentError(errors[0].error)
        if batch.want is Want.CACHE:
            return outs[0][:0]
        if batch.want is Want.LAST:
            return outs[next(i for i, p in enumerate(parts) if p[-1] == T - 1)]
        out = np.empty((T, outs[0].shape[1]), dtype=np.float32)
        for part, o in zip(parts, outs):
            out[part] = o
        return out

    def _receive(self) -> StageMsg:
        """The next answer of this step from the last stage, watching the stages meanwhile."""
        assert self.results is not None
        t0 = last_check = time.monotonic()
        while True:
            if self.results.poll(POLL_MS):
                try:
                    m = decode(self.results.recv_multipart())
                except ProtocolError as e:
                    self._lost(f"the last stage sent a bad message: {e}")
                if m.step == self.step:
                    return m
                continue  # a late answer of a step that failed
            now = time.monotonic()
            if now - last_check >= HEALTH_EVERY_S:
                last_check = now
                self._watch()
            if now - t0 > STEP_TIMEOUT_S:
                self._lost(f"no answer in {STEP_TIMEOUT_S:.0f} s")

    def _watch(self) -> None:
        """Raise WorkerDiedError when a stage's serving call ended or it stopped beating."""
        assert self.beats is not None
        while self.beats.poll(0):
            try:
                k = heartbeat_stage(self.beats.recv())
            except ProtocolError:
                continue
            if 0 <= k < len(self.last_beat):
                self.last_beat[k] = time.monotonic()
        done, _ = self.ray.wait(self.serving, num_returns=1, timeout=0)
        if done:
            k = self.serving.index(done[0])
            try:
                self.ray.get(done[0], timeout=1)
                cause = "it stopped serving"
            except Exception as e:  # noqa: BLE001 - any end of a stage's call is its loss; the cause is reported
                cause = _cause(e)
            r = self.ranges[k % len(self.ranges)]
            self._lost(f"pipeline {self._name(k)} (layers {r.first}..{r.stop - 1}, node {self.nodes[k]}) is lost: {cause}")
        now = time.monotonic()
        for k, t in enumerate(self.last_beat):
            if now - t > STAGE_SILENT_S:
                self._lost(f"pipeline {self._name(k)} (node {self.nodes[k]}) has been silent for {now - t:.1f} s")

    def _lost(self, why: str) -> NoReturn:
        self.broken = why
        log.error("%s", why)
        raise WorkerDiedError(why)

    # -- the Executor interface --------------------------------------------------------------------

    def check_health(self) -> None:
        if self.broken is not None:
            raise WorkerDiedError(self.broken)
        self._watch()

    def restart(self) -> None:
        """Stop what is left of the stages and place them again (waiting for nodes up to place_timeout_s)."""
        self._stop_stages()
        self._start()

    def describe(self) -> Description:
        R = self.opts.replicas
        kind = f"a pipeline of {len(self.ranges)} stages on Ray" + (f", {R} replicas" if R > 1 else "")
        return Description(kind=kind, placement=tuple(f"placement  {x}" for x in self._placement_lines()),
                           figures=("pipeline: micro-batches sent since the stats were reset, per replica: " + ", ".join(map(str, self.sent)),),
                           numbers={"micro_batches": [float(n) for n in self.sent]}, steps_match_decode=True,
                           computed_share=self._share() if self.predictor else None)

    def _share(self) -> float | None:
        """Share of FFN neurons computed per token since the last reset, over every layer (dense
        layers: all); None where the stages' pools count in their ranks (not gathered)."""
        per_layer: dict[int, list[float]] = {}
        for k, (active, sparse, tokens) in enumerate(self._get([a.sparse_counts.remote() for a in self.actors], "counting", CALL_S)):
            first = self.ranges[k % len(self.ranges)].first
            for i, (act, sp) in enumerate(zip(active, sparse)):
                if tokens:
                    per_layer.setdefault(first + i, []).append(act / (tokens * self.cfg.n_ff) if sp else 1.0)
        return float(np.mean([np.mean(v) for v in per_layer.values()])) if per_layer else None

    def reset_stats(self) -> None:
        self.sent = [0] * self.opts.replicas
        if self.predictor and self.actors:
            self._get([a.reset_counts.remote() for a in self.actors], "resetting the counters", CALL_S)

    def set_sparse(self, *, dense: bool | None = None, oracle: bool | None = None) -> None:
        """Every stage's sparse FFNs: every neuron (dense=True), the true active set (oracle=True), or the file's rule."""
        if self.predictor and self.actors:
            self._get([a.set_sparse.remote(dense, oracle) for a in self.actors], "switching the sparse rule", CALL_S)

    def save_kv(self, slot: int, n: int, path: str, offset: int) -> None:
        no_kv("a Ray pipeline")

    def load_kv(self, slot: int, n: int, path: str, offset: int) -> None:
        no_kv("a Ray pipeline")

    @property
    def weight_bytes(self) -> int:
        """Packed weights and KV caches of every stage (on the stages' nodes; none in this process)."""
        return self.held

    def _stop_stages(self) -> None:
        for a in self.actors:
            try:
                self.ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - an actor already gone is what we wanted
                pass
        self.actors, self.serving = [], []
        if self.pg is not None:
            try:
                importlib.import_module("ray.util.placement_group").remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001 - a group whose nodes are gone may refuse; Ray reclaims it
                log.debug("removing the placement group failed", exc_info=True)
            self.pg = None
        for s in (self.results, self.beats, *self.pushes):
            if s is not None:
                s.close(linger=0)
        self.results = self.beats = None
        self.pushes = []

    def close(self) -> None:
        self._stop_stages()
        self.ctx.term()
        if self._own_ray and self.ray.is_initialized():
            self.ray.shutdown()
            self._own_ray = False


def _cause(e: BaseException) -> str:
    """A Ray error's gist: its type and its last line (a remote exception's own message), shortened."""
    text = [line for line in str(e).strip().splitlines() if line.strip()]
    return f"{type(e).__name__}: {text[-1].strip() if text else ''}"[:300]


def pipeline_refusal(gpu: bool) -> str | None:
    """Why a pipeline cannot run these options, or None."""
    if gpu:
        return "a Ray pipeline runs on the nodes' CPUs: leave out -ngl/--vram-budget"
    return None

