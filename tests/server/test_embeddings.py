"""Embeddings: the pooled final hidden state against llama.cpp's on both real models (mean and
last pooling), and /v1/embeddings and /embedding through the server on SmolLM2 with the openai client.

Runs in: the pytest process (the engine core in process; the server in its own process).
"""

from __future__ import annotations

import base64
import threading
from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy as np
import openai
import pytest

from powerinfer.api import LLM
from powerinfer.coordinator.sequence import Sequence
from powerinfer.sampling import SamplingParams
from tests.server.conftest import RunningServer, serving

pytestmark = pytest.mark.real_model


def _embed(llm: LLM, text: str, pooling: str) -> np.ndarray:
    ids = llm.tokenize(text)
    seq = Sequence(llm.tokenizer, ids, 0, SamplingParams(temperature=0), pooling=pooling)
    llm.core.add(seq)
    for _ in range(len(ids)):  # one chunk a step: a prompt within n_batch takes one
        for out in llm.core.step():
            if out.embedding is not None:
                return out.embedding
    raise AssertionError("no embedding came out")


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_pooled_hidden_state_matches_llama_cpp(model: str, reference: dict[str, Any], request: pytest.FixtureRequest) -> None:
    """llama.cpp's embeddings (Llama(embedding=True, pooling_type=mean|last), normalized) of three
    texts: ours point the same way (cosine >= 0.995; llama.cpp rounds activations to 8 bits)."""
    ref = reference[model]["embeddings"]
    llm = LLM(request.getfixturevalue(f"{model}_path"), n_ctx=128, n_batch=4)  # chunked: the mean spans prefill chunks
    try:
        for pooling in ("mean", "last"):
            for text, want in zip(ref["texts"], ref[pooling]):
                v = _embed(llm, text, pooling)
                assert float(v @ np.asarray(want)) / float(np.linalg.norm(v)) >= 0.995, (model, pooling, text)
    finally:
        llm.close()


@pytest.fixture(scope="module")
def server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    yield from serving(smollm2_path, tmp_path_factory, "embeddings", "-c", "256", "--parallel", "2", "-t", "2", "--alias", "smollm2")


TEXTS = ["The cat sat on the mat.", "A cat was sitting on the rug.", "Quarterly revenue rose by four percent."]


def test_openai_client_embeddings_rank_a_paraphrase_first(server: RunningServer) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    r = client.embeddings.create(model="smollm2", input=TEXTS)  # the client asks for base64 and decodes it
    v = np.array([d.embedding for d in sorted(r.data, key=lambda d: d.index)])
    assert v.shape == (3, 576) and np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert v[0] @ v[1] > v[0] @ v[2] and v[0] @ v[1] > v[1] @ v[2]  # the paraphrase, above the unrelated sentence
    assert r.usage.prompt_tokens == r.usage.total_tokens > 3 * 5
    floats = client.embeddings.create(model="smollm2", input=TEXTS, encoding_format="float")
    assert np.array_equal(np.array([d.embedding for d in floats.data]), v)  # base64 carries the same float32 values
    one = client.embeddings.create(model="smollm2", input=TEXTS[2], encoding_format="float")
    assert len(one.data) == 1 and np.allclose(one.data[0].embedding, v[2], atol=1e-6)  # alone or batched: the same vector


def test_llama_server_embedding_route_and_token_input(server: RunningServer) -> None:
    body = httpx.post(server.url + "/embedding", json={"content": TEXTS[0]}, timeout=60).json()
    assert isinstance(body, list) and body[0]["index"] == 0 and len(body[0]["embedding"]) == 1
    vec = np.array(body[0]["embedding"][0])
    ids = httpx.post(server.url + "/tokenize", json={"content": TEXTS[0]}, timeout=60).json()["tokens"]
    by_ids = httpx.post(server.base_url + "/embeddings", json={"input": ids, "encoding_format": "base64"}, timeout=60).json()
    got = np.frombuffer(base64.b64decode(by_ids["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(got, vec, atol=1e-6)


def test_bad_embedding_requests(server: RunningServer) -> None:
    for body, param in (({}, "input"), ({"input": ""}, "input"), ({"input": ["ok", ""]}, "input[1]"), ({"input": [[]]}, "input[0]"),
                        ({"input": "x", "encoding_format": "int8"}, "encoding_format"), ({"input": "x", "dimensions": 64}, "dimensions"),
                        ({"input": "word " * 400}, "input"), ({"input": [10**7]}, "input")):
        r = httpx.post(server.base_url + "/embeddings", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = httpx.post(server.base_url + "/embeddings", json={"input": "x", "model": "other"}, timeout=60)
    assert r.status_code == 404


def test_embeddings_while_a_chat_streams(server: RunningServer) -> None:
    """An embedding is computed between the decode steps of a chat being served, and neither disturbs the other."""
    chat = {"model": "smollm2", "messages": [{"role": "user", "content": "Count to twenty."}], "max_tokens": 48, "temperature": 0}
    alone = httpx.post(server.base_url + "/chat/completions", json=chat, timeout=120).json()["choices"][0]["message"]["content"]
    got: list[str] = []
    t = threading.Thread(target=lambda: got.append(
        httpx.post(server.base_url + "/chat/completions", json=chat, timeout=120).json()["choices"][0]["message"]["content"]))
    t.start()
    vecs = [httpx.post(server.base_url + "/embeddings", json={"input": TEXTS}, timeout=120).json() for _ in range(3)]
    t.join(120)
    assert got == [alone]
    first = np.array([d["embedding"] for d in vecs[0]["data"]])
    assert all(np.allclose(np.array([d["embedding"] for d in v["data"]]), first, atol=1e-6) for v in vecs)


def test_slot_actions_are_off_without_a_folder(server: RunningServer) -> None:
    """(This module's server has no --slot-save-path.) Save and restore say how to turn them on."""
    r = httpx.post(server.url + "/slots/0?action=save", json={"filename": "a.bin"}, timeout=30)
    assert r.status_code == 501 and "--slot-save-path" in r.json()["error"]["message"]
