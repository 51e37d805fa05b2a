"""The on-disk format of a REST token datastore: the files a store folder holds, its format versions, the
separator that ends every document, and the checks that refuse a folder whose arrays cannot be the store its
manifest describes. The builds that write a store and the loaders that memory-map it both take the layout
from here, so the two cannot drift apart; the comments on the constants below are the format's specification
(16 bytes per token: 4 + 4 + 8, written atomically by `specpipe.stores.manifest.write_store`).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from specpipe.errors import StoreError
from specpipe.stores.manifest import StoreManifest, tokenizer_fingerprint

KIND = "token_datastore"
FORMAT_VERSION = 1  # one suffix array: a one-shard store, and every shard of a sharded one
# A folder of shards `shard-00000/`, `shard-00001/`, ... cut at document boundaries, each a complete format-1
# store with its own manifest; the top-level manifest lists the shards and every file under the folder.
SHARDED_FORMAT_VERSION = 2  # a folder of shards, each a format-1 store
# Follows every document in the tokens. No real token is negative, so no pattern matches across a separator,
# and a continuation read after a match stops at one.
SEPARATOR = -1
# int32 [n]: every document's token ids, each document followed by SEPARATOR; the array always ends with one.
TOKENS_FILE = "tokens.npy"
# int32 (int64 past 2**31 tokens) [m]: the start of every suffix that begins with a real token, in
# lexicographic order (-1 sorts below every token; suffixes starting at a separator come first in the full
# array and are dropped).
SUFFIX_ARRAY_FILE = "suffix_array.npy"
# uint64 [m]: the first `tokens_per_key` tokens of each suffix packed into one integer (token + 1 per
# `key_bits`-bit field, zero from the first separator on), nondecreasing along the suffix array:
# `np.searchsorted` finds the range of a short pattern in C, and a longer pattern's range is narrowed inside it.
PREFIX_KEYS_FILE = "prefix_keys.npy"


def content_fingerprint(tokenizer) -> dict:
    """The tokenizer's identity by content only (its path or repo name may differ between machines)."""
    fingerprint = tokenizer_fingerprint(tokenizer)
    return {"vocab_size": fingerprint["vocab_size"], "vocab_sha256": fingerprint["vocab_sha256"]}


def validate_arrays(path: Path, manifest: StoreManifest, tokens: np.ndarray, suffix_array: np.ndarray,
                    prefix_keys: np.ndarray, key_bits: int) -> None:
    """Refuses (StoreError naming the file) arrays that cannot be the store the manifest describes: what a
    file damaged without changing its size looks like, which sizes alone do not catch and the lookups
    cannot survive (an offset outside the tokens crashed the C lookup; a token id past the vocabulary
    was drafted and crashed the target). A few vectorised passes: ~1 ms per million tokens, against a
    full checksum's read of every byte (`verify_checksums`).

    Checked: the lengths against each other and the manifest's token and document counts; every token id
    in [-1, vocab_size) (the fingerprint's vocabulary; else what the key fields can pack); one -1 per
    document, the last token among them (the C lookup relies on it); every suffix-array offset in
    [0, tokens); the packed keys in order (the range searches rely on it)."""
    stats = manifest.stats
    token_count, documents = stats.get("token_count"), stats.get("documents")

    def damaged(name: str, what: str) -> StoreError:
        return StoreError(f"{KIND} at {path}: {name} is damaged: {what}; rebuild the store")

    if not isinstance(token_count, int) or len(suffix_array) != token_count or len(prefix_keys) != token_count:
        raise StoreError(f"{KIND} at {path}: its arrays disagree with each other or with the manifest "
                         f"({SUFFIX_ARRAY_FILE} {len(suffix_array)} suffixes, {PREFIX_KEYS_FILE} {len(prefix_keys)} "
                         f"keys, manifest token_count {token_count!r}); rebuild the store")
    expected_tokens = token_count + documents if isinstance(documents, int) else None
    if len(tokens) == 0 or (expected_tokens is not None and len(tokens) != expected_tokens):
        raise damaged(TOKENS_FILE, f"it holds {len(tokens)} entries, the manifest's {token_count} tokens and "
                                   f"{documents!r} document ends make {expected_tokens}")
    if tokens[-1] != SEPARATOR:
        raise damaged(TOKENS_FILE, f"it does not end with the {SEPARATOR} that closes every document "
                                   f"(found {int(tokens[-1])})")
    vocab_size = manifest.fingerprint.get("vocab_size") if isinstance(manifest.fingerprint, dict) else None
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
        vocab_size = (1 << min(key_bits, 32)) - 1  # a field holds token + 1; all ones is never a key's
    low, high = int(tokens.min()), int(tokens.max())
    if low < SEPARATOR or high >= vocab_size:
        raise damaged(TOKENS_FILE, f"it holds token ids from {low} to {high}, outside [{SEPARATOR}, {vocab_size}) "
                                   f"(the tokenizer's vocabulary and the document end {SEPARATOR})")
    separators = len(tokens) - token_count
    if int(np.count_nonzero(tokens == SEPARATOR)) != separators:
        raise damaged(TOKENS_FILE, f"it holds {int(np.count_nonzero(tokens == SEPARATOR))} document ends "
                                   f"({SEPARATOR}), its {len(tokens)} entries less the manifest's {token_count} "
                                   f"tokens make {separators}")
    if token_count:
        first, last = int(suffix_array.min()), int(suffix_array.max())
        if first < 0 or last >= len(tokens):
            raise damaged(SUFFIX_ARRAY_FILE, f"it holds suffix offsets from {first} to {last}, outside the "
                                             f"{len(tokens)} tokens [0, {len(tokens)})")
        if token_count > 1 and bool((prefix_keys[1:] < prefix_keys[:-1]).any()):
            raise damaged(PREFIX_KEYS_FILE, "its packed keys are out of order")


def load_array(directory: Path, name: str, dtypes: tuple) -> np.ndarray:
    """The store's array `name`, memory-mapped read-only (never unpickled), refused unless it is 1-D of one of
    `dtypes`."""
    try:
        array = np.load(directory / name, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as error:
        raise StoreError(f"{KIND} at {directory}: cannot read {name} ({error}); rebuild the store") from None
    if array.ndim != 1 or array.dtype not in [np.dtype(d) for d in dtypes]:
        raise StoreError(f"{KIND} at {directory}: {name} holds {array.dtype} {array.shape}, expected a 1-D "
                         f"{' or '.join(np.dtype(d).name for d in dtypes)} array; rebuild the store")
    return array.view(np.ndarray)  # same mapped memory; plain ndarray slicing is cheaper than memmap's
