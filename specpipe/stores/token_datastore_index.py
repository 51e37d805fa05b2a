"""A token datastore's arrays built in memory from token-id documents: the documents joined into one token
array with a SEPARATOR after each (cut into shards at document boundaries when asked), and that array's
suffix array with its packed prefix keys. The in-memory datastores (`TokenDatastore.from_documents`,
`ShardedTokenDatastore.from_documents`) and the builds that write a store folder
(`specpipe.stores.token_datastore_build`) all index through here, so a store held in memory and one loaded
from disk are the same arrays.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from specpipe.errors import StoreError
from specpipe.stores.token_datastore_format import SEPARATOR


def concatenate_documents(documents: Iterable[Sequence[int]], vocab_size: int | None) -> tuple[np.ndarray, int]:
    """Documents -> (tokens [n] int32 with a SEPARATOR after each document, document count)."""
    for tokens, count, _ in shards_of(enumerate(documents), None, vocab_size):
        return tokens, count
    raise StoreError("the corpus holds no tokens: every source is empty, so there is nothing to index")


def shards_of(documents: Iterable[tuple[int, Sequence[int]]], shard_tokens: int | None,
              vocab_size: int | None) -> Iterator[tuple[np.ndarray, int, int]]:
    """(number, ids) documents -> per shard (tokens [n] int32 with a SEPARATOR after each document,
    its document count, the number of the document after its last). A shard is closed by the
    document that brings it to `shard_tokens` real tokens or more (None: one shard for all), so a
    document is never split and a document longer than `shard_tokens` is a shard of its own.
    Empty documents are skipped; only the open shard is held in memory."""
    separator = np.array([SEPARATOR], dtype=np.int32)
    parts: list[np.ndarray] = []
    held, count, after = 0, 0, 0
    for number, document in documents:
        ids = _document_ids(document, number, vocab_size)
        after = number + 1
        if ids.size == 0:
            continue
        parts += [ids, separator]
        held += int(ids.size)
        count += 1
        if shard_tokens is not None and held >= shard_tokens:
            shard, closed = np.concatenate(parts), count
            parts, held, count = [], 0, 0
            yield shard, closed, after
            del shard  # written by now: not held while the next shard fills
    if parts:
        yield np.concatenate(parts), count, after


def _document_ids(document: Sequence[int], number: int, vocab_size: int | None) -> np.ndarray:
    """One document's ids as int32 [k], refused when one cannot be a token of the tokenizer."""
    ids = np.asarray(document, dtype=np.int64)
    if ids.ndim != 1:
        raise StoreError(f"document {number} is not a flat sequence of token ids (shape {ids.shape})")
    if ids.size:
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or (vocab_size is not None and high >= vocab_size) or high >= np.iinfo(np.int32).max:
            raise StoreError(f"document {number} has token id {low if low < 0 else high}, outside the tokenizer's "
                             f"0..{(vocab_size or np.iinfo(np.int32).max) - 1}: ids from another tokenizer?")
    return ids.astype(np.int32)


def index_tokens(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """tokens [n] int32 -> (suffix array [m] of the suffixes starting with a real token,
    their packed prefix keys [m] uint64, bits per key field)."""
    from pydivsufsort import divsufsort  # imported here: only builds need it

    full = divsufsort(tokens)  # [n] suffix starts, separator-led suffixes first (-1 sorts lowest)
    separators = int(np.count_nonzero(tokens == SEPARATOR))
    suffix_array = np.ascontiguousarray(full[separators:])
    suffix_array = suffix_array.astype(np.int32 if len(tokens) < np.iinfo(np.int32).max else np.int64)
    key_bits = max(1, int(tokens.max()) + 1).bit_length()  # a field holds token + 1; 0 = separator
    per_key = 64 // key_bits
    last = len(tokens) - 1
    keys = np.zeros(len(suffix_array), dtype=np.uint64)
    alive = np.ones(len(suffix_array), dtype=bool)  # no separator met yet in this suffix's head
    for position in range(per_key):
        field = tokens[np.minimum(suffix_array.astype(np.int64) + position, last)]
        alive &= field != SEPARATOR
        value = np.where(alive, field.astype(np.int64) + 1, 0).astype(np.uint64)
        keys |= value << np.uint64(key_bits * (per_key - 1 - position))
    return suffix_array, keys, key_bits
