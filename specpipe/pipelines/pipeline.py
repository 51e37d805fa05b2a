"""The application API: `generate` and `stream` over a built decoder."""
from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from specpipe.errors import InvalidRequest
from specpipe.pipelines.decoder import SpeculativeDecoder, StepOutput
from specpipe.pipelines.prompts import ChatEncoder, checked_messages, checked_stop, checked_text, is_token_ids
from specpipe.pipelines.stopping import StopCondition
from specpipe.stages.base import Augmenter
from specpipe.types import SamplingConfig

Messages = Sequence[dict]
PromptLike = str | Messages
Documents = Sequence[str] | object | None  # a list of strings, or a DocumentStore


@dataclass
class GenerationStats:
    new_tokens: int = 0
    steps: int = 0  # target forwards, the prompt's prefill included
    seconds: float = 0.0
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per step
    stage_seconds: dict[str, float] = field(default_factory=dict)  # summed over steps
    drafted_by_source: dict[str, int] = field(default_factory=dict)  # accepted draft tokens per proposer

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
                 sampling: SamplingConfig = SamplingConfig(), augmenter: Augmenter | None = None) -> None:
        self.name = name
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
        """The same target, verifier and settings with no draft sources: plain decoding through this loop."""
        decoder = SpeculativeDecoder(self.target, [], None, self.decoder.verifier)
        return Pipeline(name, decoder, self.tokenizer, chat_template=self.chat_template,
                        system_prompt=self.system_prompt, sampling=self.sampling, augmenter=self.augmenter)

    @classmethod
    def from_config(cls, overrides: Sequence[str] = ()) -> "Pipeline":
        """Composes `conf/` with Hydra-style overrides, e.g. ["pipeline=prompt_lookup", "model.dtype=bf16"]."""
        from specpipe.pipelines.builder import build_pipeline, compose_config

        return build_pipeline(compose_config(overrides))

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
    def steps(self, prompt: PromptLike | list[int] | PreparedPrompt, max_new_tokens: int = 128,
              stop: Sequence[str] = (), sampling: SamplingConfig | None = None, chat_template: bool | None = None,
              documents: Documents = None) -> Iterator[StepOutput]:
        """Every decoding step's committed tokens. A list of ints is taken as ready token ids."""
        prepared = self.prepare(prompt, documents, chat_template)
        prompt_ids = prepared.token_ids
        self._check_lengths(prompt_ids, max_new_tokens)
        stop = checked_stop(stop)
        sampling = SamplingConfig.of(sampling, self.sampling)
        if not sampling.greedy and not getattr(self.decoder.verifier, "supports_sampling", False):
            raise InvalidRequest(
                f"temperature={sampling.temperature} needs a sampling verifier; "
                f"{type(self.decoder.verifier).__name__} only decodes greedily: use temperature 0, or build the "
                f"pipeline with verifier=rejection (or verifier=typical)")
        condition = StopCondition(max_new_tokens, self.eos_token_ids, stop, self.tokenizer)
        return self.decoder.decode(prompt_ids, condition, sampling, prepared.document_ids)

    def generate(self, prompt: PromptLike | list[int] | PreparedPrompt, max_new_tokens: int = 128,
                 stop: Sequence[str] = (), sampling: SamplingConfig | None = None, chat_template: bool | None = None,
                 documents: Documents = None) -> Generation:
        """The answer with its stats; a RAG pipeline augments the prompt with retrieved chunks
        (from `documents` when given: a list of strings or a DocumentStore) and returns them too."""
        started = time.perf_counter()
        prepared = self.prepare(prompt, documents, chat_template)
        stats = GenerationStats()
        tokens: list[int] = []
        for step in self.steps(prepared, max_new_tokens, stop, sampling, chat_template):
            tokens.extend(step.tokens)
            stats.add(step)
        stats.seconds = time.perf_counter() - started
        return Generation(self.decode_text(tokens), tokens, list(prepared.token_ids), stats, list(prepared.retrieved))

    def stream(self, prompt: PromptLike | list[int] | PreparedPrompt, max_new_tokens: int = 128,
               stop: Sequence[str] = (), sampling: SamplingConfig | None = None, chat_template: bool | None = None,
               documents: Documents = None) -> Iterator[str]:
        """Yields the answer's text in chunks as decoding commits tokens."""
        text = IncrementalText(self)
        for step in self.steps(prompt, max_new_tokens, stop, sampling, chat_template, documents):
            chunk = text.push(step.tokens)
            if chunk:
                yield chunk
        tail = text.flush()
        if tail:
            yield tail

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
