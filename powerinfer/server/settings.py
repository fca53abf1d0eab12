"""The server's frozen configuration, shared by the routes and the generation path.

Runs in: the server process.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    model_id: str  # the name /v1/models lists and requests must use (with several models: the default one's)
    parallel: int = 4  # KV-cache slots = sequences decoded together
    queue: int = 64  # sequences waiting beyond the slots before 429
    api_key: str | None = None
    max_body_bytes: int = 8 << 20
    n_predict: int = -1  # max_tokens of requests that set none (-1: until end of text or the context is full)
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call (empty: this machine's pages; "*": all)
    pooling: str = "mean"  # embeddings: "mean" or "last" of the final hidden states (server/embeddings.py)
    slot_save_path: str | None = None  # the folder of /slots save and restore (None: off)
    models: tuple[tuple[str, str, int], ...] = ()  # several models: (name, path, estimated bytes) each; empty: the one of -m
    models_memory: int = 0  # bytes the loaded models may take together (0: no limit)
    reasoning_format: str = "deepseek"  # "deepseek": <think>...</think> goes to reasoning_content; "none": left in content
