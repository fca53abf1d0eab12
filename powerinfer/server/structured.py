"""Structured output requests: ``response_format`` (OpenAI), ``json_schema`` and ``grammar`` (llama.cpp).

Runs in: the server process (HTTP side): the grammar is compiled and checked when the request is
parsed, so an invalid schema or grammar is a 400 naming the parameter and never reaches the model.
The compiled grammar then constrains each of the request's sequences (powerinfer.constrained).
"""

from __future__ import annotations

from typing import Any, Mapping

from powerinfer.constrained import grammar_for
from powerinfer.errors import InvalidArgumentError
from powerinfer.server.api_errors import bad


def compile_grammar(kind: str, spec: Any, param: str) -> str:
    """grammar_for(kind, spec), a 400 naming param when it is not valid."""
    return _compile(kind, spec, param)


def _compile(kind: str, spec: Any, param: str) -> str:
    try:
        return grammar_for(kind, spec)
    except InvalidArgumentError as e:
        raise bad(f"'{param}' is not a valid {kind.replace('_', ' ')}: {e}", param) from None


def parse_grammar(body: Mapping[str, Any]) -> str | None:
    """The llguidance grammar a request asks for, or None (free text).

    ``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}`` (any JSON object, or
    llama.cpp's ``"schema"`` inside it), ``{"type": "json_schema", "json_schema": {"name", "schema",
    "strict"}}``; llama.cpp's top-level ``json_schema`` (a schema) and ``grammar`` (GBNF). At most
    one of them may constrain the output."""
    given = [k for k in ("response_format", "json_schema", "grammar") if body.get(k) is not None]
    rf = body.get("response_format")
    if rf is not None and not isinstance(rf, dict):
        raise bad("'response_format' must be an object", "response_format", "invalid_type")
    if isinstance(rf, dict) and rf.get("type", "text") == "text" and set(rf) <= {"type"}:
        given.remove("response_format")  # plain text: no constraint
    if len(given) > 1:
        raise bad(f"give one of {', '.join(given)}, not several", given[1])
    if not given:
        return None
    if given[0] == "grammar":
        return _compile("gbnf", body["grammar"], "grammar")
    if given[0] == "json_schema":
        return _compile("json_schema", body["json_schema"], "json_schema")
    assert isinstance(rf, dict)
    kind = rf.get("type")
    if kind == "json_object":
        schema = rf.get("schema")
        return _compile("json_schema", schema, "response_format.schema") if schema is not None else _compile("json_object", None, "response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise bad("'response_format.json_schema' must be an object with a 'schema'", "response_format.json_schema", "invalid_type")
        name = js.get("name")
        if name is not None and not isinstance(name, str):
            raise bad("'response_format.json_schema.name' must be a string", "response_format.json_schema.name", "invalid_type")
        schema = js.get("schema", {"type": "object"})
        return _compile("json_schema", schema, "response_format.json_schema.schema")
    raise bad(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}", "response_format.type")
