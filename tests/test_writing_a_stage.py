"""A Retrieve stage written against specpipe.stages.base alone (docs/WRITING_A_STAGE.md walks through it), named
by config like the shipped ones: the builder and the decoder need nothing else of it, the output is plain greedy
decoding token for token, and its drafts are accepted."""
from __future__ import annotations

from dataclasses import dataclass, field

from specpipe.pipelines.builder import build_pipeline
from specpipe.stages.base import Proposer
from specpipe.types import DecodeState, Proposal, VerifyResult


@dataclass
class SnippetRecord:
    """SnippetMemory's state for one sequence (in `state.stage_state`): what it proposed this step, what the
    target accepted of its proposals so far."""

    committed: int  # len(state.tokens) at the last commit
    proposed: list[int] = field(default_factory=list)
    accepted: int = 0


class SnippetMemory(Proposer):
    """Drafts from a tiny in-memory database: every `key_length` tokens of the texts it was given, mapped to the
    `max_length` tokens that followed them. Where the last committed tokens are a key, it proposes what followed."""

    def __init__(self, name: str = "memory", key_length: int = 2, max_length: int = 6) -> None:
        self.name = name
        self.key_length = key_length
        self.max_length = max_length
        self.snippets: dict[tuple[int, ...], list[int]] = {}  # shared by every sequence: read-only while decoding

    def remember(self, tokens: list[int]) -> None:
        for start in range(len(tokens) - self.key_length):
            key = tuple(tokens[start:start + self.key_length])
            self.snippets.setdefault(key, tokens[start + self.key_length:start + self.key_length + self.max_length])

    def reset(self, state: DecodeState) -> None:
        state.stage_state[self] = SnippetRecord(committed=len(state.tokens))

    def propose(self, state: DecodeState) -> Proposal:
        record: SnippetRecord = state.stage_state[self]
        record.proposed = self.snippets.get(tuple(state.tokens[-self.key_length:]), [])
        if not record.proposed:
            return Proposal.empty(self.name)
        # a node's score: its estimated chance of acceptance, never above its parent's
        return Proposal.chain(record.proposed, [0.8 ** (depth + 1) for depth in range(len(record.proposed))],
                              self.name)

    def on_commit(self, state: DecodeState, result: VerifyResult) -> None:
        record: SnippetRecord = state.stage_state[self]
        new = state.tokens[record.committed:]
        for proposed, committed in zip(record.proposed, new[:-1]):  # the last committed token is the target's own
            if proposed != committed:
                break
            record.accepted += 1
        record.committed = len(state.tokens)
        record.proposed = []  # a step that skips `propose` must not count this step's proposal again


def memory_pipeline(model):
    """lookahead_trie with SnippetMemory in place of its n-gram retriever, by config alone."""
    cfg = model.config("lookahead_trie", "~pipeline.proposers.ngram",
                       f"+pipeline.proposers.memory._target_={__name__}.SnippetMemory")
    pipe = build_pipeline(cfg, loaded=model.loaded)
    (memory,) = pipe.decoder.proposers
    assert isinstance(memory, SnippetMemory)
    return pipe, memory


def test_a_stage_written_against_base_drafts_and_stays_lossless(tiny_mixed):
    prompts = [[400, 401, 402, 403, 404, 405], [611, 97, 2048, 611, 97, 300, 12]]
    references = [tiny_mixed.greedy_hf(prompt, 24) for prompt in prompts]
    pipe, memory = memory_pipeline(tiny_mixed)
    first = pipe.generate(prompts[0], max_new_tokens=24)
    assert first.token_ids == references[0]
    assert first.stats.drafted_by_source.get("memory", 0) == 0  # an empty database drafts nothing

    # The database holds the first answer as it is, and the second with every fifth token wrong: drafts of
    # the first are accepted, some of the second's rejected, and the output is plain greedy all the same.
    memory.remember(prompts[0] + references[0])
    memory.remember([token if i % 5 != 4 else token + 1 for i, token in enumerate(prompts[1] + references[1])])
    answers = pipe.generate_many(prompts, max_new_tokens=24)  # one batch: per-sequence state in stage_state
    for answer, reference in zip(answers, references):
        assert answer.token_ids == reference
    drafted = answers[0].stats.drafted_by_source.get("memory", 0)
    assert drafted >= 12, f"the remembered answer was drafted: {answers[0].stats.summary()}"
    assert answers[0].stats.steps < first.stats.steps  # fewer target forwards than without drafts
    assert sum(answer.stats.drafted_by_source.get("memory", 0) for answer in answers) > drafted
