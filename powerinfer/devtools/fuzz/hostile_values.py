"""Hostile metadata values for well-formed files: wrong types, absurd numbers, odd strings, templates.

Runs in: the fuzzing parent process and the test process.

The keys attacked are the ones our readers look up (config, tokenizer, chat template, predictor and
PowerInfer keys, alignment), so every hostile value is actually consumed by some code path.
``HOSTILE_TEMPLATES`` are chat templates in the style of CVE-2024-34359 (reaching Python internals
from a GGUF's ``tokenizer.chat_template``) plus CPU and memory exhaustion attempts; each must fail
with a clean ChatTemplateError within the sandbox's time limit.
"""

from __future__ import annotations

import math
import random
import struct

from gguf import GGUFValueType as VT

from powerinfer.devtools.fuzz.bases import Base
from powerinfer.devtools.fuzz.gguf_layout import SCALAR_SIZES, Layout, enc_array, enc_scalar, enc_string

_ARCH_KEYS = (
    "block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "attention.key_length", "attention.value_length", "rope.dimension_count",
    "rope.freq_base", "rope.scaling.type", "rope.scaling.factor", "attention.layer_norm_rms_epsilon",
    "attention.sliding_window", "final_logit_softcapping", "vocab_size",
)
_TOKENIZER_KEYS = tuple("tokenizer.ggml." + k for k in (
    "model", "pre", "tokens", "token_type", "scores", "merges", "bos_token_id", "eos_token_id", "unknown_token_id",
    "eot_token_id", "eom_token_id", "fim_pad_token_id", "fim_rep_token_id", "fim_sep_token_id", "add_bos_token",
    "add_eos_token", "add_space_prefix"))
_PREDICTOR_KEYS = tuple("powerinfer.predictor." + k for k in (
    "version", "mode", "model_name", "fingerprint", "n_layers", "d_model", "n_ff", "rank", "target_sparsity",
    "calibration.source", "calibration.tokens"))
_TEXT_KEYS = frozenset({"general.architecture", "general.name", "tokenizer.ggml.model", "tokenizer.ggml.pre",
                        "tokenizer.chat_template", "rope.scaling.type"})

_INT_RANGES: dict[int, tuple[int, int]] = {
    VT.UINT8: (0, 2**8 - 1), VT.INT8: (-(2**7), 2**7 - 1), VT.UINT16: (0, 2**16 - 1), VT.INT16: (-(2**15), 2**15 - 1),
    VT.UINT32: (0, 2**32 - 1), VT.INT32: (-(2**31), 2**31 - 1), VT.UINT64: (0, 2**64 - 1), VT.INT64: (-(2**63), 2**63 - 1),
}
_INTS = (0, 1, 2, 3, -1, -2, 7, 8, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53, 2**62,
         2**63 - 1, 2**63, 2**64 - 1, -(2**31), -(2**63))
_FLOATS = (0.0, -0.0, 1.0, -1.0, 0.5, 1e-45, 1e-38, 3.4e38, 1e300, math.nan, math.inf, -math.inf)

HOSTILE_TEMPLATES: tuple[str, ...] = (
    # reaching Python internals (CVE-2024-34359 and friends)
    "{{ self.__init__.__globals__ }}",
    "{{ self._TemplateReference__context.cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% for c in [].__class__.__base__.__subclasses__() %}{{ c.__name__ }}{% endfor %}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ joiner.__init__.__globals__['os'].system('id') }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "{{ raise_exception.__globals__ }}",
    "{{ strftime_now.__globals__['datetime'] }}",
    "{{ messages.__class__.__mro__ }}",
    "{{ messages[0].__class__.__init__.__globals__ }}",
    "{{ ''|attr('\\x5f\\x5fclass\\x5f\\x5f') }}",
    "{{ (messages|attr('__class__')).__base__ }}",
    "{{ '{0.__class__.__mro__}'.format(messages) }}",
    "{{ '%s'.format_map.__self__.__class__ }}",
    "{{ dict(a=1).__class__.__subclasses__() }}",
    "{{ namespace(a=1).__class__.__init__ }}",
    "{{ messages.append({'role': 'x'}) }}{{ messages.clear() }}",
    # CPU exhaustion
    "{% for x in range(10**9) %}{% endfor %}",
    "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
    "{% set s = 'x' * 1000000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "{{ 2 ** 100000 }}",
    "{{ (2 ** 1024) ** 1024 }}",
    "{% set n = 2 ** 1000 %}{{ n * n * n * n * n * n * n * n * n * n * n * n * n * n * n * n * n * n * n * n }}",
    # memory exhaustion
    "{{ 'x' * 1000000000 }}",
    "{{ 'x' * 999999 * 999999 }}",
    "{{ ['x'] * 999999 * 999999 }}",
    "{% set s = 'x' * 1000000 %}{{ s.center(1000000000) }}",
    "{% set s = 'x' * 1000000 %}{{ s.replace('x', s) }}",
    "{% set s = 'x' * 1000000 %}{{ s | replace('x', s) }}",
    "{% set s = 'x\n' * 500000 %}{{ s | indent(1000000) }}",
    "{% set s = '\t' * 1000000 %}{{ s.expandtabs(100000) }}",
    "{{ '{:>1000000000}'.format(1) }}",
    "{{ '%1000000000d' % 1 }}",
    "{{ 'x' | center(1000000000) }}",
    "{% set s = 'x' * 1000000 %}{{ ([s] * 100000) | join(s) }}",
    "{% set s = 'x' * 1000000 %}{{ s | wordwrap(1, wrapstring=s) }}",
    "{% set s = 'x' * 1000000 %}{{ s.join(s) }}",
    "{% set a = 'x' * 1000000 %}{% set b = a ~ a %}{% set c = b ~ b %}{% set d = c ~ c %}{% set e = d ~ d %}"
    "{% set f = e ~ e %}{% set g = f ~ f %}{% set h = g ~ g %}{% set i = h ~ h %}{% set j = i ~ i %}{{ j ~ j }}",
    "{% set a = 'x' * 1000000 %}{% set b %}{{ a }}{{ a }}{% endset %}{% set c %}{{ b }}{{ b }}{% endset %}"
    "{% set d %}{{ c }}{{ c }}{% endset %}{% set e %}{{ d }}{{ d }}{% endset %}{% set f %}{{ e }}{{ e }}{% endset %}"
    "{% set g %}{{ f }}{{ f }}{% endset %}{% set h %}{{ g }}{{ g }}{% endset %}{% set i %}{{ h }}{{ h }}{% endset %}",
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s | length }}",
    "{% macro f(s, n) %}{% if n %}{{ f(s ~ s, n - 1) }}{% endif %}{% endmacro %}{{ f('x', 64) }}",
    "{% for i in range(100000) %}{{ 'x' * 1000000 }}{% endfor %}",
    "{% set s = 'x' * 1000000 %}{% for i in range(100000) %}{{ s }}{% endfor %}",
    "{{ lipsum(100000, min=100000, max=100000) }}",
    "{{ range(100000) | batch(1000000000, 'x') | list }}",
    "{% set a = [0] * 100000 %}{{ ([a] * 1000) | sum(start=[]) | length }}",
    "{{ {'a': 'x' * 1000000} | tojson(indent=1000000) }}",
    "{{ (1).to_bytes(1000000000, 'big') }}",
    "{% set s = 'x' * 1000000 %}{{ s.translate({120: s}) }}",
    # compile-time trouble
    "{{ " + "(" * 100000 + "1" + ")" * 100000 + " }}",
    "{% if 1 %}" * 5000 + "x" + "{% endif %}" * 5000,
    "{% for %}",
    "{{ raise_exception('no') }}",
)


def hostile_string(rng: random.Random, long: bool = False) -> str:
    """Odd text: empty, control characters, terminal escapes, lone surrogates (invalid UTF-8), huge."""
    if long:
        return rng.choice(("A", "\u2581", "\udcff", "{{")) * rng.choice((70_000, 1_000_000))
    return rng.choice((
        "", " ", "\0", "\n", "llama", "gemma3", "qwen2", "gpt2", "powerinfer-predictor", "generic.gpu_index", "linear",
        "predictor", "gate", "\x1b[2J\x1b[31mred", "a\r\nb", "\udcff\udcfe", "caf\udce9", "\u202eevil", "\ufeff",
        "x" * 300, "{{ 1 }}", "%s%n", rng.randbytes(rng.randrange(1, 40)).decode("utf-8", "surrogateescape"),
    ))


def _scalar(rng: random.Random, vtype: int) -> bytes:
    if vtype in (VT.FLOAT32, VT.FLOAT64):
        value = rng.choice(_FLOATS)
        if vtype == VT.FLOAT32 and math.isfinite(value) and abs(value) > 3.4e38:
            value = math.inf
        return enc_scalar(vtype, value)
    if vtype == VT.BOOL:
        return bytes([rng.choice((0, 1, 2, 255))])  # 2 and 255: a bool byte that is neither 0 nor 1
    lo, hi = _INT_RANGES[vtype]
    return enc_scalar(vtype, min(max(rng.choice(_INTS), lo), hi))


def hostile_value(rng: random.Random, any_type: bool) -> tuple[int, bytes]:
    """(value type id, encoded value): a numeric scalar, or with ``any_type`` anything at all."""
    numeric = [t for t in SCALAR_SIZES]
    vtype = rng.choice([*numeric, VT.STRING, VT.ARRAY, VT.ARRAY] if any_type else numeric)
    if vtype == VT.STRING:
        return vtype, enc_string(hostile_string(rng, long=rng.random() < 0.05))
    if vtype != VT.ARRAY:
        return vtype, _scalar(rng, vtype)
    etype = rng.choice([*numeric, VT.STRING, VT.ARRAY])
    n = rng.choice((0, 1, 2, 3, 17, 258, 1000))
    if etype == VT.ARRAY:
        inner = [struct.pack("<IQ", VT.INT32, 1) + enc_scalar(VT.INT32, rng.choice((0, -1))) for _ in range(min(n, 8))]
        return vtype, enc_array(VT.ARRAY, inner)
    if etype == VT.STRING:
        return vtype, enc_array(etype, [enc_string(hostile_string(rng)) for _ in range(n)])
    return vtype, enc_array(etype, [_scalar(rng, etype) for _ in range(n)])


def _arch(layout: Layout) -> str:
    for kv in layout.kvs:
        if kv.key == b"general.architecture" and kv.vtype == VT.STRING:
            return kv.value[8:].decode("utf-8", "replace")
    return "llama"


def read_keys(base: Base) -> list[str]:
    """The metadata keys our readers consult for this base."""
    arch = _arch(base.layout)
    keys = ["general.architecture", "general.name", "general.alignment"]
    if base.kind == "predictor":
        keys += [*_PREDICTOR_KEYS, f"{arch}.block_count", f"{arch}.embedding_length", f"{arch}.feed_forward_length",
                 "powerinfer.sparse_threshold", "split.vram_capacity"]
    else:
        keys += [f"{arch}.{k}" for k in _ARCH_KEYS] + [*_TOKENIZER_KEYS, "tokenizer.chat_template"]
    return keys


def numeric_keys(base: Base) -> list[str]:
    return [k for k in read_keys(base) if k not in _TEXT_KEYS and not k.endswith(("mode", "name", "fingerprint", "source",
                                                                                      "tokens", "merges", "pre", "model"))]


def hostile_template(rng: random.Random) -> str:
    return rng.choice(HOSTILE_TEMPLATES)
