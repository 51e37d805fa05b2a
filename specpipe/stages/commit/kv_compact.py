"""Commit: keep the accepted path's KV entries, extend the committed text."""
from __future__ import annotations

from specpipe.kv_cache import PositionIndexedCache
from specpipe.stages.base import Committer
from specpipe.types import DecodeState, DraftTree, VerifyResult


class KVCompactCommit(Committer):
    """Compacts the cache to the accepted path and appends the emitted tokens to the state.

    After a verify forward the cache holds [committed | root | n tree nodes]. The emitted
    tokens are the accepted nodes then the bonus, possibly cut short by a stop condition;
    the last emitted token becomes the new root, so its entry (if it had one) is dropped
    to keep the invariant "the cache covers every committed token but the last".
    """

    def commit(self, state: DecodeState, cache: PositionIndexedCache, tree: DraftTree, result: VerifyResult,
               emitted: list[int]) -> None:
        start = len(state.tokens) - 1  # cache rows before this step's forward
        kept_nodes = result.accepted[: len(emitted) - 1]
        cache.keep(start, [0] + [node + 1 for node in kept_nodes])  # the root, then the kept path
        state.tokens.extend(emitted)
        last_row = kept_nodes[-1] + 1 if kept_nodes else 0
        if result.hidden is not None:
            state.hidden = result.hidden[last_row]
        state.logits = result.logits[last_row]
