"""File fuzzing (issue 8, hostile files): malformed GGUF and ``.predictor`` files load or fail cleanly.

Runs in: the pytest process; the fuzz run's cases are loaded in a child worker process with a
per-case time limit and an address-space limit (powerinfer.devtools.fuzz.runner). The structured classes
(llama.cpp's handcrafted-file classes) and truncation are also checked in-process, with traced
memory, so a regression names the exact class. The long mode is
``python -m powerinfer.devtools.fuzz.files --cases 20000 --seed S``.
"""

from __future__ import annotations

import random
import struct
import tracemalloc
from pathlib import Path

import pytest
from gguf import GGUFValueType as VT

from powerinfer.errors import ModelFileError, PowerInferError
from powerinfer.devtools.fuzz.bases import Base, make_bases
from powerinfer.devtools.fuzz.cases import SMALL_MODELS, SMALL_PREDICTORS, Case, check_expectation, generate
from powerinfer.devtools.fuzz.files import FAILURE_OUTCOMES, format_summary, fuzz, main
from powerinfer.devtools.fuzz.gguf_layout import KV, TensorEntry, build, enc_array, enc_kv, enc_string, rebuild
from powerinfer.devtools.fuzz.runner import Runner
from powerinfer.devtools.fuzz.structured import STRUCTURED
from powerinfer.gguf_file import GGUFFile
from powerinfer.sparsity import read_predictor

_U64 = 2**64 - 1


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Base]:
    return make_bases(tmp_path_factory.mktemp("fuzz-bases"))


def _open_traced(path: Path) -> tuple[str | None, int]:
    """(error message or None, peak traced bytes) of opening ``path``."""
    tracemalloc.start()
    try:
        GGUFFile(path)
        message = None
    except ModelFileError as e:
        message = str(e)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return message, peak


def test_scan_and_rebuild_reproduce_every_small_base(bases: dict[str, Base]) -> None:
    for name in (*SMALL_MODELS, *SMALL_PREDICTORS):
        b = bases[name]
        assert rebuild(b.head, b.layout, magic=b.head[:4]) == b.head, name
        assert b.layout.tensors and b.layout.kvs and b.layout.fields


def test_cases_are_a_function_of_seed_and_index(bases: dict[str, Base]) -> None:
    first = [(c.cls, c.content) for c in generate(7, 40, bases)]
    again = [(c.cls, c.content) for c in generate(7, 40, bases)]
    one = next(generate(7, 1, bases, start=23))
    assert first == again and (one.cls, one.content) == first[23]
    assert len({cls for cls, _ in first}) > 15


@pytest.mark.parametrize("cls", sorted(STRUCTURED))
def test_structured_class_in_process(cls: str, bases: dict[str, Base], tmp_path: Path) -> None:
    """Each llama.cpp-style class, on both synthetic models: the expected outcome, a one-line message,
    and parse memory proportional to the file (never sized by a count read from it)."""
    for name in SMALL_MODELS:
        for seed in range(4):
            data, expect = STRUCTURED[cls](random.Random(seed), bases[name])
            path = tmp_path / f"{name}-{seed}.gguf"
            path.write_bytes(data)
            message, peak = _open_traced(path)
            problem = check_expectation(Case(0, seed, cls, name, "model", data, expect=expect), message is None, message or "")
            assert problem is None, (name, seed, problem)
            assert message is None or ("\n" not in message and len(message) < 2000), message
            assert peak <= 32 * len(data) + (1 << 20), (name, seed, peak, len(data))


def test_truncated_at_every_header_boundary(bases: dict[str, Base], tmp_path: Path) -> None:
    checked = 0
    for name in ("synthetic-llama", "predictor"):
        b = bases[name]
        cuts = sorted({p for p in (*b.layout.fields, *b.layout.elements) if p < b.layout.data_start} | {0, 3, 23})
        for cut in cuts:
            path = tmp_path / "cut.bin"
            path.write_bytes(b.head[:cut])
            with pytest.raises(ModelFileError) as e:
                GGUFFile(path) if name == "synthetic-llama" else read_predictor(path)
            assert "\n" not in str(e.value)
            checked += 1
    assert checked > 500


@pytest.mark.parametrize("what", ["n_tensors", "n_kv", "key_len", "string_len", "u8_array", "string_array",
                                  "nested_array", "n_dims", "dims_product"])
def test_huge_counts_allocate_nothing(what: str, tmp_path: Path) -> None:
    """A count or length of 2**60+ is refused before anything is allocated from it."""
    kvs = [KV(b"general.architecture", VT.STRING, enc_string("llama"))]
    tensors = [TensorEntry(b"t", [32], 0, 0)]
    data = bytes(128)
    header_counts = {}
    if what == "n_tensors":
        header_counts = {"n_tensors": _U64}
    elif what == "n_kv":
        header_counts = {"n_kv": 2**62}
    elif what == "key_len":
        kvs.append(KV(b"x", VT.STRING, b""))
        raw = build(kvs, tensors, data)
        raw = raw.replace(enc_kv(b"x", VT.STRING, b""), struct.pack("<Q", _U64) + b"x" + struct.pack("<I", VT.UINT8))
    elif what == "string_len":
        kvs.append(KV(b"s", VT.STRING, enc_string(b"abc", length=2**63)))
    elif what == "u8_array":
        kvs.append(KV(b"a", VT.ARRAY, struct.pack("<IQ", VT.UINT8, 2**62)))
    elif what == "string_array":
        kvs.append(KV(b"a", VT.ARRAY, enc_array(VT.STRING, [enc_string("x")], count=2**61)))
    elif what == "nested_array":
        kvs.append(KV(b"a", VT.ARRAY, struct.pack("<IQ", VT.ARRAY, 2**60) + struct.pack("<IQ", VT.UINT8, 2**60)))
    elif what == "n_dims":
        tensors = [TensorEntry(b"t", [32] * 3, 0, 0)]
    elif what == "dims_product":
        tensors = [TensorEntry(b"t", [2**32, 2**32, 2**20], 0, 0)]
    if what not in ("key_len",):
        raw = build(kvs, tensors, data, **header_counts)  # type: ignore[arg-type]
    if what == "n_dims":
        raw = raw.replace(struct.pack("<I", 3) + struct.pack("<Q", 32) * 3, struct.pack("<I", 2**32 - 1) + struct.pack("<Q", 32) * 3)
    path = tmp_path / "huge.gguf"
    path.write_bytes(raw)
    message, peak = _open_traced(path)
    assert message is not None and "\n" not in message, message
    assert peak < 64 << 10, (what, peak)


@pytest.mark.slow
def test_harness_notices_crashes_hangs_memory_and_bad_errors(tmp_path: Path) -> None:
    """The fuzz harness itself must be able to fail: a canary loader does each bad thing once."""
    runner = Runner(tmp_path, timeout=3.0, memory_headroom=1 << 30, loader="tests.devtools.fuzz.canary:load")
    expected = {b"ok": "loaded", b"clean": "clean_error", b"crash": "crash", b"typeerror": "uncaught",
                b"hang": "hang", b"alloc": "memory", b"badmsg": "bad_message"}
    got = {}
    try:
        for i, content in enumerate([*expected, b"ok"]):
            r = runner.run(Case(0, i, "canary", "canary", "model", content))
            got[content] = r.outcome
            assert r.failed == (r.outcome in FAILURE_OUTCOMES)
    finally:
        runner.stop()
    assert got == expected  # and the last "ok" ran on a fresh worker after the failures


def test_quick_fuzz_run(tmp_path: Path, smollm2_path: Path, gemma3_path: Path) -> None:
    """A few hundred cases over every class and base, the real models included: no crash, hang,
    uncaught exception, memory blow-up or unprintable message (the long mode runs thousands)."""
    n = 300
    summary, bases = fuzz(20240508, n, tmp_path, {"smollm2": smollm2_path, "gemma3-270m": gemma3_path},
                          real_share=0.1, timeout=30.0)
    text = format_summary(summary, 20240508, bases)
    assert not summary.failures, text
    assert summary.cases == n and "crashes: 0   hangs: 0   uncaught exceptions: 0" in text
    assert set(STRUCTURED) <= set(summary.per_class), text
    assert {f"mutate.{b}" for b in bases} <= set(summary.per_class), text
    assert summary.outcomes["loaded"] > 10 and summary.outcomes["clean_error"] > 100, text
    assert sum(summary.ops.values()) > 100 and summary.slowest is not None


def test_command_line_prints_the_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--cases", "25", "--seed", "3", "--no-real"]) == 0
    out = capsys.readouterr().out
    assert "25 cases, seed 3" in out and "crashes: 0   hangs: 0" in out and "mutations tried:" in out
    assert "slowest case: 3:" in out


def test_loaded_cases_really_load(bases: dict[str, Base], tmp_path: Path) -> None:
    """The random-kv class (llama.cpp's KV_SUCCESS) must keep every extra key readable."""
    data, _ = STRUCTURED["kv.random_kvs"](random.Random(5), bases["synthetic-llama"])
    path = tmp_path / "kvs.gguf"
    path.write_bytes(data)
    try:
        f = GGUFFile(path)
    except PowerInferError as e:  # pragma: no cover - the assertion below reports it
        pytest.fail(f"random extra keys made the file unreadable: {e}")
    assert any(k.startswith("my_key_") for k in f.metadata)
