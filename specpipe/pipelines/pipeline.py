"""The application API: `generate` and `stream` over a built decoder."""
from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

import specpipe.distributed as distributed
from specpipe.errors import InvalidRequest
from specpipe.pipelines.decoder import SpeculativeDecoder, StepOutput
from specpipe.pipelines.prompts import ChatEncoder, checked_messages, checked_stop, checked_text, is_token_ids
from specpipe.pipelines.stopping import StopCondition
from specpipe.serving.handle import DecodeRequest, RequestHandle
from specpipe.serving.scheduler import BatchScheduler, SchedulerLimits
from specpipe.stages.base import Augmenter
from specpipe.types import SamplingConfig

Messages = Sequence[dict]
PromptLike = str | Messages
Documents = Sequence[str] | object | None  # a list of strings, or a DocumentStore

# What Pipeline.from_config builds with: specpipe.pipelines.builder's compose-and-build, which the package
# specpipe.pipelines sets with `use_config_builder` when it is imported (before this module can be). The builder
# makes Pipelines, so this module does not import it back.
_config_builder: Callable[[Sequence[str], Sequence], "Pipeline"] | None = None


def use_config_builder(build: Callable[[Sequence[str], Sequence], "Pipeline"]) -> None:
    """Makes Pipeline.from_config(overrides, config_dirs) return `build(overrides, config_dirs)`."""
    global _config_builder
    _config_builder = build


@dataclass
class GenerationStats:
    new_tokens: int = 0
    steps: int = 0  # target forwards, the prompt's prefill included
    seconds: float = 0.0
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per step
    stage_seconds: dict[str, float] = field(default_factory=dict)  # summed over steps
    drafted_by_source: dict[str, int] = field(default_factory=dict)  # accepted draft tokens per proposer
    reused_prompt_tokens: int = 0  # prompt tokens whose rows the prefix cache gave (prefix_cache.*)

    @property
    def mean_accepted(self) -> float:
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def add(self, step: StepOutput) -> None:
        self.new_tokens += len(step.tokens)
        self.steps += 1
        self.accept_lengths.append(len(step.tokens))
        self.reused_prompt_tokens += step.reused_prompt_tokens
        for stage, seconds in step.stats.seconds.items():
            self.stage_seconds[stage] = self.stage_seconds.get(stage, 0.0) + seconds
        for source, count in step.stats.drafted_by_source.items():
            self.drafted_by_source[source] = self.drafted_by_source.get(source, 0) + count

    def summary(self) -> str:
        per_step = " ".join(f"{stage} {1000 * s / self.steps:.1f}" for stage, s in self.stage_seconds.items()
                            if stage != "prefill")
        prefill = 1000 * self.stage_seconds.get("prefill", 0.0)
        sources = ", ".join(f"{source} {count}" for source, count in sorted(self.drafted_by_source.items()))
        return (f"{self.new_tokens} tokens in {self.steps} steps | mean accepted {self.mean_accepted:.2f} | "
                f"{self.tokens_per_second:.1f} tok/s | prefill {prefill:.0f} ms | per step (ms): {per_step}"
                + (f" | drafted tokens by source: {sources}" if sources else ""))


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    stats: GenerationStats
    retrieved: list = field(default_factory=list)  # RetrievedChunk: the documents the prompt was augmented with
    # why decoding stopped: "eos", "stop_string" or "length" (max_new_tokens); None where it did not end itself
    finish_reason: str | None = None


@dataclass(frozen=True)
class PreparedPrompt:
    """A request's prompt as the target sees it: token ids after retrieval, template and chat template."""

    token_ids: list[int]
    retrieved: tuple = ()  # RetrievedChunk, best first (RAG pipelines)
    document_ids: tuple[tuple[int, ...], ...] = ()  # [chunk][tokens] the retrieved chunks' token ids


class Pipeline:
    """A built speculative-decoding pipeline for one target model.

    `generate("question")` or `generate([{"role": "user", "content": ...}, ...])` returns
    text, token ids and stats; `stream(...)` yields text chunks as they are committed.
    Chat models get their chat template applied unless `chat_template=False`.
    """

    def __init__(self, name: str, decoder: SpeculativeDecoder, tokenizer: PreTrainedTokenizerBase,
                 chat_template: bool = True, system_prompt: str | None = None,
                 sampling: SamplingConfig = SamplingConfig(), augmenter: Augmenter | None = None,
                 limits: SchedulerLimits = SchedulerLimits()) -> None:
        self.name = name
        self.limits = limits  # the batch engine's: requests decoded at once, queued, tokens in flight
        self._scheduler: BatchScheduler | None = None
        self.augmenter = augmenter  # RAG: retrieves documents and writes them into the prompt
        self.decoder = decoder
        self.target = decoder.target
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.system_prompt = system_prompt
        self.sampling = sampling
        eos = getattr(self.target.model.generation_config, "eos_token_id", None)
        eos = eos if isinstance(eos, list) else [eos]
        self.eos_token_ids = frozenset(e for e in eos + [tokenizer.eos_token_id] if e is not None)
        self._chat = ChatEncoder(tokenizer)

    def without_drafting(self, name: str = "vanilla") -> "Pipeline":
        """The same target, verifier and settings with no draft sources: plain decoding through this loop (with a
        prefix cache of its own like this pipeline's, so that both prefill alike and neither reuses the other's)."""
        prefixes = self.decoder.prefix_cache
        decoder = SpeculativeDecoder(self.target, [], None, self.decoder.verifier, self.decoder.committer,
                                     prefix_cache=prefixes.empty_copy() if prefixes is not None else None)
        return Pipeline(name, decoder, self.tokenizer, chat_template=self.chat_template,
                        system_prompt=self.system_prompt, sampling=self.sampling, augmenter=self.augmenter,
                        limits=self.limits)

    @classmethod
    def from_config(cls, overrides: Sequence[str] = (), config_dirs: Sequence = ()) -> "Pipeline":
        """Composes the package's `conf/` with Hydra-style overrides, e.g. ["pipeline=prompt_lookup",
        "model.dtype=bf16"]. `config_dirs`: folders of your own config groups, searched after the shipped ones
        (a `pipeline/mine.yaml` there is `pipeline=mine`)."""
        if _config_builder is None:  # only while specpipe.pipelines is being imported
            raise RuntimeError("Pipeline.from_config: specpipe.pipelines has not finished importing its builder")
        return _config_builder(overrides, config_dirs)

    # ---- prompts -------------------------------------------------------------------
    def encode(self, prompt: PromptLike, chat_template: bool | None = None) -> list[int]:
        """Token ids for a prompt string or a list of chat messages. Message text never becomes a control
        token of the chat template (ChatEncoder); a plain string without the template is tokenized as the
        model's raw input, its control tokens included."""
        use_template = self.chat_template if chat_template is None else chat_template
        if use_template is not None and not isinstance(use_template, bool):
            raise InvalidRequest(f"chat_template must be true, false or null, got {use_template!r}")
        has_template = getattr(self.tokenizer, "chat_template", None) is not None
        if isinstance(prompt, str):
            checked_text(prompt, "the prompt")
            if not prompt.strip():
                raise InvalidRequest("the prompt is empty; give some text to continue")
            if not (use_template and has_template):
                return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, (list, tuple)):
            messages = checked_messages(prompt)
            if not has_template:
                raise InvalidRequest(
                    f"model {self.target.name!r} has no chat template, so chat messages cannot be formatted; "
                    f"pass a plain prompt string instead")
        else:
            raise InvalidRequest(f"the prompt must be a string, a list of chat messages ({{'role', 'content'}}) or a "
                                 f"list of token ids, got {type(prompt).__name__}")
        if self.system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}] + messages
        return self._chat.encode(messages)

    # ---- retrieval (RAG) ------------------------------------------------------------------
    def retrieve(self, question: str, documents: Documents = None, k: int | None = None) -> list:
        """The chunks a RAG pipeline would put into the prompt for `question`, with their scores:
        from `documents` (a list of strings, or a DocumentStore) or the configured store."""
        if self.augmenter is None:
            raise InvalidRequest(f"pipeline {self.name!r} does not retrieve documents: use a pipeline with an "
                                 f"augment stage, e.g. pipeline=rag_lookahead")
        return self.augmenter.retrieve(question, documents, k)

    def prepare(self, prompt: PromptLike | list[int] | PreparedPrompt, documents: Documents = None,
                chat_template: bool | None = None) -> PreparedPrompt:
        """The token ids the target will see. A RAG pipeline first retrieves chunks for the question
        (the prompt string, or the last user message) and renders them into it. A list of ints is
        taken as ready token ids, a PreparedPrompt as it is."""
        if isinstance(prompt, PreparedPrompt):
            return prompt
        token_ids = is_token_ids(prompt)
        if self.augmenter is None or token_ids:
            if documents is not None:
                raise InvalidRequest("documents were given but " + (
                    "the prompt is token ids, which cannot be augmented" if token_ids else
                    f"pipeline {self.name!r} does not retrieve documents (use e.g. pipeline=rag_lookahead)"))
            return PreparedPrompt(list(prompt) if token_ids else self.encode(prompt, chat_template))
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": checked_text(prompt, "the prompt")}]
        elif isinstance(prompt, (list, tuple)):
            messages = checked_messages(prompt)
        else:
            return PreparedPrompt(self.encode(prompt, chat_template))  # encode() explains what is wrong
        users = [i for i, message in enumerate(messages) if message["role"] == "user"]
        if not users:
            return PreparedPrompt(self.encode(prompt, chat_template))
        question = messages[users[-1]]["content"]
        chunks = self.augmenter.retrieve(question, documents)
        messages[users[-1]]["content"] = self.augmenter.render(question, chunks)
        augmented = messages[0]["content"] if isinstance(prompt, str) else messages
        document_ids = tuple(tuple(self.tokenizer(chunk.text, add_special_tokens=False)["input_ids"])
                             for chunk in chunks)
        return PreparedPrompt(self.encode(augmented, chat_template), tuple(chunks), document_ids)

    def _check_lengths(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise InvalidRequest(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if not prompt_ids:
            raise InvalidRequest("the prompt encodes to no tokens")
        vocab = self.target.vocab_size
        outside = [t for t in prompt_ids if not 0 <= t < vocab]
        if outside:
            raise InvalidRequest(f"prompt token ids must lie in [0, {vocab}) for model {self.target.name!r}; "
                                 f"got {outside[:5]}")
        context = self.target.context_length
        if context and len(prompt_ids) >= context:
            raise InvalidRequest(
                f"the prompt has {len(prompt_ids)} tokens but model {self.target.name!r} has a context of "
                f"{context}; shorten the prompt")
        if context and len(prompt_ids) + max_new_tokens > context:
            raise InvalidRequest(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the context of "
                f"model {self.target.name!r} ({context}); lower max_new_tokens to at most "
                f"{context - len(prompt_ids)}")

    # ---- decoding ------------------------------------------------------------------
    def request(self, prompt: PromptLike | list[int] | PreparedPrompt, max_new_tokens: int = 128,
                stop: Sequence[str] | str | None = (), sampling: SamplingConfig | Mapping | None = None,
                chat_template: bool | None = None, documents: Documents = None) -> DecodeRequest:
        """The request checked (every argument, cheapest first) and prepared (retrieval, chat template), ready to
        decode; raises InvalidRequest with what is wrong. What `submit` and the decoding calls run first."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise InvalidRequest(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        stop = checked_stop(stop)
        sampling = SamplingConfig.of(sampling, self.sampling)
        if not sampling.greedy and not self.decoder.verifier.supports_sampling:
            raise InvalidRequest(
                f"temperature={sampling.temperature} needs a sampling verifier; "
                f"{type(self.decoder.verifier).__name__} only decodes greedily: use temperature 0, or build the "
                f"pipeline with verifier=rejection (or verifier=typical)")
        prepared = self.prepare(prompt, documents, chat_template)
        self._check_lengths(prepared.token_ids, max_new_tokens)
        condition = StopCondition(max_new_tokens, self.eos_token_ids, stop, self.tokenizer)
        return DecodeRequest(list(prepared.token_ids), max_new_tokens, condition, sampling, prepared.document_ids,
                             tuple(prepared.retrieved))

    @property
    def scheduler(self) -> BatchScheduler:
        """The batch engine every request of this pipeline goes through (its thread starts with the first)."""
        if self._scheduler is None:
            self._scheduler = BatchScheduler(self.decoder, self.limits)
        return self._scheduler

    def submit(self, prompt: PromptLike | list[int] | PreparedPrompt, max_new_tokens: int = 128,
               stop: Sequence[str] | str | None = (), sampling: SamplingConfig | Mapping | None = None,
               chat_template: bool | None = None, documents: Documents = None) -> RequestHandle:
        """Queues a request for the batch engine and returns at once: read its committed steps with
        `handle.steps()` (or `result(handle)`, `stream(handle)`), or `cancel()` it. Requests submitted from any
        thread are decoded together, all of them verified in one target forward per step. Raises InvalidRequest
        (a bad argument) or Overloaded (the queue is full) at once."""
        return self.scheduler.submit(self.request(prompt, max_new_tokens, stop, sampling, chat_template, documents))

    def steps(self, prompt: PromptLike | list[int] | PreparedPrompt, max_new_tokens: int = 128,
              stop: Sequence[str] | str | None = (), sampling: SamplingConfig | Mapping | None = None,
              chat_template: bool | None = None, documents: Documents = None) -> Iterator[StepOutput]:
        """Every decoding step's committed tokens. A list of ints is taken as ready token ids. The request is
        checked before this returns; closing the iterator early cancels it."""
        request = self.request(prompt, max_new_tokens, stop, sampling, chat_template, documents)
        if distributed.active():  # tensor-parallel ranks step in lockstep: each decodes its request in this thread
            return self.decoder.decode(request.prompt_ids, request.stop, request.sampling, request.document_ids)
        return self.scheduler.submit(request).steps()

    def generate(self, prompt: PromptLike | list[int] | PreparedPrompt, max_new_tokens: int = 128,
                 stop: Sequence[str] | str | None = (), sampling: SamplingConfig | Mapping | None = None,
                 chat_template: bool | None = None, documents: Documents = None) -> Generation:
        """The answer with its stats; a RAG pipeline augments the prompt with retrieved chunks
        (from `documents` when given: a list of strings or a DocumentStore) and returns them too."""
        started = time.perf_counter()
        request = self.request(prompt, max_new_tokens, stop, sampling, chat_template, documents)
        if distributed.active():
            steps = self.decoder.decode(request.prompt_ids, request.stop, request.sampling, request.document_ids)
        else:
            steps = self.scheduler.submit(request).steps()
        return self._generation(steps, started, lambda: request)

    def result(self, handle: RequestHandle, timeout: float | None = None) -> Generation:
        """A submitted request's answer, once it is complete (its errors raised here)."""
        return self._generation(handle.steps(timeout), handle.submitted, lambda: handle.request)

    def generate_many(self, prompts: Sequence[PromptLike | list[int]], max_new_tokens: int = 128,
                      stop: Sequence[str] | str | None = (), sampling: SamplingConfig | Mapping | None = None,
                      chat_template: bool | None = None) -> list[Generation]:
        """Answers for several prompts, decoded together by the batch engine (the same settings for each; submit
        them one by one for per-request settings). Every prompt is checked before any is decoded."""
        requests = [self.request(prompt, max_new_tokens, stop, sampling, chat_template) for prompt in prompts]
        started = time.perf_counter()
        handles = []
        try:
            for request in requests:
                handles.append(self.scheduler.submit(request))
            return [self._generation(handle.steps(), started, lambda: handle.request) for handle in handles]
        finally:
            for handle in handles:
                if not handle.done:
                    handle.cancel()

    def stream(self, prompt: PromptLike | list[int] | PreparedPrompt | RequestHandle, max_new_tokens: int = 128,
               stop: Sequence[str] | str | None = (), sampling: SamplingConfig | Mapping | None = None,
               chat_template: bool | None = None, documents: Documents = None) -> Iterator[str]:
        """Yields the answer's text in chunks as decoding commits tokens (of a submitted request's handle too)."""
        steps = prompt.steps() if isinstance(prompt, RequestHandle) else \
            self.steps(prompt, max_new_tokens, stop, sampling, chat_template, documents)
        yield from self._text_chunks(steps)

    async def agenerate(self, prompt: PromptLike | list[int] | PreparedPrompt, max_new_tokens: int = 128,
                        stop: Sequence[str] | str | None = (), sampling: SamplingConfig | Mapping | None = None,
                        chat_template: bool | None = None, documents: Documents = None) -> Generation:
        """`generate` for asyncio: the request is prepared in a worker thread (retrieval, tokenization) and
        decoded by the batch engine; the event loop is never blocked."""
        started = time.perf_counter()
        handle = await self.asubmit(prompt, max_new_tokens, stop, sampling, chat_template, documents)
        return self._generation([step async for step in handle.asteps()], started, lambda: handle.request)

    async def astream(self, prompt: PromptLike | list[int] | PreparedPrompt, max_new_tokens: int = 128,
                      stop: Sequence[str] | str | None = (), sampling: SamplingConfig | Mapping | None = None,
                      chat_template: bool | None = None, documents: Documents = None) -> AsyncIterator[str]:
        """`stream` for asyncio."""
        handle = await self.asubmit(prompt, max_new_tokens, stop, sampling, chat_template, documents)
        text = IncrementalText(self)
        async for step in handle.asteps():
            chunk = text.push(step.tokens)
            if chunk:
                yield chunk
        tail = text.flush()
        if tail:
            yield tail

    async def asubmit(self, prompt: PromptLike | list[int] | PreparedPrompt, max_new_tokens: int = 128,
                      stop: Sequence[str] | str | None = (), sampling: SamplingConfig | Mapping | None = None,
                      chat_template: bool | None = None, documents: Documents = None) -> RequestHandle:
        """`submit` for asyncio (read the handle with `asteps()`). The request is checked and prepared by the
        engine's thread (retrieval runs torch, which belongs there): its errors come from the handle."""
        return self.scheduler.submit(functools.partial(self.request, prompt, max_new_tokens, stop, sampling,
                                                       chat_template, documents))

    def _text_chunks(self, steps: Iterable[StepOutput]) -> Iterator[str]:
        text = IncrementalText(self)
        for step in steps:
            chunk = text.push(step.tokens)
            if chunk:
                yield chunk
        tail = text.flush()
        if tail:
            yield tail

    def _generation(self, steps: Iterable[StepOutput], started: float, request_of: Callable[[], DecodeRequest]
                    ) -> Generation:
        """The Generation of `steps` (all of them read here); `request_of` gives the request once they are."""
        stats = GenerationStats()
        tokens: list[int] = []
        for step in steps:
            tokens.extend(step.tokens)
            stats.add(step)
        stats.seconds = time.perf_counter() - started
        request = request_of()
        return Generation(self.decode_text(tokens), tokens, list(request.prompt_ids), stats, list(request.retrieved),
                          finish_reason=request.stop.reason)

    def decode_text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


class IncrementalText:
    """Turns committed tokens into new text, holding back incomplete UTF-8 sequences."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.tokens: list[int] = []
        self.emitted = 0  # characters already returned

    def push(self, tokens: list[int]) -> str:
        self.tokens.extend(tokens)
        text = self.pipeline.decode_text(self.tokens)
        if text.endswith("\ufffd"):
            return ""  # a multi-byte character is split across tokens: wait for the rest
        chunk, self.emitted = text[self.emitted:], len(text)
        return chunk

    def flush(self) -> str:
        text = self.pipeline.decode_text(self.tokens)
        chunk, self.emitted = text[self.emitted:], len(text)
        return chunk
