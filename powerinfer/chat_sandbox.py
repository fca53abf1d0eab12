"""The jinja2 sandbox chat templates run in: no Python internals, and bounded time and memory.

Runs in: the coordinator process (wherever :class:`powerinfer.chat.ChatTemplate` renders).

A chat template comes from the model file, i.e. from whoever made the file. jinja2's immutable
sandbox already stops attribute access to Python internals (CVE-2024-34359) and mutation of the
conversation; it does nothing against a template that loops for hours or builds a terabyte string
(``{% for a in s %}{% for b in s %}``, ``s.center(10**9)``, ``{% set b = a ~ a %}`` twenty times).
:class:`HardenedSandbox` adds, per render, a :class:`Budget`:

* **time**: a deadline checked on every loop iteration, call, output and concatenation;
* **characters**: every value the template builds (``~``, ``+``, ``*``, ``%``, calls, filters,
  output) is charged, *before* it is built wherever the size can be known in advance (the
  amplifiers: ``*``, ``replace``, ``join``, ``center``, ``indent``, ``expandtabs``, ``translate``,
  ``format``, ``tojson``, ``sum``...), so the total a render may allocate is bounded;
* **numbers**: integer arguments of calls and filters are capped (widths, counts, byte lengths),
  and integer arithmetic may not grow past :data:`MAX_INT_BITS`.

Loops, outputs and ``~`` are reached by rewriting the parsed template before compiling it: each
``for`` iterable, each output expression and each concatenation goes through a method of the
environment, which the template cannot name, shadow or reach. ``lipsum`` is removed.
"""

from __future__ import annotations

import itertools
import math
import re
import string
import time
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from typing import Any

from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.runtime import Context, Macro
from jinja2.utils import Namespace
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

MAX_ARG_INT = 100_000  # largest integer argument of a call or filter (a width, a count, a length)
MAX_INT_BITS = 1 << 16  # largest integer a template may compute (a 65536-bit number has ~20k digits)
_PRINTF = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[diouxXeEfFgGcrsa%]")
_DIGITS = re.compile(r"\d+")

_GUARDS = frozenset({"guard_loop", "guard_output", "guard_concat"})
_STORES = (Namespace, dict)  # callables that only store their arguments

_BUDGET: ContextVar[Budget | None] = ContextVar("powerinfer_chat_budget", default=None)


class Budget:
    """What one render may still spend: a monotonic deadline and a number of characters."""

    __slots__ = ("deadline", "seconds", "chars", "limit")

    def __init__(self, seconds: float, limit: int) -> None:
        self.seconds, self.deadline, self.chars, self.limit = seconds, time.monotonic() + seconds, 0, limit

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise SecurityError(f"the template ran for more than {self.seconds:g} s")

    def ensure(self, n: int) -> None:
        """Refuse to build a value of ``n`` characters/items if it would exceed the budget."""
        if self.chars + n > self.limit:
            raise SecurityError(f"the template tried to build {n} characters, beyond its budget of {self.limit}")

    def charge(self, n: int) -> None:
        self.ensure(n)
        self.chars += n


def budget() -> Budget:
    b = _BUDGET.get()
    if b is None:
        raise SecurityError("templates of this sandbox render only through ChatTemplate.render")
    return b


def activate(b: Budget) -> Any:
    """Make ``b`` the budget of renders in this thread / context; returns a token for :func:`deactivate`."""
    return _BUDGET.set(b)


def deactivate(token: Any) -> None:
    _BUDGET.reset(token)


def size(obj: Any, memo: dict[int, int] | None = None, depth: int = 0) -> int:
    """Upper estimate of ``len(str(obj))`` (containers by their elements; shared ones counted once each)."""
    if isinstance(obj, str):
        return len(obj)
    if isinstance(obj, bool) or obj is None:
        return 5
    if isinstance(obj, int):
        return obj.bit_length() // 3 + 2
    if isinstance(obj, (float, complex)):
        return 32
    if isinstance(obj, (bytes, bytearray)):
        return 4 * len(obj) + 3
    if not isinstance(obj, (list, tuple, dict, set, frozenset)):
        return 64
    memo = {} if memo is None else memo
    if id(obj) in memo:
        return memo[id(obj)]
    if depth > 50:
        raise SecurityError("the template nests values too deeply")
    items = itertools.chain.from_iterable(obj.items()) if isinstance(obj, dict) else obj
    total = 2 + sum(size(x, memo, depth + 1) + 2 for x in items)
    memo[id(obj)] = total
    return total


def _length(obj: Any) -> int:
    return len(obj) if isinstance(obj, (str, bytes, list, tuple, dict)) else 0


def _check_ints(args: Iterable[Any]) -> None:
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_ARG_INT:
            raise SecurityError(f"the template passed the number {a}, larger than {MAX_ARG_INT}")


def _printf_bound(fmt: str, args: Any) -> int:
    values = args if isinstance(args, tuple) else (args,)
    _check_ints(values)
    per_value = size(args)
    total = len(fmt)
    for m in _PRINTF.finditer(fmt):
        for group in m.groups():
            total += MAX_ARG_INT if group == "*" else int(group) if group else 0
        total += per_value
    return total


def _format_bound(fmt: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    _check_ints([*args, *kwargs.values()])
    per_field = size(args) + size(kwargs)
    total = 0
    for literal, field, spec, _ in string.Formatter().parse(fmt):
        total += len(literal)
        if field is not None:
            total += per_field + sum(int(d) for d in _DIGITS.findall(spec or "")) + MAX_ARG_INT * (spec or "").count("{")
    return total


def _replace_bound(s: str, old: Any, new: Any, count: Any = -1) -> int:
    if not (isinstance(s, str) and isinstance(old, str) and isinstance(new, str)) or len(new) <= len(old):
        return _length(s)
    hits = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * (len(new) - len(old))


def _bound_str_method(s: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, tuple[Any, ...]]:
    """(upper bound of the result's length, possibly materialized args) for the amplifying str methods."""
    if name == "replace":
        return _replace_bound(s, *args, **kwargs), args
    if name == "join" and args:
        items = list(args[0])
        return sum(size(x) for x in items) + len(s) * max(0, len(items) - 1), (items,)
    if name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        return len(s) + s.count("\t") * (tab if isinstance(tab, int) else 8), args
    if name == "translate" and args:
        table = args[0]
        values = table.values() if isinstance(table, dict) else table if isinstance(table, (list, tuple)) else ()
        return len(s) * max([1, *(size(v) for v in values)]), args
    if name in ("format", "format_map"):
        mapping = args[0] if name == "format_map" and args else {}
        return _format_bound(s, args if name == "format" else (), kwargs or dict(mapping)), args
    return len(s), args


class _Rewriter(NodeTransformer):
    """Route loops, outputs and ``~`` through the environment's guards (see the module docstring)."""

    def _guard(self, name: str, args: list[nodes.Expr], like: nodes.Node) -> nodes.Call:
        return nodes.Call(nodes.EnvironmentAttribute(name, lineno=like.lineno), args, [], None, None, lineno=like.lineno)

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = self._guard("guard_loop", [node.iter], node)
        return node

    def visit_Output(self, node: nodes.Output) -> nodes.Node:
        self.generic_visit(node)
        node.nodes = [self._guard("guard_output", [child], child) for child in node.nodes]
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return self._guard("guard_concat", list(node.nodes), node)


class HardenedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with per-render limits; compile with :meth:`compile_template`."""

    intercepted_binops = frozenset({"+", "-", "*", "/", "//", "%", "**"})

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.globals.pop("lipsum", None)  # lipsum(n, min, max) builds n * max words in one C-speed call
        for name, func in list(self.filters.items()):
            self.add_filter(name, func)

    def compile_template(self, source: str) -> Any:
        tree = self.parse(source)
        tree = _Rewriter().visit(tree)
        tree.set_environment(self)
        return self.from_string(tree)

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # raise at once instead of rendering "" (so probing templates fail loudly)
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe")

    # -- guards the rewritten template calls --------------------------------------------------

    def guard_loop(self, iterable: Any) -> Iterator[Any]:
        b = budget()
        for item in iterable:
            b.tick()
            yield item

    def guard_output(self, value: Any) -> Any:
        b = budget()
        b.tick()
        b.charge(size(value))
        return value

    def guard_concat(self, *parts: Any) -> str:
        b = budget()
        b.tick()
        b.charge(sum(size(p) for p in parts))
        return "".join(map(str, parts))

    # -- operators, calls, filters --------------------------------------------------------------

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        b = budget()
        b.tick()
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int):
                    b.ensure(max(len(seq) * count, size(seq) * count if count > 0 else 0))
            if ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise SecurityError("the template tried to compute a number too large")
        elif operator == "**" and isinstance(right, (int, float)):
            base_bits = max(abs(left).bit_length() if isinstance(left, int) else 64, 1)
            if right > 0 and base_bits * right > MAX_INT_BITS:
                raise SecurityError(f"the template tried to raise a number to the power {right}")
        elif operator == "%" and isinstance(left, str):
            b.ensure(_printf_bound(left, right))
        elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, type(left)):
            b.ensure(len(left) + len(right))
        result = super().call_binop(context, operator, left, right)
        if isinstance(result, int) and result.bit_length() > MAX_INT_BITS:
            raise SecurityError("the template tried to compute a number too large")
        b.charge(_length(result))
        return result

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja's convention
        if getattr(__obj, "__self__", None) is __self and getattr(__obj, "__name__", "") in _GUARDS:
            return __obj(*args)  # our own guards, inserted by _Rewriter
        b = budget()
        b.tick()
        plain = {k: v for k, v in kwargs.items() if k not in ("_loop_vars", "_block_vars")}
        if not isinstance(__obj, Macro) and __obj not in _STORES:  # a macro or namespace(n=...) only keeps values
            _check_ints([*args, *plain.values()])
        target = getattr(__obj, "__wrapped__", __obj)  # str.format is wrapped by the sandbox
        owner = getattr(target, "__self__", None)
        if isinstance(owner, str):
            bound, args = _bound_str_method(owner, getattr(target, "__name__", ""), args, plain)
            b.ensure(bound)
        result = super().call(__context, __obj, *args, **kwargs)
        b.charge(_length(result))
        return result

    def add_filter(self, name: str, func: Callable[..., Any]) -> None:
        """Register filter ``name``, wrapped in the budget checks (use this, not ``filters[name] = ``)."""
        self.filters[name] = self._guarded_filter(name, func)

    def _guarded_filter(self, name: str, func: Callable[..., Any]) -> Callable[..., Any]:
        pass_arg = getattr(func, "jinja_pass_arg", None)
        first = 1 if pass_arg is not None else 0  # the context / eval context / environment comes first

        def guarded(*args: Any, **kwargs: Any) -> Any:
            b = budget()
            b.tick()
            if len(args) <= first:  # no value: let the filter complain about its arguments itself
                return func(*args, **kwargs)
            head, value, rest = args[:first], args[first], list(args[first + 1:])
            _check_ints([*rest, *kwargs.values()])
            if name == "replace" and rest:
                b.ensure(_replace_bound(value, *rest[:3]))
            elif name == "join":
                value = list(value)
                sep = rest[0] if rest else kwargs.get("d", "")
                b.ensure(sum(size(x) for x in value) + size(sep) * len(value))
            elif name == "indent" and isinstance(value, str):
                width = rest[0] if rest else kwargs.get("width", 4)
                b.ensure(len(value) + (value.count("\n") + 1) * (size(width) if isinstance(width, str) else int(width)))
            elif name == "wordwrap" and isinstance(value, str):
                wrap = kwargs.get("wrapstring", rest[2] if len(rest) > 2 else None) or "\n"
                b.ensure(len(value) * (1 + size(wrap)))
            elif name == "format" and isinstance(value, str):
                b.ensure(_printf_bound(value, tuple(rest) or kwargs))
            elif name == "tojson":
                indent = kwargs.get("indent", rest[1] if len(rest) > 1 else None) or 0
                b.ensure(size(value) * (1 + (indent if isinstance(indent, int) else size(indent))))
            elif name == "sum":
                value = list(value)
                start = kwargs.get("start", rest[1] if len(rest) > 1 else 0)
                if not isinstance(start, (int, float)):  # sequences: concatenating is quadratic, bound it first
                    b.ensure(size(start) + sum(size(x) for x in value))
                    if isinstance(start, (list, tuple)) and all(isinstance(x, type(start)) for x in value):
                        return type(start)(itertools.chain(start, *value))
            elif name in ("string", "pprint", "list", "xmlattr", "urlize", "dictsort"):
                b.ensure(size(value))
            result = func(*head, value, *rest, **kwargs)
            b.charge(_length(result))
            return result

        guarded.__name__ = getattr(func, "__name__", name)
        if pass_arg is not None:
            guarded.jinja_pass_arg = pass_arg  # type: ignore[attr-defined]
        return guarded


def render_budget(seconds: float, base_chars: int, input_chars: int, factor: int) -> Budget:
    """The budget of one render: ``base_chars + factor * input_chars`` characters, ``seconds`` seconds."""
    limit = base_chars + factor * max(0, input_chars)
    return Budget(seconds if math.isfinite(seconds) else 1e9, limit)
