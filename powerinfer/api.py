"""The Python API, in the spirit of llama-cpp-python's ``Llama``: ``from powerinfer import LLM``.

Runs in: the user's process, which becomes the coordinator.

    llm = LLM("model.gguf")
    llm.tokenize("Hello")                          # -> [ids]
    llm.logits(ids)                                # -> float32 [len(ids), vocab]
    for chunk in llm.generate("The capital of France is", max_tokens=16, temperature=0):
        print(chunk.text, end="")
    for chunk in llm.chat([{"role": "user", "content": "Hi"}]):
        ...
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import numpy as np

from powerinfer.chat import ChatMessage, ChatTemplate
from powerinfer.config import ModelConfig, check_context, config_from_gguf
from powerinfer.coordinator.engine import Engine
from powerinfer.coordinator import sequence
from powerinfer.coordinator.engine_core import EngineCore
from powerinfer.coordinator.factory import ExecutorOptions, Model, build_executor
from powerinfer.errors import ChatTemplateError, InvalidArgumentError
from powerinfer.gguf_file import GGUFFile
from powerinfer.memory import release_freed_memory
from powerinfer.generation import GenerationChunk, checked_request
from powerinfer.sampling import SamplingParams
from powerinfer.predictors.predictor_file import read_predictor
from powerinfer.predictors.pwri_model import runnable_model
from powerinfer.tokenizer import GGUFTokenizer

if TYPE_CHECKING:
    from powerinfer.constrained import TokenConstraint
    from powerinfer.coordinator.cluster.options import ClusterOptions
    from powerinfer.coordinator.hybrid_executor import GpuOptions

log = logging.getLogger(__name__)

DEFAULT_CTX = 4096
MAX_CTX = 1 << 20  # a KV cache of more positions than this is a bad value, not a plan


@dataclass
class Timings:
    """Figures of the last generate() call (load_s: of the model), like llama.cpp's perf report."""

    load_s: float = 0.0
    prompt_tokens: int = 0  # tokens actually computed (a reused cached prefix is not counted)
    prompt_s: float = 0.0
    generated_tokens: int = 0  # tokens sampled, the end-of-generation token included
    generate_s: float = 0.0  # wall time from the first sample to the end (sampling included)
    decode_evals: int = 0  # forward passes of one token (the last sampled token is never evaluated)
    decode_s: float = 0.0  # time in those forward passes

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_s if self.prompt_s > 0 else 0.0

    @property
    def generate_tps(self) -> float:
        """Decode speed: one-token forward passes per second (what `powerinfer bench` reports)."""
        return self.decode_evals / self.decode_s if self.decode_s > 0 else 0.0


class LLM:
    """A loaded model. ``executor="process"`` (the default) runs every layer's shards on
    ``n_threads`` CPU threads (default: one per physical core) in worker processes of
    ``worker_threads`` threads each (the native decoder's, or torch's on the torch path; default: one
    worker process per NUMA node and L3, in a VM per core: cpu_workers/topology.py's split_threads); ``"inprocess"`` runs them in this process with ``n_threads`` threads: in
    the native decoder (one C call per forward pass, sparse FFNs included) when it applies (one
    shard, a C compiler, every matrix of a type it has a kernel for), else with torch, the test
    oracle. ``native`` True insists on the native decoder, False asks for the torch path.

    ``transport`` (process executor): ``"shm"`` makes every worker a native rank that runs whole
    forward passes on its shard and merges with the others in shared memory (one message per
    step; with a predictor each rank computes its neurons sparsely); ``"zmq"`` sends each layer
    to torch shards and sums their partials here (the oracle); ``"auto"`` (default) takes shm
    when the native decoder runs the model, else zmq (one log line says why).
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        n_ctx: int | None = None,
        default_ctx: int = DEFAULT_CTX,
        n_batch: int = 512,
        n_threads: int | None = None,
        executor: str = "process",
        predictor: str | os.PathLike[str] | None = None,
        sparse: bool = True,
        worker_threads: int | None = None,
        n_shards: int = 1,
        pin: bool = True,
        progress: bool = False,
        n_slots: int = 1,
        gpu: "GpuOptions | None" = None,
        native: bool | None = None,
        transport: str = "auto",
        cluster: "ClusterOptions | None" = None,
    ) -> None:
        t0 = time.perf_counter()
        self._closed = False
        ExecutorOptions(executor, n_threads=n_threads, transport=transport).check()  # before the file is read
        if default_ctx < 1:
            raise InvalidArgumentError(f"the default context must be positive, got {default_ctx}")
        self.source = Path(model_path)  # PowerInfer's files (PWRI) run as the GGUF and predictor made from them once
        self.path, self.powerinfer_file = runnable_model(self.source)
        if self.powerinfer_file is not None and predictor is None:
            predictor = self.powerinfer_file.predictor  # its own predictors (sparse unless --no-sparse)
        self.file = GGUFFile(self.path)
        self.config: ModelConfig = config_from_gguf(self.file)
        if n_ctx is None:
            n_ctx = min(default_ctx, self.config.context_length)  # 4096 is llama.cpp's default; capped by the model
        elif n_ctx == 0:
            n_ctx = self.config.context_length
        if n_ctx < 0:
            raise InvalidArgumentError(f"context size must be positive, got {n_ctx}")
        if n_ctx > MAX_CTX:  # -c 0 takes the file's context_length, which a hostile file sets to anything
            raise InvalidArgumentError(f"context size {n_ctx} exceeds the supported maximum of {MAX_CTX} tokens (give a smaller -c)")
        check_context(self.config, n_ctx)
        if n_batch < 1:
            raise InvalidArgumentError(f"batch size must be positive, got {n_batch}")
        n_batch = min(n_batch, n_ctx)  # a pass never holds more tokens than the context (llama.cpp clamps it too)
        self.tokenizer = GGUFTokenizer.from_metadata(self.file.metadata)
        # A template that does not compile (hostile or just broken) must not stop plain completion:
        # the error is kept and raised by chat, which is the only thing that needs the template.
        self.chat_template: ChatTemplate | None = None
        self._template_error: ChatTemplateError | None = None
        try:
            self.chat_template = ChatTemplate.for_model(self.file.metadata, self.tokenizer)
        except ChatTemplateError as e:
            log.warning("chat is unavailable for this model: %s", e)
            self._template_error = e
        # A predictor is validated against this model even when --no-sparse ignores it.
        self.predictor = read_predictor(predictor, model=self.file) if predictor is not None else None
        use = self.predictor if sparse else None
        opts = ExecutorOptions(executor, n_ctx, n_batch, n_threads, worker_threads, n_shards, pin, progress, n_slots, gpu, native, transport,
                               cluster)
        ex = build_executor(Model(self.path, self.file, self.config, self.predictor, predictor, sparse), opts)
        try:
            self.engine = Engine(self.file, self.config, ex, n_ctx=n_ctx, n_batch=n_batch, n_slots=n_slots)
        except BaseException:
            ex.close()
            raise
        self.n_ctx = n_ctx
        self.sparse = use is not None
        # one step loop and one failure path for generate() here and the server's scheduler
        self.core = EngineCore(self.engine)
        release_freed_memory()
        self.timings = Timings(load_s=time.perf_counter() - t0)
        log.info("loaded %s (%s) in %.2fs", self.config.name, self.config.arch, self.timings.load_s)

    def _eval(self, ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """engine.eval through the core's failure path: after a worker failure the error goes to
        this request at once and the pool is restarted at the start of the next one."""
        with self.core.guard():
            return self.engine.eval(ids, all_logits=all_logits)

    # -- tokens --------------------------------------------------------------------------------

    def tokenize(self, text: str | bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self.tokenizer.encode(text, add_bos=add_bos, special=special)

    def detokenize(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special=skip_special)

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Float32 logits [len(token_ids), vocab] at every position, computed from an empty cache."""
        self._check_open()
        self.engine.rewind(0)
        return self._eval(token_ids, all_logits=True)

    # -- generation ----------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 128,
        *,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
        special: bool = True,
        logprobs: int | None = None,
        grammar: str | None = None,
        **overrides: Any,
    ) -> Iterator[GenerationChunk]:
        """Stream the continuation of prompt (text, or token ids used as they are).

        max_tokens = -1 generates until an end-of-generation token or the context is full.
        ``special``: a special token's text in a string prompt ("<|im_start|>") is that token, as
        in llama.cpp's completions; False reads it as plain text (untrusted text, say).
        ``grammar``: a compiled grammar (powerinfer.constrained.grammar_for) the output follows.
        ``overrides`` are SamplingParams fields (temperature=0, top_k=..., seed=...).
        """
        self._check_open()
        params, stop = checked_request(sampling, overrides, max_tokens, stop, logprobs)
        ids = list(prompt) if not isinstance(prompt, str) else self.tokenize(prompt, add_bos=True, special=special)
        constraint = None
        if grammar is not None:
            from powerinfer.constrained import TokenConstraint

            constraint = TokenConstraint(self.tokenizer, self.config.vocab_size, grammar)
        return self._generate(ids, max_tokens, params, stop, logprobs, constraint)

    def _generate(self, ids: list[int], max_tokens: int, params: SamplingParams, stop: tuple[str, ...],
                  logprobs: int | None = None, constraint: "TokenConstraint | None" = None) -> Iterator[GenerationChunk]:
        """One sequence through the engine core (the server's scheduler runs many the same way).
        A new generate abandons a sequence still unfinished from an earlier one."""
        if not ids:
            raise InvalidArgumentError("the prompt is empty")
        for old in list(self.core.active):
            self.core.remove(old)
        seq = sequence.Sequence(self.tokenizer, ids, max_tokens, params, stop, logprobs, constraint)
        with self.core.guard():
            self.core.add(seq)
        t = self.timings
        t.prompt_tokens, t.prompt_s = len(ids) - seq.prefilled, 0.0
        t.generated_tokens, t.decode_evals, t.decode_s, t.generate_s = 0, 0, 0.0, 0.0
        t_start = 0.0
        try:
            while True:
                was_prefill = seq.in_prefill
                outs = self.core.step()
                if was_prefill:
                    t.prompt_s += self.core.prefill_s
                    t_start = time.perf_counter()
                else:
                    t.decode_s += self.core.decode_s
                    t.decode_evals += 1
                for out in outs:
                    if out.seq is seq:
                        t.generated_tokens = seq.generated
                        # kept current, so a generation stopped early (Ctrl+C, a closed iterator) reports its time too
                        t.generate_s = time.perf_counter() - t_start
                        yield from out.chunks
                if seq.done:
                    return
        finally:
            self.core.remove(seq)

    def complete(self, prompt: str | Sequence[int], max_tokens: int = 128, **kwargs: Any) -> tuple[str, str]:
        """Non-streaming generate: (text, finish_reason)."""
        parts, finish = [], "length"
        for chunk in self.generate(prompt, max_tokens, **kwargs):
            parts.append(chunk.text)
            finish = chunk.finish_reason or finish
        return "".join(parts), finish

    def render_chat(self, messages: Sequence[ChatMessage | Mapping[str, str]], add_generation_prompt: bool = True,
                    template_kwargs: Mapping[str, Any] | None = None) -> str:
        """template_kwargs: more variables for the template (e.g. Qwen3's ``enable_thinking``)."""
        if self.chat_template is None:
            raise ChatTemplateError(str(self._template_error))
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, extra=template_kwargs)

    def chat(self, messages: Sequence[ChatMessage | Mapping[str, str]], max_tokens: int = -1, **kwargs: Any) -> Iterator[GenerationChunk]:
        """Stream the assistant's reply to messages, rendered with the model's chat template."""
        return self.generate(self.chat_ids(messages), max_tokens, **kwargs)

    def chat_ids(self, messages: Sequence[ChatMessage | Mapping[str, str]], template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Token ids of messages rendered with the chat template, ready for the assistant's reply."""
        text = self.render_chat(messages, template_kwargs=template_kwargs)
        # The template already writes BOS when the model wants it; don't add a second one.
        return self.tokenize(text, add_bos=not self._template_has_bos(text), special=True)

    def _template_has_bos(self, text: str) -> bool:
        bos = self.tokenizer.bos_id
        return bos is not None and text.startswith(self.tokenizer.decode([bos], skip_special=False))

    def close(self) -> None:
        """Stop the workers and free the caches; every later use raises InvalidArgumentError."""
        self._closed = True
        self.engine.executor.close()

    def _check_open(self) -> None:
        # a closed executor's caches are freed: the native decoder would write into freed memory
        if self._closed:
            raise InvalidArgumentError("this LLM is closed; load the model again")

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
