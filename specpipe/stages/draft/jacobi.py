"""Lookahead Decoding (Fu et al., 2024): the target drafts for itself by Jacobi iteration.

The lookahead branch keeps a 2D window of guessed tokens for the positions after the root:
N - 1 levels of W columns, one Jacobi iteration apart. Column 0 of level 0 is the root itself
(the last committed token); level 0 holds W - 1 more guesses, levels 1..N-2 hold W each. The
token of level l in column j sits at position root + l + j and sees (besides the committed
text) level 0 up to column j, then column j of levels 1..l: a trajectory of consecutive
positions. One argmax over the last level's rows is a Jacobi update of every column; each
column's trajectory plus its new token is an N-gram, stored in a pool keyed by its first
token. The verification branch proposes the pool's N-grams that start with the root. Both
branches share one target forward: the window rides as extra query rows (`LookaheadRows`)
that no tree node sees and that see no tree node. N = 2 is plain Jacobi decoding: one level,
whose own update is the next guess.
"""
from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specpipe.errors import ConfigError
from specpipe.stages.base import LookaheadBranch, LookaheadRows, Proposer
from specpipe.stages.retrieve.calibration import AcceptanceCalibration
from specpipe.stages.retrieve.continuation_trie import ContinuationTrie, TrieSequence
from specpipe.types import DecodeState, Proposal, VerifyResult

# The calibration's bucket for pool n-grams: all of them are matched on one token (the root).
POOL_MATCH_LENGTH = 1


@dataclass
class JacobiSequence(TrieSequence):
    """JacobiDrafter's per-request state.

    `levels[0]` holds the guesses for columns 1..s of level 0 (column 0 is the root), `levels[l]`
    for l >= 1 the guesses for columns 0..s of level l; s = W - 1 once the window is full. While
    it fills (the first N - 2 steps) there are fewer levels and level 0 is longer, as in the
    reference implementation: each step appends the new level and trims one column off the
    front of every level, since the root moved on by one position.
    """

    calibration: AcceptanceCalibration = field(default_factory=AcceptanceCalibration)
    levels: list[list[int]] = field(default_factory=list)
    # first token -> its continuations (N - 1 tokens each), least recently harvested first
    pool: dict[int, OrderedDict[tuple[int, ...], None]] = field(default_factory=dict)
    # argmax of the last level's rows from this step's forward, columns 0..s (column 0 of level 0
    # is the root's own row); consumed by the window shift at commit
    update: list[int] | None = None
    rows_at: int = 0  # len(state.tokens) when the window's rows were built (root = tokens[rows_at - 1])
    filler: list[int] = field(default_factory=list)  # tokens that initialise and pad the window
    rng: random.Random = field(default_factory=random.Random)


class JacobiDrafter(Proposer, LookaheadBranch):
    """`drafter=jacobi`: Lookahead Decoding with window W, n-gram size N and guess set G.

    Per step: `propose` hands the tree builder up to G pool n-grams that start with the root,
    merged into a trie (scored by how often each branch recurs among them times an online
    calibration of what the target accepted, so the builder's cost-curve choice can cut them);
    `lookahead_rows` adds the window's W (N - 1) - 1 rows to the verify forward; `on_lookahead`
    takes their argmax (the Jacobi update) and harvests the new n-grams; `on_commit` shifts the
    window by one level. The reference implementation shifts by one level whatever was accepted
    (its default), keeping every trajectory whole; `follow_accepted=True` shifts the columns
    as far as the root moved too (its other mode) and pads the end with prompt tokens.
    `pool_from_prompt=True` also seeds the pool with the prompt's own n-grams (the reference's
    POOL_FROM_PROMPT option), which turns the verification branch partly into prompt lookup.
    """

    def __init__(self, window: int = 5, ngram: int = 3, guesses: int = 5, name: str = "jacobi",
                 follow_accepted: bool = False, pool_from_prompt: bool = False, seed: int = 0,
                 prior: float = 0.5) -> None:
        for label, value, least in (("window (W)", window, 1), ("ngram (N)", ngram, 2), ("guesses (G)", guesses, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(f"drafter {name!r}: {label} must be an integer >= {least}, got {value!r}"
                                  + (" (N = 2 is plain Jacobi decoding; N counts the root)" if least == 2 else ""))
        if not 0.0 < prior <= 1.0:
            raise ConfigError(f"drafter {name!r}: prior must be in (0, 1], got {prior!r}")
        self.name = name
        self.window, self.ngram, self.guesses = window, ngram, guesses
        self.follow_accepted = follow_accepted
        self.pool_from_prompt = pool_from_prompt
        self.seed = seed
        self.prior = prior

    @property
    def level_count(self) -> int:
        """N - 1: the window's levels once full."""
        return self.ngram - 1

    # ---- the Proposer protocol --------------------------------------------------------------

    def reset(self, state: DecodeState) -> None:
        """The window starts as random prompt tokens (the reference implementation's choice): level 0
        holds W + N - 3 of them, enough to lose one column per step while the other levels fill."""
        sequence = JacobiSequence(AcceptanceCalibration(prior=self.prior))
        sequence.filler = list(state.tokens[:state.prompt_length]) or list(state.tokens)
        # Seeded per request from its prompt: the same request drafts the same way every time.
        sequence.rng = random.Random(hash((self.seed, tuple(sequence.filler))))
        first_level = self.window - 1 + (self.level_count - 1)
        sequence.levels = [self._fill(sequence, first_level)]
        if self.pool_from_prompt:
            prompt = state.tokens[:state.prompt_length]
            for start in range(len(prompt) - self.level_count):
                add_gram(sequence.pool, prompt[start], tuple(prompt[start + 1:start + self.ngram]), self.guesses)
        sequence.proposed_at = len(state.tokens)
        state.stage_state[self] = sequence

    def propose(self, state: DecodeState) -> Proposal:
        sequence: JacobiSequence = state.stage_state[self]
        trie = ContinuationTrie()
        grams = sequence.pool.get(state.tokens[-1])
        if grams:
            for gram in list(grams)[-self.guesses:]:  # the most recently harvested G
                trie.add(gram, POOL_MATCH_LENGTH)
        return sequence.propose(trie, len(state.tokens), self.name)

    def on_commit(self, state: DecodeState, result: VerifyResult) -> None:
        sequence: JacobiSequence = state.stage_state[self]
        sequence.learn(state.tokens)
        if sequence.update is None:  # no rows rode along this step (W = 1, N = 2: no window)
            return
        moved = len(state.tokens) - sequence.rows_at  # tokens committed this step, >= 1
        self._shift(sequence, moved)
        sequence.update = None  # used: a step without the window's rows (a plain step of a batch) shifts nothing

    def on_finish(self, state: DecodeState) -> None:
        pass

    # ---- the LookaheadBranch protocol -------------------------------------------------------

    def lookahead_rows(self, state: DecodeState) -> LookaheadRows | None:
        sequence: JacobiSequence = state.stage_state[self]
        sequence.rows_at = len(state.tokens)
        sequence.update = None
        tokens, positions, mask = window_rows(sequence.levels, root_position=len(state.tokens) - 1)
        if not tokens.shape[0]:
            return None
        return LookaheadRows(tokens, positions, mask)

    def on_lookahead(self, state: DecodeState, logits: Tensor) -> None:
        """logits [1 + r, vocab]: the root's row, then the window's rows in `window_rows` order."""
        sequence: JacobiSequence = state.stage_state[self]
        sequence.update = jacobi_update(sequence.levels, logits)
        if len(sequence.levels) == self.level_count:  # a full window: every column is an N-gram trajectory
            harvest(sequence.pool, state.tokens[-1], sequence.levels, sequence.update, self.guesses)

    # ---- the window ---------------------------------------------------------------------------

    def _shift(self, sequence: JacobiSequence, moved: int) -> None:
        """After a commit the root moved on: the levels drop what now lies at or before it."""
        levels, update = sequence.levels, sequence.update
        sequence.update = None
        if len(levels) < self.level_count:
            # Filling: the update becomes a new level. Its column j + 1 predicted the token at
            # position root + l + j + 2, which is column j of the new level once the root moved by one.
            sequence.levels = [level[1:] for level in levels] + [update[1:]]
            return
        # Full: each level moves up one (level 0, the oldest iteration, is dropped) and the update
        # becomes the last level; column 0 of the new level 0 is where the new root is.
        shifted = levels[1:] + [update]
        shifted[0] = shifted[0][1:]
        extra = moved - 1 if self.follow_accepted else 0
        if extra:
            # The root moved `moved` positions: drop the columns that now lie before it, keeping each
            # token at its position, and pad the window back to W columns with prompt tokens.
            shifted = [level[extra:] + self._fill(sequence, min(extra, len(level))) for level in shifted]
        sequence.levels = shifted

    @staticmethod
    def _fill(sequence: JacobiSequence, count: int) -> list[int]:
        return [sequence.rng.choice(sequence.filler) for _ in range(count)]


def window_rows(levels: list[list[int]], root_position: int) -> tuple[Tensor, Tensor, Tensor]:
    """The window as query rows: tokens [r], positions [r], mask [r, 1 + r] over [root | rows].

    Rows are level 0's columns 1..s, then each level l >= 1's columns 0..s. Level 0 is causal
    (column j sees the root and columns 1..j); level l's column j sees level 0 up to column j
    (the root is its column 0) and column j of levels 1..l.
    """
    first = levels[0]
    span = len(first)  # s: level 0's columns beyond the root
    tokens = list(first)
    positions = [root_position + column for column in range(1, span + 1)]
    for level_index, level in enumerate(levels[1:], start=1):
        assert len(level) == span + 1, f"level {level_index} has {len(level)} columns, level 0 has {span} + root"
        tokens += level
        positions += [root_position + level_index + column for column in range(span + 1)]
    rows = len(tokens)
    mask = torch.zeros(rows, 1 + rows, dtype=torch.bool)  # [r, 1 + r], index 0 = root, i + 1 = row i

    def index(level_index: int, column: int) -> int:  # in [root | rows] coordinates
        if level_index == 0:
            return column  # column 0 is the root
        return 1 + span + (level_index - 1) * (span + 1) + column

    for level_index in range(len(levels)):
        for column in range(1 if level_index == 0 else 0, span + 1):
            row = index(level_index, column) - 1
            mask[row, : column + 1] = True  # the root and level 0's columns 1..column
            for upper in range(1, level_index + 1):
                mask[row, index(upper, column)] = True
    return torch.tensor(tokens, dtype=torch.long), torch.tensor(positions, dtype=torch.long), mask


def jacobi_update(levels: list[list[int]], logits: Tensor) -> list[int]:
    """logits [1 + r, vocab] (root row, then `window_rows` order) -> the greedy next token after each
    column of the last level, columns 0..s (level 0's column 0 is the root, so its row comes first)."""
    span = len(levels[0])
    if len(levels) == 1:
        last = logits[: 1 + span]  # [1 + s, vocab]: the root, then level 0's columns 1..s
    else:
        last = logits[logits.shape[0] - (span + 1):]  # [1 + s, vocab]: the last level's rows
    return last.argmax(dim=-1).tolist()


def harvest(pool: dict[int, OrderedDict[tuple[int, ...], None]], root: int, levels: list[list[int]],
            update: list[int], per_token: int) -> None:
    """Adds each column's trajectory (level 0's token, levels 1.., then the update) as an n-gram,
    keyed by its first token; a key keeps its `per_token` most recently harvested n-grams."""
    first_row = [root, *levels[0]]
    for column, new_token in enumerate(update):
        add_gram(pool, first_row[column], tuple(level[column] for level in levels[1:]) + (new_token,), per_token)


def add_gram(pool: dict[int, OrderedDict[tuple[int, ...], None]], key: int, gram: tuple[int, ...],
             per_token: int) -> None:
    """`gram` (what follows `key`) becomes `key`'s most recent n-gram; the least recent beyond
    `per_token` is forgotten (the reference's LRU guess set)."""
    grams = pool.setdefault(key, OrderedDict())
    if gram in grams:
        grams.move_to_end(gram)
    else:
        grams[gram] = None
        if len(grams) > per_token:
            grams.popitem(last=False)
