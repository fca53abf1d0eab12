"""The pipeline on a local Ray cluster (ray.cluster_utils.Cluster: a head and three nodes on this
machine): greedy tokens with 2 and 3 stages equal one process's on SmolLM2 and Gemma-3; a stage's
node killed mid-generation fails the request within 10 s, a request while no node can take the
stage fails with a clear error instead of waiting, and the next request after a node returns is
served.

Runs in: the test process (Ray's driver); each stage in a Ray actor process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from powerinfer.api import LLM
from powerinfer.coordinator.cluster.options import ClusterOptions
from powerinfer.fetch import resolve_model
from powerinfer.protocol import WorkerDiedError

ray = pytest.importorskip("ray", reason="Ray is the [ray] extra")
cluster_utils = pytest.importorskip("ray.cluster_utils")

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.real_model]

NODE = {"num_cpus": 1, "object_store_memory": 80 << 20}
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    c = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": 80 << 20})
    for _ in range(3):
        c.add_node(**NODE)
    c.wait_for_nodes()
    if ray.is_initialized():  # another module's local node
        ray.shutdown()
    ray.init(address=c.address, log_to_driver=False, configure_logging=False)
    yield c
    ray.shutdown()
    c.shutdown()


def _tokens(llm: LLM, n: int = 24) -> list[int]:
    return [c.token for c in llm.generate(PROMPT, n, temperature=0) if c.token >= 0]


@pytest.mark.parametrize("model", ["smollm2", "gemma3-270m"])
def test_greedy_tokens_with_2_and_3_stages_equal_one_process(cluster: Any, model: str) -> None:
    path = resolve_model(model)
    with LLM(path, executor="inprocess", n_ctx=256, n_threads=1) as one:
        want = _tokens(one)
    for stages in (2, 3):
        with LLM(path, n_ctx=256, n_slots=2, cluster=ClusterOptions(address=cluster.address, stages=stages, threads=1, pin=False)) as llm:
            d = llm.engine.executor.describe()
            assert len(d.placement) == stages and len({line.split(" on ")[0] for line in d.placement}) == stages
            assert _tokens(llm) == want, (model, stages)
            assert _tokens(llm, 8) == want[:8]  # again: the prompt found in the slot's cache of every stage


def _node_of(cluster: Any, node_id: str) -> Any:
    return next(n for n in cluster.list_all_nodes() if n.node_id == node_id)


def test_a_lost_node_fails_the_request_and_a_returned_one_serves_again(cluster: Any) -> None:
    opts = ClusterOptions(address=cluster.address, stages=3, threads=1, pin=False, place_timeout_s=5.0)
    with LLM(resolve_model("smollm2"), n_ctx=1024, cluster=opts) as llm:
        want = _tokens(llm, 8)
        ex = llm.engine.executor
        victim = _node_of(cluster, ex.node_ids[1])  # the middle stage's node
        started, failed = threading.Event(), {}

        def generate() -> None:
            ban = tuple((t, float("-inf")) for t in llm.tokenizer.eog_ids)  # a long reply: the end never sampled
            try:
                for _ in llm.generate(PROMPT, 900, temperature=0, logit_bias=ban):
                    started.set()
            except WorkerDiedError as e:
                failed["at"], failed["error"] = time.monotonic(), e

        t = threading.Thread(target=generate)
        t.start()
        assert started.wait(60)
        killed = time.monotonic()
        cluster.remove_node(victim, allow_graceful=False)
        t.join(30)
        assert not t.is_alive() and "error" in failed, "the request in flight did not fail"
        assert failed["at"] - killed < 10, f"the loss took {failed['at'] - killed:.1f} s to report"
        assert "stage 1" in str(failed["error"])
        # no node can take the third stage: the next request fails at once with the reason, it does not hang
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match="could not place 3 pipeline stages"):
            _tokens(llm, 4)
        assert time.monotonic() - t0 < opts.place_timeout_s + 10
        cluster.add_node(**NODE)
        cluster.wait_for_nodes()
        assert _tokens(llm, 8) == want


def test_replicas_serve_concurrent_requests_and_the_server_outlives_a_lost_node(cluster: Any, tmp_path: Any) -> None:
    """powerinfer-server with --replicas 2 (one stage each) and --parallel 2: two concurrent requests
    are answered, as one process answers them, by both replicas; a replica's node killed during a
    request fails that request with an error, /health says so until the replica is placed again on
    the node that joins, and the server serves again without a restart of its own."""
    import concurrent.futures

    import httpx
    import openai

    from tests.server.conftest import start_server

    path = resolve_model("smollm2")
    prompts = ["The capital of France is", "Water boils at"]
    with LLM(path, executor="inprocess", n_ctx=512, n_threads=1) as one:
        want = [one.complete(p, 16, temperature=0)[0] for p in prompts]
    server = start_server(path, tmp_path, "-c", "1024", "--parallel", "2", "-t", "1", "--ray-address", cluster.address,
                          "--replicas", "2", "--pipeline-stages", "1", "--log-level", "INFO", timeout=180)
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)

        def complete(p: str, n: int = 16) -> str:
            r = client.completions.create(model=path.stem, prompt=p, max_tokens=n, temperature=0)
            return r.choices[0].text

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            assert list(pool.map(complete, prompts)) == want
        log = server.log.read_text()
        assert "replica 0 stage 0" in log and "replica 1 stage 0" in log, log[-3000:]
        # a long request, and the replicas' nodes killed meanwhile (every node but the head: whichever served is gone)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(complete, prompts[0], 800)
            time.sleep(3)
            for n in [n for n in cluster.list_all_nodes() if not n.head]:
                cluster.remove_node(n, allow_graceful=False)
            t0 = time.monotonic()
            with pytest.raises(openai.APIError):
                fut.result(60)
            assert time.monotonic() - t0 < 10
        assert server.proc.poll() is None
        assert httpx.get(server.url + "/health", timeout=5).status_code == 503  # no node to place the replicas on
        for _ in range(2):
            cluster.add_node(**NODE)
        cluster.wait_for_nodes()
        deadline = time.monotonic() + 150
        while httpx.get(server.url + "/health", timeout=5).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert complete(prompts[1]) == want[1]
    finally:
        server.stop()


def test_sparse_stages_generate_what_the_sparse_native_executor_generates(cluster: Any, make_model: Any, tmp_path: Any) -> None:
    """A ReGLU model with a predictor file: the pipeline's stages (native pools, or the decoder in
    process) apply its rule to their layers and the tokens equal the in-process sparse executor's;
    in-process stages count the computed share."""
    from tests.coordinator.cluster.helpers import sparse_relu_model

    path, _, pred = sparse_relu_model(make_model, tmp_path, 4)
    prompt = [1, 5, 9, 13, 17, 21]
    with LLM(path, executor="inprocess", n_ctx=64, n_threads=1, predictor=pred) as one:
        want = [c.token for c in one.generate(prompt, 12, temperature=0) if c.token >= 0]
    for inprocess in (False, True):  # stages as native pools (their ranks count their own neurons), or the decoder in process
        opts = ClusterOptions(address=cluster.address, stages=2, threads=1, pin=False, inprocess=inprocess)
        with LLM(path, n_ctx=64, predictor=pred, cluster=opts) as llm:
            assert [c.token for c in llm.generate(prompt, 12, temperature=0) if c.token >= 0] == want, inprocess
            share = llm.engine.executor.describe().computed_share
            assert (share is not None and 0 < share < 0.5) if inprocess else share is None
