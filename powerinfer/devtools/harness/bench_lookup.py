"""`powerinfer bench --lookup N`: prompt lookup decoding against plain decoding, paired rounds.

Runs in: the user's process (the model loaded once, with its workers under the default executor).

Two tasks: quoting (the reply copies a passage given in the prompt: lookup's case) and free
writing (a story: little to look up, so the cost of rejected drafts shows). Each round decodes the
task plainly and with lookup, in turn; the tokens must be identical, and the figure is the median
over rounds of the per-round tokens/s ratio.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

# public domain (1863): a passage the model is asked to copy
PASSAGE = ("Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived in Liberty, "
           "and dedicated to the proposition that all men are created equal. Now we are engaged in a great civil war, testing "
           "whether that nation, or any nation so conceived and so dedicated, can long endure. We are met on a great "
           "battle-field of that war. We have come to dedicate a portion of that field, as a final resting place for those who "
           "here gave their lives that that nation might live. It is altogether fitting and proper that we should do this.")
TASKS = {
    "quote": "Copy the following text exactly, word for word:\n\n" + PASSAGE,
    "story": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


@dataclass
class TaskFigures:
    plain_tps: list[float] = field(default_factory=list)
    lookup_tps: list[float] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    passes: int = 0
    tokens: int = 0

    @property
    def ratio(self) -> float:
        return statistics.median(b / a for a, b in zip(self.plain_tps, self.lookup_tps))


@dataclass
class LookupBench:
    model: str
    n_draft: int
    rounds: int
    gen_tokens: int
    executor: str
    tasks: dict[str, TaskFigures]

    def report(self) -> str:
        lines = [f"model: {self.model}  executor: {self.executor}  --lookup {self.n_draft}  {self.gen_tokens} tokens a run, greedy, "
                 f"{self.rounds} paired rounds (plain, lookup); the tokens were identical in every round"]
        for name, t in self.tasks.items():
            lines.append(f"{name:>6}: lookup / plain tokens/s, median of per-round ratios: {t.ratio:.3f}  "
                         f"(plain {statistics.median(t.plain_tps):.1f}, lookup {statistics.median(t.lookup_tps):.1f} tokens/s; "
                         f"{t.accepted} of {t.drafted} drafted tokens accepted; {t.tokens} tokens in {t.passes} passes)")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "n_draft": self.n_draft, "rounds": self.rounds, "gen_tokens": self.gen_tokens,
                "tasks": {k: {"ratio": t.ratio, "plain_tps": t.plain_tps, "lookup_tps": t.lookup_tps, "drafted": t.drafted,
                              "accepted": t.accepted, "passes": t.passes, "tokens": t.tokens} for k, t in self.tasks.items()}}


def compare_lookup(model: str, n_draft: int, threads: int | None, executor: str, gen_tokens: int, rounds: int) -> LookupBench:
    from powerinfer.api import LLM
    from powerinfer.errors import PowerInferError
    from powerinfer.flags import set_lookup

    llm = LLM(model, n_ctx=1024, n_threads=threads, executor=executor)
    try:
        set_lookup(llm, n_draft)
        if not llm.core.lookup:
            raise PowerInferError("lookup decoding cannot run here (see the warning above)")
        figures = {name: TaskFigures() for name in TASKS}
        for _ in range(rounds):
            for name, text in TASKS.items():
                ids = llm.chat_ids([{"role": "user", "content": text}]) if llm.chat_template is not None else llm.tokenize(text)
                out: dict[int, list[int]] = {}
                for n in (0, n_draft):
                    llm.core.lookup = n
                    before = (llm.core.drafted, llm.core.accepted)
                    out[n] = [c.token for c in llm.generate(ids, gen_tokens, temperature=0) if c.token >= 0]
                    t = llm.timings
                    tps = (t.generated_tokens - 1) / t.decode_s if t.decode_s > 0 else 0.0
                    f = figures[name]
                    (f.lookup_tps if n else f.plain_tps).append(tps)
                    if n:
                        f.drafted += llm.core.drafted - before[0]
                        f.accepted += llm.core.accepted - before[1]
                        f.passes += t.decode_evals
                        f.tokens += t.generated_tokens - 1
                if out[0] != out[n_draft]:
                    raise PowerInferError(f"lookup decoding changed the tokens of the {name} task: a bug; please report it")
        return LookupBench(model, n_draft, rounds, gen_tokens, executor, figures)
    finally:
        llm.close()
