"""Tool calling: ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` in, ``tool_calls`` out (OpenAI's
shapes), for any chat template.

Runs in: the server process (HTTP side: parsing, rendering and reading replies; the grammar of
a required call is enforced by the sampler, powerinfer.constrained).

Rendering (the documented fallback, used for every model: neither SmolLM2's nor Gemma-3's template
knows tools). The tools are listed in the system message (appended to the conversation's own, or a
new first message) with one instruction: a call is a line ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` (the Hermes / Qwen convention many small models were tuned on). An assistant
message's ``tool_calls`` are rendered as such lines after its content, and ``tool`` messages as a
user turn of ``<tool_response>{"name": ..., "content": ...}</tool_response>`` lines (consecutive
ones merged), so templates that only know user and assistant turns still render the history.

Reading the reply: every complete ``<tool_call>...</tool_call>`` whose body is a JSON object with a
known ``name`` becomes a call (id ``call_<hex>``, ``arguments`` the JSON text of its arguments), the
rest of the text the content; ``finish_reason`` is then ``"tool_calls"``. With ``tool_choice``
``"required"`` or a named function, a Lark grammar makes the reply exactly one call (or, with
parallel calls allowed, one or more) whose arguments follow the function's JSON schema.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Mapping

from powerinfer import constrained
from powerinfer.server.api_errors import bad
from powerinfer.server.structured import compile_grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
# Calls one required reply may make: a small model, allowed "one or more", can repeat calls until
# max_tokens cuts the last one off; the grammar ends the reply after this many.
MAX_PARALLEL_CALLS = 8
TOOLS_PROMPT = (
    "You can call the following functions. Their parameters are JSON schemas.\n<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with one line per call, and nothing else on that line:\n"
    '<tool_call>{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}</tool_call>\n'
    "After the results come back in <tool_response> tags, answer the user."
)
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)


@dataclass(frozen=True)
class ToolSpec:
    functions: tuple[Mapping[str, Any], ...]  # {"name", "description", "parameters"}
    choice: str  # "auto" | "none" | "required" | "function" (then `name`)
    name: str | None
    parallel: bool

    @property
    def names(self) -> set[str]:
        return {f["name"] for f in self.functions}


def parse_tools(body: Mapping[str, Any]) -> ToolSpec | None:
    """tools, tool_choice and parallel_tool_calls of a chat request; None without tools (or with
    tool_choice "none": the model answers in text)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise bad("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise bad("'tools' must be a non-empty list", "tools", "invalid_type")
    if len(tools) > MAX_TOOLS:
        raise bad(f"at most {MAX_TOOLS} tools are allowed", "tools")
    fns = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", fn["name"]):
            raise bad(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': {{...}}}}}} with a name of "
                      "letters, digits, _ . - (at most 64)", f"tools[{i}]")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        where = f"tools[{i}].function.parameters"
        if not isinstance(params, dict):
            raise bad(f"{where} must be a JSON schema object", where, "invalid_type")
        if params.get("type", "object") != "object":
            raise bad(f"{where} must describe an object (the call's named arguments), not {params.get('type')!r}", where)
        if constrained.available():  # checked whatever tool_choice, not only when a call is forced
            compile_grammar("json_schema", _closed(params), where)
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise bad(f"tools[{i}].function.strict must be a boolean", f"tools[{i}].function.strict", "invalid_type")
        desc = fn.get("description", "")
        if not isinstance(desc, str):
            raise bad(f"tools[{i}].function.description must be a string", f"tools[{i}].function.description", "invalid_type")
        fns.append({"name": fn["name"], "description": desc, "parameters": params})
    if len({f["name"] for f in fns}) != len(fns):
        raise bad("tool names must be unique", "tools")
    name = None
    if choice is None or choice in ("auto", "none", "required"):
        kind = choice or "auto"
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        kind, name = "function", choice["function"].get("name")
        if not isinstance(name, str) or name not in {f["name"] for f in fns}:
            raise bad(f"'tool_choice' names {name!r}, which is not among the tools", "tool_choice")
    else:
        raise bad("'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}", "tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls", "invalid_type")
    return None if kind == "none" else ToolSpec(tuple(fns), kind, name, parallel)


def _call_line(name: str, arguments: Any) -> str:
    return OPEN + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + CLOSE


def render(messages: list[dict[str, Any]], spec: ToolSpec | None) -> list[dict[str, str]]:
    """Messages with tool calls and tool results (and the tools' description) as plain turns a
    chat template renders: see the module docstring. Input messages are parse_chat's (role,
    content, and tool_calls / tool_call_id / name where given)."""
    out: list[dict[str, str]] = []
    called: dict[str, str] = {}  # call id -> function name, from the assistant turns so far
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            lines = [m["content"]] if m["content"] else []
            lines += [_call_line(c["name"], c["arguments"]) for c in m["tool_calls"]]
            called.update((c["id"], c["name"]) for c in m["tool_calls"] if c.get("id"))
            out.append({"role": "assistant", "content": "\n".join(lines)})
        elif m["role"] == "tool":
            # OpenAI's tool messages name their call by id only: the model is shown the function's name
            call_id = m.get("tool_call_id") or ""
            name = m.get("name") or called.get(call_id) or call_id
            line = "<tool_response>" + json.dumps({"name": name, "content": m["content"]}, ensure_ascii=False) + "</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1]["content"].startswith("<tool_response>"):
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + line}
            else:
                out.append({"role": "user", "content": line})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if spec is not None:
        listing = "\n".join(json.dumps(f, ensure_ascii=False) for f in spec.functions)
        prompt = TOOLS_PROMPT.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def grammar(spec: ToolSpec) -> str | None:
    """The Lark grammar that makes the reply calls only (tool_choice required or a named function)."""
    if spec.choice not in ("required", "function"):
        return None
    fns = [f for f in spec.functions if spec.choice != "function" or f["name"] == spec.name]
    schemas = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": _closed(f["parameters"])},
                "required": ["name", "arguments"], "additionalProperties": False} for f in fns]
    body: dict[str, Any] = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    body = {**body, **constrained.COMPACT_JSON}
    repeat = f' ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if spec.parallel and spec.choice == "required" else ""
    return (f'start: call{repeat}\ncall: "{OPEN}" obj "{CLOSE}"\n'
            f"obj: %json {json.dumps(body, ensure_ascii=False)}\n")


def _closed(schema: Any) -> Any:
    """An arguments schema whose objects take only their declared properties unless they say
    otherwise: JSON Schema's default (any extra key) lets a small model ramble through a call
    (a quote in its code string ends the string, the rest becomes new keys) until max_tokens."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


def _key(name: str, args: Any) -> str:
    return name + "\0" + json.dumps(args, sort_keys=True, ensure_ascii=False)


class RepeatGuard:
    """A sequence's watch (coordinator/sequence.py): True once the reply repeats a call it already made. A
    small model allowed several calls writes the same one again and again until max_tokens (or
    the grammar's MAX_PARALLEL_CALLS); a repeat is never a new call, so the reply ends there."""

    def __init__(self) -> None:
        self.text = ""
        self.seen: set[str] = set()

    def __call__(self, piece: str) -> bool:
        self.text += piece
        if CLOSE not in self.text[-(len(piece) + len(CLOSE) - 1):]:  # no call was closed by this piece
            return False
        for m in list(_CALL.finditer(self.text))[len(self.seen):]:
            try:
                obj = json.loads(m.group(1))
            except json.JSONDecodeError:
                obj = m.group(1)
            key = _key(str(obj.get("name")), obj.get("arguments")) if isinstance(obj, dict) else m.group(1)
            if key in self.seen:
                return True
            self.seen.add(key)
        return False


def split_calls(text: str, spec: ToolSpec) -> tuple[str, list[dict[str, Any]]]:
    """(content without the calls, OpenAI tool_calls) of a reply; a call repeated whole is made once."""
    calls: list[dict[str, Any]] = []
    keys: set[str] = set()
    spans: list[tuple[int, int]] = []  # the returned calls' blocks (others stay in the content)
    for m in _CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in spec.names:
            continue
        args = obj.get("arguments", {})
        spans.append(m.span())
        if (calls and not spec.parallel) or _key(obj["name"], args) in keys:  # dropped, not left as markup
            continue
        keys.add(_key(obj["name"], args))
        calls.append({"id": "call_" + secrets.token_hex(12), "type": "function",
                      "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}})
    content, pos = [], 0
    for a, b in spans:
        content.append(text[pos:a])
        pos = b
    rest = text[pos:]
    cut = rest.rfind(OPEN)
    if cut >= 0 and CLOSE not in rest[cut:]:  # a last call cut off by max_tokens: not content
        rest = rest[:cut]
    content.append(rest)
    return ("".join(content).strip() if spans or cut >= 0 else text), calls


class ToolStream:
    """A streamed reply's text, held back while it may be a tool call (a prefix of ``<tool_call>`` or
    inside one): push() returns the text that can go out now; finish() the rest and the calls."""

    def __init__(self, spec: ToolSpec) -> None:
        self.spec, self.text, self.sent = spec, "", 0

    def push(self, piece: str) -> str:
        self.text += piece
        out_to = len(self.text)
        start = self.text.find(OPEN, self.sent)
        if start >= 0:
            out_to = start
        else:  # hold back a tail that may grow into "<tool_call>"
            for k in range(min(len(OPEN) - 1, len(self.text) - self.sent), 0, -1):
                if OPEN.startswith(self.text[-k:]):
                    out_to = len(self.text) - k
                    break
        emit, self.sent = self.text[self.sent : out_to], max(self.sent, out_to)
        return emit

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        content, calls = split_calls(self.text[self.sent :], self.spec)
        return content, calls


def apply_to_final(body: dict[str, Any], spec: ToolSpec) -> None:
    """A chat.completion body: each choice's tool calls moved out of its content (finish_reason
    "tool_calls" when there are any)."""
    for choice in body["choices"]:
        msg = choice["message"]
        content, calls = split_calls(msg["content"] or "", spec)
        if calls:
            msg["content"] = content or None
            msg["tool_calls"] = calls
            choice["finish_reason"] = "tool_calls"
        elif msg["content"]:
            msg["content"] = content  # without a call that max_tokens cut off


def calls_delta(chunk: dict[str, Any], calls: list[dict[str, Any]]) -> dict[str, Any]:
    """A chat.completion.chunk (built for one choice) carrying these tool calls whole, as deltas."""
    chunk["choices"][0]["delta"] = {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}
    return chunk
