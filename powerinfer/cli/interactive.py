"""`powerinfer -i`: multi-turn chat in the terminal with the model's chat template.

Runs in: the user's process (the coordinator).

Keys: Enter sends a message; Ctrl+C while the model answers stops the answer (what it said so far
stays in the conversation) and returns to the prompt; Ctrl+C on an empty prompt, Ctrl+D or /exit
quits. /reset forgets the conversation (the system prompt stays), /help lists the commands.
When the conversation no longer fits the context, the oldest turns are dropped (the system prompt
is always kept) and a line on stderr says so; the KV cache of the unchanged prefix is reused.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TextIO

from powerinfer.errors import PowerInferError

if TYPE_CHECKING:
    from powerinfer.api import LLM
    from powerinfer.sampling import SamplingParams

HELP = "commands: /exit (or Ctrl+D) quit, /reset forget the conversation, /help this text; Ctrl+C stops an answer"


class ChatSession:
    """The conversation and its fitting into the context window."""

    def __init__(self, llm: LLM, system: str | None, n_predict: int) -> None:
        self.llm = llm
        self.system = [{"role": "system", "content": system}] if system else []
        self.turns: list[dict[str, str]] = []
        # room kept free for the answer: -n, or a quarter of the context when unlimited
        self.reserve = n_predict if n_predict > 0 else max(16, llm.n_ctx // 4)

    def messages(self) -> list[dict[str, str]]:
        return self.system + self.turns

    def prompt_ids(self) -> list[int]:
        text = self.llm.render_chat(self.messages())
        return self.llm.tokenize(text, add_bos=not self.llm._template_has_bos(text), special=True)

    def fit(self, err: TextIO) -> list[int]:
        """Token ids of the conversation, dropping the oldest turns until the answer has room."""
        ids = self.prompt_ids()
        dropped = 0
        while len(ids) + self.reserve > self.llm.n_ctx and len(self.turns) > 1:
            # drop the oldest user turn and the assistant reply after it
            del self.turns[: 2 if len(self.turns) > 2 and self.turns[1]["role"] == "assistant" else 1]
            dropped += 1
            ids = self.prompt_ids()
        if dropped:
            print(f"[context full: dropped the {dropped} oldest turn(s); the system prompt is kept]", file=err)
        if len(ids) + 1 > self.llm.n_ctx:
            self.turns.pop()
            raise PowerInferError(f"this message needs {len(ids)} tokens, more than the context of {self.llm.n_ctx} (raise -c)")
        return ids


def run_chat(llm: LLM, params: SamplingParams, system: str | None, n_predict: int, first: str | None = None,
             stdin: TextIO = sys.stdin, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """The chat loop; ``first`` (from -p/-f) is sent as the first user message."""
    session = ChatSession(llm, system, n_predict)
    if system:  # refused now, not blamed on every message later
        need = len(session.prompt_ids())
        if need + 1 > llm.n_ctx:
            raise PowerInferError(f"the system prompt needs {need} tokens, more than the context of {llm.n_ctx} (raise -c or shorten --system)")
    print(f"chatting with {llm.config.name}. {HELP}", file=err)
    while True:
        if first is not None:
            line, first = first, None
            out.write(f"\n> {line}\n")
        else:
            try:
                out.write("\n> ")
                out.flush()
                line = stdin.readline()
            except KeyboardInterrupt:  # at the prompt there is no answer to stop: say how to quit
                out.write("\n[Ctrl+C stops an answer; Ctrl+D or /exit quits]")
                continue
        if not line:  # Ctrl+D
            out.write("\n")
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/help":
            print(HELP, file=err)
            continue
        if text == "/reset":
            session.turns.clear()
            print("[conversation cleared]", file=err)
            continue
        session.turns.append({"role": "user", "content": text})
        try:
            ids = session.fit(err)
        except PowerInferError as e:
            print(f"error: {e}", file=err)
            continue
        answer: list[str] = []
        limit = n_predict if n_predict > 0 else llm.n_ctx - len(ids)
        try:
            for chunk in llm.generate(ids, max(1, limit), sampling=params):
                if chunk.text:
                    answer.append(chunk.text)
                    out.write(chunk.text)
                    out.flush()
        except KeyboardInterrupt:
            out.write("\n[stopped]")
            out.flush()
        except PowerInferError as e:
            print(f"\nerror: {e}", file=err)
        session.turns.append({"role": "assistant", "content": "".join(answer).strip()})
        out.write("\n")
