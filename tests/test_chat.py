"""Chat templates: the file's template, the built-in fallbacks, and the sandbox around untrusted templates.

Runs in: the pytest process. No model files needed: tokenizers come from small synthetic vocabularies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from powerinfer.chat import CHATML_TEMPLATE, GEMMA_TEMPLATE, ChatMessage, ChatTemplate
from powerinfer.errors import ChatTemplateError
from powerinfer.tokenizer import GGUFTokenizer
from tests.test_tokenizer import MERGES, bpe_meta, spm_meta

# tokenizer.chat_template of SmolLM2-135M-Instruct, verbatim.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SMOLLM2_DEFAULT_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def smollm_like_meta(**extra: Any) -> dict[str, Any]:
    meta = bpe_meta(MERGES, control=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], **{"tokenizer.ggml.pre": "smollm"})
    n = len(meta["tokenizer.ggml.tokens"])
    meta.update({"general.architecture": "llama", "tokenizer.ggml.bos_token_id": n - 2, "tokenizer.ggml.eos_token_id": n - 1,
                 "tokenizer.ggml.add_bos_token": False})
    meta.update(extra)
    return meta


def gemma_like_meta() -> dict[str, Any]:
    meta = spm_meta({"a": -1, "\u2581": -2}, control=["<start_of_turn>", "<end_of_turn>"], user_defined=["\n"])
    meta["general.architecture"] = "gemma3"
    return meta


def test_smollm2_template_renders_chatml() -> None:
    tmpl = ChatTemplate(SMOLLM2_TEMPLATE, "<|im_start|>", "<|im_end|>")
    assert tmpl.render([{"role": "user", "content": "Hi"}]) == (
        SMOLLM2_DEFAULT_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    chat = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi"), ChatMessage("assistant", "Hello!")]
    assert tmpl.render(chat, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
    )


def test_for_model_uses_the_files_template() -> None:
    meta = smollm_like_meta(**{"tokenizer.chat_template": SMOLLM2_TEMPLATE})
    tok = GGUFTokenizer.from_metadata(meta)
    tmpl = ChatTemplate.for_model(meta, tok)
    assert (tmpl.bos_token, tmpl.eos_token, tmpl.strip_bos) == ("<|im_start|>", "<|im_end|>", False)
    text = tmpl.render([{"role": "user", "content": "hello"}])
    assert text.startswith(SMOLLM2_DEFAULT_SYSTEM)  # the BOS-looking <|im_start|> is kept: this model adds no BOS
    start, end = tok.encode("<|im_start|><|im_end|>", special=True)
    assert tok.encode(text, special=True).count(start) == 3 and end in tok.eog_ids


def test_gemma_fallback_folds_system_into_first_user_turn() -> None:
    meta = gemma_like_meta()
    tok = GGUFTokenizer.from_metadata(meta)
    tmpl = ChatTemplate.for_model(meta, tok)
    assert tmpl.source == GEMMA_TEMPLATE and tmpl.strip_bos  # gemma adds BOS itself: never twice
    chat = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": " Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    assert tmpl.render(chat) == (
        "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )
    with_bos = ChatTemplate(GEMMA_TEMPLATE, "<s>").render([{"role": "user", "content": "a"}], add_generation_prompt=False)
    assert with_bos == "<s><start_of_turn>user\na<end_of_turn>\n"
    ids = tok.encode(tmpl.render([{"role": "user", "content": "a"}]), special=True)
    sot, eot, nl = tok.encode("<start_of_turn><end_of_turn>\n", add_bos=False, special=True)
    assert ids[:2] == [tok.bos_id, sot] and ids.count(sot) == 2 and ids.count(eot) == 1 and ids[-1] == nl


def test_chatml_fallback_for_other_architectures() -> None:
    meta = smollm_like_meta()
    tmpl = ChatTemplate.for_model(meta, GGUFTokenizer.from_metadata(meta))
    assert tmpl.source == CHATML_TEMPLATE
    assert tmpl.render([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__ }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ joiner.__init__.__globals__ }}",
    "{{ messages.pop() }}",
    "{{ messages[0].update({'role': 'x'}) }}",
    "{{ 'x' * 1000000000 }}",
    "{{ 7 ** 100000000 }}",
    "{% for i in range(1000000000) %}{% endfor %}",
])
def test_unsafe_templates_raise(source: str) -> None:
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])


def test_template_cannot_run_commands(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    source = "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}"
    with pytest.raises(ChatTemplateError, match="unsafe"):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])
    assert not marker.exists()


def test_syntax_error_is_reported_at_construction() -> None:
    with pytest.raises(ChatTemplateError, match="syntax error on line 2"):
        ChatTemplate("{% for m in messages %}\n{{ m.content }")
    with pytest.raises(ChatTemplateError, match="empty"):
        ChatTemplate("  ")


def test_runtime_errors_become_one_line_chat_template_errors() -> None:
    refuse = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Roles must\nalternate') }}{% endif %}ok"
    with pytest.raises(ChatTemplateError, match="refused the conversation: Roles must alternate$"):
        ChatTemplate(refuse).render([{"role": "assistant", "content": "x"}])
    for source in ("{{ nothing.attribute }}", "{{ 1 / 0 }}", "{{ messages | no_such_filter }}"):
        with pytest.raises(ChatTemplateError) as err:
            ChatTemplate(source).render([{"role": "user", "content": "x"}])
        assert "\n" not in str(err.value)
    # Undefined names stay falsy and empty, as in HF's renderer (templates test `tools` etc.).
    assert ChatTemplate("{% if tools %}T{% endif %}{{ nothing }}ok").render([{"role": "user", "content": "x"}]) == "ok"


@pytest.mark.parametrize("messages, match", [
    ([], "no messages"),
    ("hello", "must be a list"),
    ([{"role": "user"}], "'content' must be a string"),
    ([{"role": "", "content": "x"}], "'role' must be a non-empty string"),
    ([{"role": "user", "content": "x"}, 3], "message 1 is a int"),
])
def test_messages_are_validated(messages: Any, match: str) -> None:
    with pytest.raises(ChatTemplateError, match=match):
        ChatTemplate(CHATML_TEMPLATE).render(messages)


def test_template_helpers() -> None:
    tmpl = ChatTemplate(
        "{{ strftime_now('%Y') | length }} {{ messages | tojson }}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}[{{ m.content }}]{% endfor %}"
    )
    chat = [{"role": "user", "content": "<é>"}, {"role": "user", "content": "second"}]
    assert tmpl.render(chat) == '4 [{"role": "user", "content": "<é>"}, {"role": "user", "content": "second"}][<é>]'


# -- resource limits (issue 8): a hostile template fails within about a second -----------------

LLAMA3_STYLE = (
    "{{- bos_token }}{%- set ns = namespace(system='', n=0) %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set ns.system = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- endif %}"
    "{%- macro turn(role, text) -%}<|start_header_id|>{{ role }}<|end_header_id|>\n\n{{ text | trim }}<|eot_id|>{%- endmacro %}"
    "{{ turn('system', 'Today: ' ~ strftime_now('%d %b %Y')[:0] ~ ns.system) }}"
    "{%- for m in messages %}{%- set ns.n = ns.n + 1 %}{{ turn(m['role'], m['content']) }}"
    "{%- if loop.last and m['role'] == 'user' %}{{ loop.cycle('', '') }}{% endif %}{%- endfor %}"
    "{%- set tail %}{{ messages | map(attribute='role') | join(',') }}/{{ ns.n }}{% endset %}{{ tail | upper }}"
    "{%- filter lower %}{{ {'k': [1, 2.5, none, true]} | tojson }}{% endfilter %}{{ '%s-%05d' % ('x', 7) }}"
    "{{ '{}:{:>4}'.format('a', 'b') }}{{ 'a b c'.split() | reverse | list | length }}{{ 'abc'.replace('b', 'xyz') }}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
)


@pytest.mark.parametrize("source", [SMOLLM2_TEMPLATE, CHATML_TEMPLATE, GEMMA_TEMPLATE, LLAMA3_STYLE])
def test_limits_do_not_change_what_real_templates_render(source: str) -> None:
    """The hardened sandbox renders exactly what jinja2's plain immutable sandbox renders."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from powerinfer.chat import _raise_exception, _strftime_now, _tojson

    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    plain.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    plain.filters["tojson"] = _tojson
    chat = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "x" * 5000}]
    for gen in (True, False):
        want = plain.from_string(source).render(messages=chat, add_generation_prompt=gen, bos_token="<s>", eos_token="</s>")
        assert ChatTemplate(source, "<s>", "</s>").render(chat, add_generation_prompt=gen) == want


def test_long_conversations_still_render() -> None:
    """The character budget grows with the input: a 4 MB conversation is not a hostile template."""
    chat = [{"role": "user", "content": "word " * 400_000}, {"role": "assistant", "content": "ok " * 200_000}]
    text = ChatTemplate(SMOLLM2_TEMPLATE).render(chat)
    assert len(text) > 2_600_000 and text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("source, match", [
    ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", "ran for more than 1 s"),
    ("{% set s = 'x' * 1000000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}", "ran for more than 1 s"),
    ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}", "ran for more than"),
    ("{% set s = 'x' * 1000000 %}{{ s.center(1000000000) }}", "larger than 100000"),
    ("{% set s = 'x' * 1000000 %}{{ s.replace('x', s) }}", "beyond its budget"),
    ("{% set a = 'x' * 1000000 %}{% set b = a ~ a %}{% set c = b ~ b %}{% set d = c ~ c %}{% set e = d ~ d %}"
     "{% set f = e ~ e %}{% set g = f ~ f %}{% set h = g ~ g %}{{ h ~ h }}", "beyond its budget"),
    ("{% set a = 'x' * 1000000 %}{% set b %}{{ a }}{{ a }}{% endset %}{% set c %}{{ b }}{{ b }}{% endset %}"
     "{% set d %}{{ c }}{{ c }}{% endset %}{% set e %}{{ d }}{{ d }}{% endset %}{% set f %}{{ e }}{{ e }}{% endset %}", "budget"),
    ("{% set s = 'x' * 1000000 %}{% for i in range(100000) %}{{ s }}{% endfor %}", "beyond its budget"),
    ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "budget"),
    ("{{ '{:>1000000000}'.format(1) }}", "beyond its budget"),
    ("{{ '%1000000000d' % 1 }}", "beyond its budget"),
    ("{{ (2 ** 1024) ** 1024 }}", "power"),
    ("{{ lipsum(100000, min=100000, max=100000) }}", "'lipsum' is undefined"),
    ("{{ (1).to_bytes(1000000000, 'big') }}", "larger than 100000"),
])
def test_resource_exhaustion_fails_fast(source: str, match: str) -> None:
    import time

    t0 = time.perf_counter()
    with pytest.raises(ChatTemplateError, match=match) as e:
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])
    assert time.perf_counter() - t0 < 2.0 and "\n" not in str(e.value)


def test_template_size_is_limited() -> None:
    with pytest.raises(ChatTemplateError, match="at most"):
        ChatTemplate("x" * (1 << 20))


def test_big_numbers_may_be_stored_just_not_used_as_sizes() -> None:
    source = "{% set ns = namespace(limit=1000000) %}{{ ns.limit }} {{ dict(a=2000000).a }} {{ 10 ** 12 }}"
    assert ChatTemplate(source).render([{"role": "user", "content": "x"}]) == "1000000 2000000 1000000000000"
