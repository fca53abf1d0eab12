"""The per-token cost of a grammar's mask on this CPU: ``python -m powerinfer.devtools.harness.grammar_time MODEL``.

Runs in: the user's process (a tool: it loads the model in process and runs a constrained greedy
reply, timing each mask).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from powerinfer.constrained import TokenConstraint, grammar_for, grammar_tokenizer


def mask_time_us(model: str, schema: dict[str, Any] | None = None, steps: int = 64) -> tuple[float, float, int]:
    """(median, 90th percentile) µs to compute one token's mask, over a greedy JSON reply of up to
    ``steps`` tokens from the model (in process), and the vocabulary size."""
    import time

    from powerinfer.api import LLM
    from powerinfer.coordinator.sequence import Sequence
    from powerinfer.sampling import SamplingParams

    llm = LLM(model, executor="inprocess")
    try:
        grammar = grammar_for("json_schema", schema or {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                                                        "required": ["name", "age"]})
        vocab = llm.config.vocab_size
        grammar_tokenizer(llm.tokenizer, vocab)  # built once per model, not per token
        c = TokenConstraint(llm.tokenizer, vocab, grammar)
        ids = llm.chat_ids([{"role": "user", "content": "Describe a person as JSON."}])
        st = Sequence(llm.tokenizer, ids, steps, SamplingParams(temperature=0), constraint=c)
        llm.engine.rewind(0)
        logits = llm.engine.eval(ids)[-1]
        times = []
        while not st.done:
            t = time.perf_counter()
            c.allowed()
            times.append((time.perf_counter() - t) * 1e6)
            st.step(logits, False)
            if not st.done and st.next_token is not None:
                logits = llm.engine.eval([st.next_token])[-1]
        return float(np.median(times)), float(np.percentile(times, 90)), vocab
    finally:
        llm.close()


def main(argv: list[str] | None = None) -> int:
    import sys

    from powerinfer.errors import PowerInferError
    from powerinfer.fetch import resolve_model
    from powerinfer.flags import Parser

    p = Parser(prog="python -m powerinfer.devtools.harness.grammar_time", description="The per-token cost of a JSON schema's mask, in process.")
    p.add_argument("model", nargs="?", default="smollm2", help="GGUF file or known model name (default smollm2)")
    args = p.parse_args(argv)
    try:
        med, p90, n = mask_time_us(str(resolve_model(args.model, progress=sys.stderr.isatty())))
    except PowerInferError as e:
        sys.stderr.write(f"error: {e}\n")
        return 1
    sys.stdout.write(f"grammar mask per token ({n} tokens in the vocabulary): median {med:.1f} µs, 90th percentile {p90:.1f} µs\n")
    return 0


if __name__ == "__main__":  # python -m powerinfer.devtools.harness.grammar_time [MODEL]
    import sys

    sys.exit(main())
