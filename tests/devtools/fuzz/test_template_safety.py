"""Template safety end to end (issue 8): a GGUF whose chat template attacks the renderer.

Runs in: the pytest process. The templates (CVE-2024-34359-style reaches for Python internals,
billion-step loops, gigabyte strings, exponential recursion) are put into a synthetic model's
``tokenizer.chat_template``; the model is loaded the way users load it (the metadata path for
every template, the LLM API with the in-process executor for a few), and chatting must fail with
a one-line ChatTemplateError within about a second, having run nothing.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from gguf import GGUFValueType as VT

from powerinfer.api import LLM
from powerinfer.chat import ChatTemplate
from powerinfer.errors import ChatTemplateError
from powerinfer.devtools.fuzz.bases import Base, make_bases
from powerinfer.devtools.fuzz.gguf_layout import KV, enc_string, rebuild
from powerinfer.devtools.fuzz.hostile_values import HOSTILE_TEMPLATES
from powerinfer.gguf_file import GGUFFile
from powerinfer.tokenizer import GGUFTokenizer

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Base:
    return make_bases(tmp_path_factory.mktemp("template-bases"))["synthetic-llama"]


def _model_with_template(base: Base, path: Path, template: str) -> Path:
    kvs = [kv for kv in base.layout.kvs if kv.key != b"tokenizer.chat_template"]
    path.write_bytes(rebuild(base.head, base.layout, [*kvs, KV(b"tokenizer.chat_template", VT.STRING, enc_string(template))]))
    return path


@pytest.mark.parametrize("index", range(len(HOSTILE_TEMPLATES)))
def test_hostile_template_in_a_gguf_fails_cleanly(base: Base, tmp_path: Path, index: int) -> None:
    marker = tmp_path / "pwned"
    template = HOSTILE_TEMPLATES[index].replace("'id'", f"'touch {marker}'")
    f = GGUFFile(_model_with_template(base, tmp_path / "m.gguf", template))
    assert f.metadata["tokenizer.chat_template"] == template
    tok = GGUFTokenizer.from_metadata(f.metadata)
    t0 = time.perf_counter()
    with pytest.raises(ChatTemplateError) as e:
        ChatTemplate.for_model(f.metadata, tok).render(CHAT)
    assert time.perf_counter() - t0 < 2.0
    assert str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 600
    assert not marker.exists()


@pytest.mark.parametrize("template, match", [
    ("{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}", "unsafe"),
    ("{{ self.__init__.__globals__ }}", "unsafe"),
    ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", "ran for more than 1 s"),
    ("{{ 'x' * 1000000000 }}", "beyond its budget"),
    ("{% set s = 'x' * 1000000 %}{{ s.center(1000000000) }}", "larger than 100000"),
])
def test_llm_chat_with_hostile_template(base: Base, tmp_path: Path, template: str, match: str) -> None:
    """Through the public API: the model loads (the template compiles), chat refuses within ~1 s."""
    marker = tmp_path / "pwned"
    path = _model_with_template(base, tmp_path / "m.gguf", template.replace("MARKER", str(marker)))
    with LLM(path, executor="inprocess", n_ctx=64) as llm:
        assert llm.complete("ab", max_tokens=2, temperature=0)[0] is not None  # plain completion still works
        t0 = time.perf_counter()
        with pytest.raises(ChatTemplateError, match=match):
            list(llm.chat(CHAT, max_tokens=2))
        assert time.perf_counter() - t0 < 2.0
    assert not marker.exists()


def test_llm_with_a_template_that_does_not_compile(base: Base, tmp_path: Path) -> None:
    path = _model_with_template(base, tmp_path / "m.gguf", "{{ " + "(" * 100000 + " }}")
    with LLM(path, executor="inprocess", n_ctx=64) as llm:  # loads: plain completion still works
        text, _ = llm.complete([1, 2, 3], max_tokens=2, temperature=0)
        assert isinstance(text, str)
        with pytest.raises(ChatTemplateError, match="cannot compile the chat template"):
            list(llm.chat(CHAT, max_tokens=2))
