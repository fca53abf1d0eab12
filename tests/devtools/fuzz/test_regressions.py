"""Regression tests for the parser bugs the file fuzzer found (issue 8, hostile files).

Runs in: the pytest process (one case in a child process, where the old code never returned).
Each test builds a well-formed GGUF whose metadata holds what a hostile or corrupt file can hold,
and checks that the reader now refuses it with a clean one-line PowerInferError, quickly and
without allocating memory sized by a number read from the file.
"""

from __future__ import annotations

import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Callable

import pytest
from gguf import GGUFValueType as VT

from powerinfer.cli.inspect_cmd import inspect_text
from powerinfer.config import config_from_gguf
from powerinfer.errors import ModelFileError, PowerInferError, TokenizerError
from powerinfer.devtools.fuzz.bases import Base, make_bases
from powerinfer.devtools.fuzz.gguf_layout import KV, enc_array, enc_scalar, enc_string, enc_value, rebuild
from powerinfer.gguf_file import GGUFFile
from powerinfer.sparsity import read_gpuidx, read_powerinfer_predictor, read_predictor
from powerinfer.tokenizer import GGUFTokenizer


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Base]:
    return make_bases(tmp_path_factory.mktemp("regression-bases"))


def _variant(base: Base, path: Path, drop: tuple[str, ...] = (), **values: tuple[int, bytes]) -> Path:
    """``base`` with keys set (``values``: key with dots as '__' -> (type, encoded value)) or dropped."""
    kvs = {kv.key.decode(): kv for kv in base.layout.kvs if kv.key.decode() not in drop}
    for name, (vtype, value) in values.items():
        key = name.replace("__", ".")
        kvs[key] = KV(key.encode(), vtype, value)
    path.write_bytes(rebuild(base.head, base.layout, list(kvs.values()), magic=base.head[:4]))
    return path


def _one_line(e: pytest.ExceptionInfo[PowerInferError], *needles: str) -> None:
    msg = str(e.value)
    assert msg and "\n" not in msg and len(msg) < 600, msg
    for needle in needles:
        assert needle in msg, (needle, msg)


_U32 = (VT.UINT32, enc_scalar(VT.UINT32, 2**32 - 1))


# -- config ---------------------------------------------------------------------------------


def _refused_with_peak(load: Callable[[], object]) -> tuple[pytest.ExceptionInfo[ModelFileError], int]:
    """load() must raise ModelFileError: its exception info and the peak bytes Python allocated meanwhile."""
    tracemalloc.start()
    try:
        with pytest.raises(ModelFileError) as e:
            load()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return e, peak


def test_block_count_larger_than_the_file(bases: dict[str, Base], tmp_path: Path) -> None:
    # was: a per-layer tuple with one entry per claimed layer (billions for a uint32 max)
    f = GGUFFile(_variant(bases["synthetic-llama"], tmp_path / "b.gguf", llama__block_count=(VT.UINT32, enc_scalar(VT.UINT32, 3 * 10**7))))
    e, peak = _refused_with_peak(lambda: config_from_gguf(f))
    _one_line(e, "block_count is 30000000", "only")
    assert peak < 1 << 20


def test_more_heads_than_width(bases: dict[str, Base], tmp_path: Path) -> None:
    # was: head size d_model // n_heads == 0, then ZeroDivisionError in 1 / sqrt(head_dim)
    path = _variant(bases["synthetic-llama"], tmp_path / "h.gguf", drop=("llama.attention.key_length",),
                    llama__attention__head_count=(VT.UINT32, enc_scalar(VT.UINT32, 128)),
                    llama__attention__head_count_kv=(VT.UINT32, enc_scalar(VT.UINT32, 128)))
    with pytest.raises(ModelFileError) as e:
        config_from_gguf(GGUFFile(path))
    _one_line(e, "128 attention heads", "width 64")


@pytest.mark.parametrize("value, needle", [
    ((VT.FLOAT32, enc_scalar(VT.FLOAT32, 0.0)), "must be positive"),  # was: ZeroDivisionError
    ((VT.FLOAT32, enc_scalar(VT.FLOAT32, -2.0)), "must be positive"),
])
def test_rope_scaling_factor(bases: dict[str, Base], tmp_path: Path, value: tuple[int, bytes], needle: str) -> None:
    path = _variant(bases["synthetic-llama"], tmp_path / "r.gguf", llama__rope__scaling__type=(VT.STRING, enc_string("linear")),
                    llama__rope__scaling__factor=value)
    with pytest.raises(ModelFileError) as e:
        config_from_gguf(GGUFFile(path))
    _one_line(e, needle)


def test_rope_scaling_type_array(bases: dict[str, Base], tmp_path: Path) -> None:
    # was: ValueError "truth value of an array ... is ambiguous" from `array == "linear"`
    path = _variant(bases["synthetic-llama"], tmp_path / "r.gguf",
                    llama__rope__scaling__type=(VT.ARRAY, enc_value(VT.ARRAY, (VT.INT32, [1, 2]))))
    with pytest.raises(ModelFileError) as e:
        config_from_gguf(GGUFFile(path))
    _one_line(e, "rope.scaling.type has type ndarray")


def test_per_layer_head_counts_of_floats(bases: dict[str, Base], tmp_path: Path) -> None:
    # was: ValueError from int(nan)
    path = _variant(bases["synthetic-llama"], tmp_path / "p.gguf",
                    llama__attention__head_count=(VT.ARRAY, enc_value(VT.ARRAY, (VT.FLOAT32, [float("nan")] * 2))))
    with pytest.raises(ModelFileError) as e:
        config_from_gguf(GGUFFile(path))
    _one_line(e, "array of float32")


def test_vocabulary_that_is_a_number(bases: dict[str, Base], tmp_path: Path) -> None:
    # was: TypeError from len(5) in config_from_gguf, and in the tokenizer
    f = GGUFFile(_variant(bases["synthetic-llama"], tmp_path / "v.gguf", tokenizer__ggml__tokens=(VT.UINT32, enc_scalar(VT.UINT32, 5))))
    with pytest.raises(ModelFileError) as e:
        config_from_gguf(f)
    _one_line(e, "vocab_size")
    with pytest.raises(TokenizerError) as t:
        GGUFTokenizer.from_metadata(f.metadata)
    _one_line(t, "no tokenizer vocabulary (tokenizer.ggml.tokens: a int)")
    f = GGUFFile(_variant(bases["synthetic-llama"], tmp_path / "s.gguf", tokenizer__ggml__tokens=(VT.STRING, enc_string("abc"))))
    with pytest.raises(TokenizerError):
        GGUFTokenizer.from_metadata(f.metadata)


# -- tokenizer ------------------------------------------------------------------------------


@pytest.mark.parametrize("key, value, needle", [
    ("tokenizer__ggml__model", (VT.ARRAY, enc_value(VT.ARRAY, (VT.UINT8, [1, 2]))), "unsupported tokenizer model"),
    ("tokenizer__ggml__pre", (VT.ARRAY, enc_value(VT.ARRAY, (VT.UINT8, [1, 2]))), "tokenizer.ggml.pre has type ndarray"),
    ("tokenizer__ggml__add_bos_token", (VT.ARRAY, enc_value(VT.ARRAY, (VT.BOOL, [1, 0]))), "add_bos_token has type ndarray"),
    ("tokenizer__ggml__add_eos_token", (VT.STRING, enc_string("yes")), "add_eos_token has type str"),
    ("tokenizer__ggml__token_type", (VT.ARRAY, enc_value(VT.ARRAY, (VT.STRING, ["a", "b"]))), "token_type has type list"),
])
def test_tokenizer_values_of_the_wrong_type(bases: dict[str, Base], tmp_path: Path, key: str, value: tuple[int, bytes],
                                            needle: str) -> None:
    # were: ValueError (ambiguous truth value of an array) or ValueError from np.asarray(strings, int64)
    f = GGUFFile(_variant(bases["synthetic-llama"], tmp_path / "t.gguf", **{key: value}))
    with pytest.raises(TokenizerError) as e:
        GGUFTokenizer.from_metadata(f.metadata)
    _one_line(e, needle)


# -- GGUF reader and inspect ----------------------------------------------------------------


def test_boolean_alignment_is_refused(bases: dict[str, Base], tmp_path: Path) -> None:
    # was: `True` accepted as an alignment of 1 (bool is an int); llama.cpp wants a uint32
    path = _variant(bases["synthetic-llama"], tmp_path / "a.gguf", general__alignment=(VT.BOOL, enc_scalar(VT.BOOL, True)))
    with pytest.raises(ModelFileError) as e:
        GGUFFile(path)
    _one_line(e, "general.alignment True is not a power of two")


def test_array_alignment_gives_a_one_line_message(bases: dict[str, Base], tmp_path: Path) -> None:
    # was: the numpy repr of the array, spread over several lines, inside the error message
    arr = (VT.ARRAY, enc_value(VT.ARRAY, (VT.UINT64, [2**32 - 1, 3, 7, 2**40] * 8)))
    with pytest.raises(ModelFileError) as e:
        GGUFFile(_variant(bases["synthetic-llama"], tmp_path / "a.gguf", general__alignment=arr))
    _one_line(e, "general.alignment array([ 4294967295, 3, 7,", "is not a power of two")


def test_huge_names_are_cut_in_messages(bases: dict[str, Base], tmp_path: Path) -> None:
    # was: a 20 KB - 16 MB message quoting the whole (corrupt) key or tensor name
    b = bases["synthetic-llama"]
    long = "k" * 100_000
    kvs = [*b.layout.kvs, KV(long.encode(), VT.UINT8, b"\1"), KV(long.encode(), VT.UINT8, b"\1")]
    (tmp_path / "k.gguf").write_bytes(rebuild(b.head, b.layout, kvs))
    with pytest.raises(ModelFileError) as e:
        GGUFFile(tmp_path / "k.gguf")
    _one_line(e, "duplicate metadata key 'kkkk", "(100000 characters)")


def test_inspect_escapes_names_from_the_file(bases: dict[str, Base], tmp_path: Path) -> None:
    # was: UnicodeEncodeError on print (invalid UTF-8 in a name) and raw terminal escapes
    b = bases["synthetic-llama"]
    kvs = [*b.layout.kvs, KV(b"evil\x1b[2J\xff", VT.UINT8, b"\1")]
    tensors = list(b.layout.tensors)
    tensors[-1] = type(tensors[-1])(b"blk.\xff\x1b[31m", tensors[-1].dims, tensors[-1].ttype, tensors[-1].offset)
    (tmp_path / "i.gguf").write_bytes(rebuild(b.head, b.layout, kvs, tensors))
    text = inspect_text(str(tmp_path / "i.gguf"), tensors=True)
    text.encode("utf-8")  # what print() to a UTF-8 stdout does
    assert "\x1b" not in text and "'evil\\x1b[2J\\udcff'" in text and "'blk.\\udcff\\x1b[31m'" in text


# -- predictor and PowerInfer files ---------------------------------------------------------


def test_predictor_architecture_array(bases: dict[str, Base], tmp_path: Path) -> None:
    # were: ValueError (ambiguous truth value) in both readers
    arr = (VT.ARRAY, enc_value(VT.ARRAY, (VT.UINT8, [1, 2])))
    with pytest.raises(ModelFileError) as e:
        read_predictor(_variant(bases["predictor"], tmp_path / "p.predictor", general__architecture=arr))
    _one_line(e, "not a predictor file")
    with pytest.raises(ModelFileError) as e:
        read_gpuidx(_variant(bases["gpuidx"], tmp_path / "g.gpuidx", general__architecture=arr))
    _one_line(e, "not a PowerInfer GPU index")


def test_gate_predictor_with_absurd_n_ff_allocates_nothing(bases: dict[str, Base], tmp_path: Path) -> None:
    # was: np.zeros(n_ff) for each layer without predictor tensors before checking n_ff (16 GiB here)
    path = _variant(bases["predictor-gate"], tmp_path / "g.predictor", powerinfer__predictor__n_ff=_U32)
    e, peak = _refused_with_peak(lambda: read_predictor(path))
    _one_line(e, "act_freq", "expected [4294967295]")
    assert peak < 4 << 20


def test_fingerprint_must_be_hex(bases: dict[str, Base], tmp_path: Path) -> None:
    # was: the raw (invalid UTF-8) fingerprint copied into an error message that could not be printed
    path = _variant(bases["predictor"], tmp_path / "f.predictor", powerinfer__predictor__fingerprint=(VT.STRING, b"\2\0\0\0\0\0\0\0\xff\xfe"))
    with pytest.raises(ModelFileError) as e:
        read_predictor(path)
    _one_line(e, "not a sha256 hex digest")
    str(e.value).encode("utf-8")


def test_powerinfer_block_count_of_2_to_the_63(bases: dict[str, Base], tmp_path: Path) -> None:
    # was: set(range(2**63)), which never finishes; run in a child so the old code fails by timeout
    path = _variant(bases["pwri"], tmp_path / "m.powerinfer.gguf", llama__block_count=(VT.UINT64, enc_scalar(VT.UINT64, 2**63)))
    code = ("import sys\nfrom powerinfer.sparsity import read_powerinfer_predictor\nfrom powerinfer.errors import ModelFileError\n"
            "try:\n    read_powerinfer_predictor(sys.argv[1])\nexcept ModelFileError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "layer 2 has no predictor" in out.stdout, out
    with pytest.raises(ModelFileError):
        read_powerinfer_predictor(path)


def test_array_metadata_values_never_break_the_readers(bases: dict[str, Base], tmp_path: Path) -> None:
    """Every key the readers consult, set to an array: refused cleanly (or ignored), never ValueError."""
    from powerinfer.devtools.fuzz.hostile_values import read_keys

    arr = (VT.ARRAY, enc_array(VT.INT32, [enc_scalar(VT.INT32, v) for v in (1, 2, 3)]))
    for name in ("synthetic-llama", "predictor", "pwri", "gpuidx"):
        for key in read_keys(bases[name]):
            if key == "general.alignment":
                continue
            path = _variant(bases[name], tmp_path / "x.bin", **{key.replace(".", "__"): arr})
            for reader in (lambda: config_from_gguf(GGUFFile(path)), lambda: GGUFTokenizer.from_metadata(GGUFFile(path).metadata),
                           lambda: read_predictor(path), lambda: read_powerinfer_predictor(path), lambda: read_gpuidx(path)):
                try:
                    reader()
                except PowerInferError as e:
                    assert "\n" not in str(e)
