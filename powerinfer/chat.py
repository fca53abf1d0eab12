"""Chat templates: render a conversation into the prompt text the model was trained on.

Runs in: the coordinator process.

The template comes from the GGUF file (``tokenizer.chat_template``, Jinja2 as on the HF hub) and
is untrusted input: CVE-2024-34359 was code execution through exactly this field in
llama-cpp-python. It therefore runs in jinja2's immutable sandbox, where any unsafe attribute
access fails at once, with limits on the time and memory a render may take (see
:mod:`powerinfer.chat_sandbox`), and every failure (syntax, sandbox, undefined value, ``raise_exception``)
becomes a one-line ChatTemplateError. Files without a template get a built-in one chosen by
architecture: Gemma turns for gemma* (the format of llama.cpp's built-in "gemma" template), ChatML
for everything else. llama.cpp itself falls back to ChatML for every file without a template (and
llama-cpp-python to llama-2's format), which gives a Gemma model a format it was not trained on.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, NoReturn

from jinja2 import TemplateError, TemplateSyntaxError
from jinja2.ext import loopcontrols

from powerinfer.chat_sandbox import HardenedSandbox, activate, deactivate, render_budget
from powerinfer.errors import ChatTemplateError

if TYPE_CHECKING:
    from powerinfer.tokenizer import GGUFTokenizer

log = logging.getLogger(__name__)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# As llama.cpp's built-in "gemma" template: system messages are folded into the next user turn,
# the assistant's role is called "model", and contents are trimmed.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% set ns.system = ns.system + message['content'] | trim + '\\n\\n' %}"
    "{% else %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n'"
    " + ns.system + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% set ns.system = '' %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

_GEMMA_ARCHS = frozenset({"gemma", "gemma2", "gemma3", "gemma3n"})
# Real templates are a few KiB (the longest known, with tool-calling logic, ~20 KiB); a huge one
# only costs compile time and memory.
MAX_TEMPLATE_CHARS = 256 * 1024


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


def _one_line(text: object, limit: int = 300) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _raise_exception(message: object = "") -> NoReturn:
    """``raise_exception(msg)``, which HF templates call to refuse a conversation."""
    raise ChatTemplateError(f"the chat template refused the conversation: {_one_line(message)}")


def _strftime_now(fmt: str) -> str:
    """``strftime_now(fmt)``, which Llama 3.x templates use for today's date."""
    fmt = str(fmt)
    if len(fmt) > 256:  # each directive can expand ~10x; real formats are "%d %b %Y"
        raise ChatTemplateError(f"strftime_now format of {len(fmt)} characters is too long")
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """HF's tojson: plain JSON, without jinja's HTML escaping (prompts are not HTML)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _messages(messages: Sequence[ChatMessage | Mapping[str, str]]) -> list[dict[str, str]]:
    """Plain {role, content} dicts for the template, or a clear error naming the bad message."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError("messages must be a list of {'role': ..., 'content': ...} messages")
    out: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        if isinstance(message, ChatMessage):
            role, content = message.role, message.content
        elif isinstance(message, Mapping):
            role, content = message.get("role"), message.get("content")
        else:
            raise ChatTemplateError(f"message {i} is a {type(message).__name__}, not a ChatMessage or a mapping")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"message {i}: 'role' must be a non-empty string, got {role!r}")
        if not isinstance(content, str):
            raise ChatTemplateError(f"message {i}: 'content' must be a string, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    if not out:
        raise ChatTemplateError("there are no messages to render")
    return out


RESERVED_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "raise_exception", "strftime_now"})


class ChatTemplate:
    """A compiled chat template. strip_bos: drop a leading bos_token from the rendered text, for
    tokenizers that add BOS themselves (llama.cpp does the same, so BOS is never doubled).

    A render may take at most ``time_limit`` seconds and build at most ``base_chars +
    input_factor * (characters of its input)`` characters in total (see :mod:`powerinfer.chat_sandbox`);
    beyond that it fails with a ChatTemplateError. Real templates use a few times their input.
    """

    time_limit = 1.0
    base_chars = 16 << 20
    input_factor = 32

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", *, strip_bos: bool = False) -> None:
        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError("the chat template is empty")
        if len(source) > MAX_TEMPLATE_CHARS:
            raise ChatTemplateError(f"the chat template has {len(source)} characters; at most {MAX_TEMPLATE_CHARS} are accepted")
        self.source, self.bos_token, self.eos_token, self.strip_bos = source, bos_token, eos_token, strip_bos
        env = HardenedSandbox(trim_blocks=True, lstrip_blocks=True, autoescape=False, extensions=[loopcontrols])
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        env.add_filter("tojson", _tojson)
        try:
            self._template = env.compile_template(source)
        except TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template syntax error on line {e.lineno}: {_one_line(e.message)}") from e
        except Exception as e:  # the compiler can also fail outside TemplateSyntaxError (e.g. recursion)
            raise ChatTemplateError(f"cannot compile the chat template: {type(e).__name__}: {_one_line(e)}") from e

    @classmethod
    def for_model(cls, meta: Mapping[str, Any], tok: GGUFTokenizer, source: str | None = None) -> ChatTemplate:
        """The file's template (or source, given: a ``--chat-template-file``), else the built-in
        fallback for its architecture."""
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
        eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else ""
        if source is not None:
            return cls(source, bos, eos, strip_bos=tok.add_bos)
        source = meta.get("tokenizer.chat_template")
        if not isinstance(source, str) or not source.strip():
            arch = str(meta.get("general.architecture", ""))
            gemma = arch in _GEMMA_ARCHS
            log.info("the model file has no chat template; using the built-in %s one", "Gemma" if gemma else "ChatML")
            source = GEMMA_TEMPLATE if gemma else CHATML_TEMPLATE
        return cls(source, bos, eos, strip_bos=tok.add_bos)

    def render(self, messages: Sequence[ChatMessage | Mapping[str, str]], add_generation_prompt: bool = True,
               extra: Mapping[str, Any] | None = None) -> str:
        """The prompt text for messages; add_generation_prompt opens the assistant's turn. extra:
        more template variables (a request's ``chat_template_kwargs``, e.g. Qwen3's
        ``enable_thinking``); none may be one the renderer sets (RESERVED_VARIABLES)."""
        clash = sorted(RESERVED_VARIABLES.intersection(extra or ()))
        if clash:
            raise ChatTemplateError(f"template variable {clash[0]!r} is set by the renderer")
        variables: dict[str, Any] = {
            **(extra or {}),
            "messages": _messages(messages),
            "add_generation_prompt": bool(add_generation_prompt),
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        chars = len(self.source) + len(self.bos_token) + len(self.eos_token) + sum(len(str(v)) for v in (extra or {}).values())
        chars += sum(len(m["role"]) + len(m["content"]) for m in variables["messages"])
        token = activate(render_budget(self.time_limit, self.base_chars, chars, self.input_factor))
        try:
            text = self._template.render(**variables)
        except ChatTemplateError:
            raise
        except TemplateError as e:  # undefined values, sandbox violations, bad filters...
            raise ChatTemplateError(f"chat template error: {_one_line(e)}") from e
        except Exception as e:  # Python errors inside the template: 1/0, bad indexing, recursion
            raise ChatTemplateError(f"chat template error: {type(e).__name__}: {_one_line(e)}") from e
        finally:
            deactivate(token)
        if self.strip_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        return text

    def __repr__(self) -> str:
        return f"ChatTemplate({_one_line(self.source, 60)!r})"
