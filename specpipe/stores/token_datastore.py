"""The REST token datastore: a suffix array over the token ids of a corpus.

On disk (a store folder, written atomically by `specpipe.stores.manifest.write_store`):

- `tokens.npy` int32 [n]: every document's token ids, each document followed by SEPARATOR
  (-1). No real token is negative, so no pattern matches across a separator, and a
  continuation read after a match stops at one. The array always ends with a separator.
- `suffix_array.npy` int32 (int64 past 2**31 tokens) [m]: the start of every suffix that
  begins with a real token, in lexicographic order (-1 sorts below every token; suffixes
  starting at a separator come first in the full array and are dropped).
- `prefix_keys.npy` uint64 [m]: the first `tokens_per_key` tokens of each suffix packed
  into one integer (token + 1 per `key_bits`-bit field, zero from the first separator on),
  nondecreasing along the suffix array: `np.searchsorted` finds the range of a short
  pattern in C, and a longer pattern's range is narrowed inside it.

16 bytes per token on disk (4 + 4 + 8). Loading memory-maps the three arrays
(`allow_pickle=False`) after the manifest and the file sizes check out. Full SHA-256
checksums are opt-in (`verify_checksums=True`): they read every byte, ~0.25 s for a
10M-token store (160 MB) on this machine against ~2 ms for sizes + mapping, and grow with
the store, which would defeat memory-mapping a store opened by every process.

Sharded (`shard_tokens` set when building; format 2): a corpus whose suffix sort would not fit in
memory is cut at document boundaries into shards of about `shard_tokens` tokens, each a complete
store of the layout above in `shard-00000/`, `shard-00001/`, ... with its own manifest, sorted
one after another (a build holds one shard at a time). The top-level manifest lists the shards
and every file under the folder. `TokenDatastore.load` opens either layout; a sharded folder
gives a `ShardedTokenDatastore`, whose lookups search every shard and merge (`lookup` equals the
one-shard store's over the same corpus whenever `max_occurrences` is not reached). An
interrupted sharded build of `TokenDatastoreBuilder` keeps its finished shards in
`.<name>.building-sharded/` next to the store; a rerun with the same sources and settings
resumes after them.
"""
from __future__ import annotations

import bisect
import fcntl
import itertools
import json
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from specpipe.errors import ConfigError, StoreError
from specpipe.models import cache_root
from specpipe.stores.manifest import (MANIFEST, StoreManifest, check_fingerprint, check_output_folder,
                                      check_store_name, read_manifest, tokenizer_fingerprint, verify_files,
                                      write_store)
from specpipe.stores.suffix_lookup import NativeSuffixLookup

KIND = "token_datastore"
FORMAT_VERSION = 1  # one suffix array: a one-shard store, and every shard of a sharded one
SHARDED_FORMAT_VERSION = 2  # a folder of shards, each a format-1 store
SEPARATOR = -1
TOKENS_FILE = "tokens.npy"
SUFFIX_ARRAY_FILE = "suffix_array.npy"
PREFIX_KEYS_FILE = "prefix_keys.npy"
TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl",)
PARQUET_SUFFIXES = (".parquet",)
CORPUS_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
# Below this many suffixes a range is narrowed by one vectorised gather; above it by binary search.
GATHER_NARROW_LIMIT = 256


def default_store_path(name: str) -> Path:
    """Where a named store lives unless a path is given: `<cache>/stores/NAME` (a plain name: ConfigError
    for a path, which would lead outside the cache)."""
    return cache_root() / "stores" / check_store_name(name, "store")


def _content_fingerprint(tokenizer) -> dict:
    """The tokenizer's identity by content only (its path or repo name may differ between machines)."""
    fingerprint = tokenizer_fingerprint(tokenizer)
    return {"vocab_size": fingerprint["vocab_size"], "vocab_sha256": fingerprint["vocab_sha256"]}


@dataclass(frozen=True)
class DatastoreMatch:
    """What the corpus says follows the context: the longest suffix of the context found, and
    the distinct continuations read after a sample of its occurrences."""

    match_length: int  # tokens of the context's suffix found in the corpus (0 = none)
    occurrences: int  # how often that suffix occurs in the corpus
    sampled: int  # occurrences whose continuations were read (evenly spread over all of them)
    continuations: list[list[int]]  # distinct non-empty continuations, each cut at its document's end
    # prefix_counts[i][d]: sampled occurrences whose continuation starts with continuations[i][:d + 1]
    prefix_counts: list[list[int]]

    @staticmethod
    def none() -> "DatastoreMatch":
        return DatastoreMatch(0, 0, 0, [], [])


class TokenDatastore:
    """Immutable, shareable between threads and requests: lookups only read the arrays."""

    def __init__(self, tokens: np.ndarray, suffix_array: np.ndarray, prefix_keys: np.ndarray, key_bits: int,
                 path: Path | None = None, native: bool = True) -> None:
        # tokens [n] int32, suffix_array [m] int32|int64, prefix_keys [m] uint64
        self.tokens = tokens
        self.suffix_array = suffix_array
        self.prefix_keys = prefix_keys
        self.key_bits = key_bits
        self.tokens_per_key = 64 // key_bits
        self.path = path
        # Pattern tokens that cannot be packed cannot occur in the corpus either.
        self._token_limit = (1 << key_bits) - 1
        # `lookup` in compiled C where it builds (specpipe.stores.suffix_lookup), else in numpy;
        # `native_reason` says why not
        self.native: NativeSuffixLookup | None = None
        self.native_reason = "native=False"
        if native:
            self.native, self.native_reason = _native_lookup(self)

    # ---- construction ----------------------------------------------------------------------

    @classmethod
    def from_documents(cls, documents: Iterable[Sequence[int]], native: bool = True) -> "TokenDatastore":
        """An in-memory datastore (nothing written), e.g. for a small corpus known at run time;
        `native=False` keeps the numpy lookup."""
        tokens, _ = _concatenate(documents, vocab_size=None)
        suffix_array, prefix_keys, key_bits = _index(tokens)
        return cls(tokens, suffix_array, prefix_keys, key_bits, native=native)

    @classmethod
    def load(cls, path: str | Path, tokenizer=None, verify_checksums: bool = False,
             native: bool = True) -> "TokenDatastore | ShardedTokenDatastore":
        """Memory-maps a built store, one-shard or sharded (then a `ShardedTokenDatastore`, which
        has the same lookups); refuses one built for a tokenizer other than `tokenizer`. `native=False`
        keeps a one-shard store's lookup in numpy (sharded stores always merge their shards in numpy)."""
        path = Path(path).expanduser()
        manifest = read_manifest(path, KIND, (FORMAT_VERSION, SHARDED_FORMAT_VERSION))
        if manifest.format_version == SHARDED_FORMAT_VERSION:
            return ShardedTokenDatastore.from_manifest(path, manifest, tokenizer, verify_checksums)
        return cls.from_manifest(path, manifest, tokenizer, verify_checksums, native)

    @classmethod
    def from_manifest(cls, path: Path, manifest: StoreManifest, tokenizer=None,
                      verify_checksums: bool = False, native: bool = True) -> "TokenDatastore":
        """load() once the format-1 `manifest` of the store at `path` has been read."""
        missing = {TOKENS_FILE, SUFFIX_ARRAY_FILE, PREFIX_KEYS_FILE} - set(manifest.files)
        if missing:
            raise StoreError(f"{KIND} at {path}: the manifest lists no {sorted(missing)}; rebuild the store")
        verify_files(path, manifest, checksums=verify_checksums)
        if tokenizer is not None:
            check_fingerprint(path, manifest, _content_fingerprint(tokenizer), "tokenizer")
        tokens = _load_array(path, TOKENS_FILE, (np.int32,))
        suffix_array = _load_array(path, SUFFIX_ARRAY_FILE, (np.int32, np.int64))
        prefix_keys = _load_array(path, PREFIX_KEYS_FILE, (np.uint64,))
        key_bits = manifest.stats.get("key_bits")
        if not isinstance(key_bits, int) or isinstance(key_bits, bool) or not 1 <= key_bits <= 64:
            raise StoreError(f"{KIND} at {path}: the manifest's key_bits={key_bits!r} is invalid; rebuild the store")
        validate_arrays(path, manifest, tokens, suffix_array, prefix_keys, key_bits)
        return cls(tokens, suffix_array, prefix_keys, key_bits, path, native=native)

    def __len__(self) -> int:
        """Real tokens in the corpus (separators excluded)."""
        return int(self.suffix_array.shape[0])

    # ---- lookups -------------------------------------------------------------------------

    def find(self, pattern: Sequence[int]) -> tuple[int, int]:
        """The suffix-array range [lo, hi) of the suffixes starting with `pattern`."""
        pattern = list(pattern)
        if not pattern:
            return 0, len(self)
        if min(pattern) < 0 or max(pattern) >= self._token_limit:
            return 0, 0
        return self._find(pattern)

    def count(self, pattern: Sequence[int]) -> int:
        lo, hi = self.find(pattern)
        return hi - lo

    def longest_suffix_match(self, context: Sequence[int], max_span: int = 16,
                             min_span: int = 2) -> tuple[int, int, int]:
        """(length, lo, hi): the longest suffix of `context` of min_span..max_span tokens that
        occurs in the corpus and its suffix-array range; (0, 0, 0) when none does."""
        min_span = max(1, min_span)
        context = list(context[-max_span:])
        # A token that cannot be packed (so is not in the corpus) ends every match before it.
        unusable = [i for i, token in enumerate(context) if token < 0 or token >= self._token_limit]
        if unusable:
            context = context[unusable[-1] + 1:]
        # A suffix of an occurring span occurs too, so the spans that occur are min_span..best:
        # binary search for best (about four range searches for 16 spans).
        best, best_range = 0, (0, 0)
        low, high = min_span, len(context)
        while low <= high:
            span = (low + high) // 2
            lo, hi = self._find(context[len(context) - span:])
            if lo < hi:
                best, best_range = span, (lo, hi)
                low = span + 1
            else:
                high = span - 1
        return best, best_range[0], best_range[1]

    def lookup(self, context: Sequence[int], max_span: int = 16, min_span: int = 2, max_length: int = 16,
               max_candidates: int = 8, max_occurrences: int = 256) -> DatastoreMatch:
        """REST's retrieval: the longest suffix of the context found in the corpus, then the most
        frequent continuations after it.

        Past `max_occurrences` occurrences, an evenly spaced sample of them is read: the range
        is sorted by what follows the match, so even spacing keeps every continuation's share.
        Continuations are ranked by the sum of their prefix counts (the accepted length they
        promise if drafted alone), ties going to the one that sorts first (token ids compared in
        order, a document's end below every token); the best `max_candidates` are returned in
        that (lexicographic) order.
        """
        if self.native is None:
            return merged_lookup([self], context, max_span, min_span, max_length, max_candidates, max_occurrences)
        _check_lookup_limits(max_length, max_candidates, max_occurrences)
        length, occurrences, sampled, continuations, prefix_counts = self.native.lookup(
            list(context), max_span, min_span, max_length, max_candidates, max_occurrences)
        if length == 0:
            return DatastoreMatch.none()
        return DatastoreMatch(length, occurrences, sampled, continuations, prefix_counts)

    # ---- internals -----------------------------------------------------------------------

    def _find(self, pattern: list[int]) -> tuple[int, int]:
        """find() for a non-empty pattern of packable tokens: the packed head's range by
        binary search in C, then narrowed by the rest of the pattern."""
        per_key, bits = self.tokens_per_key, self.key_bits
        head = pattern[:per_key]
        key = 0
        for token in head:
            key = (key << bits) | (token + 1)
        free_bits = bits * (per_key - len(head))
        low = key << free_bits  # the head followed by separators (zero fields): its smallest key
        high = low | ((1 << free_bits) - 1)  # ... followed by all-ones fields: above any real key
        lo = int(self.prefix_keys.searchsorted(np.uint64(low), side="left"))
        hi = int(self.prefix_keys.searchsorted(np.uint64(high), side="right"))
        return self._narrow(lo, hi, pattern, per_key)

    def _narrow(self, lo: int, hi: int, pattern: list[int], offset: int) -> tuple[int, int]:
        """Within [lo, hi) (suffixes that share pattern[:offset]), the sub-range that also
        matches pattern[offset:]: it is contiguous, the range being sorted by what comes next."""
        rest = pattern[offset:]
        if not rest or lo >= hi:
            return lo, hi
        tokens, width = self.tokens, len(rest)
        if hi - lo <= GATHER_NARROW_LIMIT:
            starts = self.suffix_array[lo:hi].astype(np.int64) + offset  # [r]
            window = tokens[np.minimum(starts[:, None] + np.arange(width), len(tokens) - 1)]  # [r, width]
            matching = np.flatnonzero((window == np.asarray(rest, dtype=np.int32)).all(axis=1))
            if matching.size == 0:
                return lo, lo
            return lo + int(matching[0]), lo + int(matching[-1]) + 1

        def following(start) -> list[int]:
            # a separator (-1) sorts below every token, as in the suffix array
            start = int(start) + offset
            return tokens[start:start + width].tolist()

        lo = bisect.bisect_left(self.suffix_array, rest, lo, hi, key=following)
        hi = bisect.bisect_right(self.suffix_array, rest, lo, hi, key=following)
        return lo, hi

    def _followers(self, rows: np.ndarray, length: int, max_length: int) -> np.ndarray:
        """rows [s] of the suffix array, whose suffixes share their first `length` tokens ->
        [s, max_length] the tokens after those, SEPARATOR from a document's end on."""
        return self._read_after(self.suffix_array[rows].astype(np.int64) + length, max_length)

    def _read_after(self, starts: np.ndarray, max_length: int) -> np.ndarray:
        """starts [s] -> [s, max_length] the tokens from each start, SEPARATOR from a document's end on."""
        last = len(self.tokens) - 1  # always a separator, so reads past the end see one
        window = self.tokens[np.minimum(starts[:, None] + np.arange(max_length), last)]
        inside = np.logical_and.accumulate(window != SEPARATOR, axis=1)
        return np.where(inside, window, SEPARATOR)


class ShardedTokenDatastore:
    """A token datastore kept as several suffix arrays (shards cut at document boundaries), with
    the lookups of `TokenDatastore`: counts add up, the longest match is the longest in any shard,
    and `lookup` reads the continuations of every shard's occurrences together.

    A suffix-array range belongs to one shard, so `find` and `longest_suffix_match` give one range
    per shard where `TokenDatastore` gives one range. Immutable, like the shards.
    """

    def __init__(self, shards: Sequence[TokenDatastore], path: Path | None = None) -> None:
        if not shards:
            raise StoreError(f"a sharded {KIND} needs at least one shard")
        self.shards = list(shards)
        self.path = path

    @classmethod
    def from_documents(cls, documents: Iterable[Sequence[int]], shard_tokens: int) -> "ShardedTokenDatastore":
        """In memory, cut into shards exactly as a build with this `shard_tokens` would cut them."""
        shards = [TokenDatastore(tokens, *_index(tokens), native=False)
                  for tokens, _, _ in _shards_of(enumerate(documents), shard_tokens, vocab_size=None)]
        if not shards:
            raise StoreError("the corpus holds no tokens: every source is empty, so there is nothing to index")
        return cls(shards)

    @classmethod
    def load(cls, path: str | Path, tokenizer=None, verify_checksums: bool = False) -> "ShardedTokenDatastore":
        path = Path(path).expanduser()
        return cls.from_manifest(path, read_manifest(path, KIND, SHARDED_FORMAT_VERSION), tokenizer,
                                 verify_checksums)

    @classmethod
    def from_manifest(cls, path: Path, manifest: StoreManifest, tokenizer=None,
                      verify_checksums: bool = False) -> "ShardedTokenDatastore":
        """Maps every shard the format-2 `manifest` of the store at `path` lists, after checking
        that each is there, whole, and built for the store's tokenizer."""
        listed = manifest.stats.get("shards")
        if not isinstance(listed, list) or not listed or not all(
                isinstance(entry, dict) and isinstance(entry.get("name"), str) for entry in listed):
            raise StoreError(f"sharded {KIND} at {path}: its manifest lists no shards; rebuild the store")
        for entry in listed:
            if not (path / entry["name"]).is_dir():
                raise StoreError(f"sharded {KIND} at {path}: shard {entry['name']} is missing (the manifest lists "
                                 f"{len(listed)} shards); rebuild the store")
        verify_files(path, manifest, checksums=verify_checksums)  # every shard's files: sizes, checksums
        if tokenizer is not None:
            check_fingerprint(path, manifest, _content_fingerprint(tokenizer), "tokenizer")
        expected = {key: manifest.fingerprint.get(key) for key in ("vocab_size", "vocab_sha256")}
        shards = []
        for entry in listed:
            folder = path / entry["name"]
            shard_manifest = read_manifest(folder, KIND, FORMAT_VERSION)
            differing = [key for key, value in expected.items() if shard_manifest.fingerprint.get(key) != value]
            if differing:
                raise StoreError(f"sharded {KIND} at {path}: shard {entry['name']} was built for another tokenizer "
                                 f"than the store ({', '.join(differing)} differ): its ids would mean other text. "
                                 f"Rebuild the store")
            if shard_manifest.stats.get("token_count") != entry.get("token_count"):
                raise StoreError(f"sharded {KIND} at {path}: shard {entry['name']} holds "
                                 f"{shard_manifest.stats.get('token_count')} tokens, the store's manifest says "
                                 f"{entry.get('token_count')} (a shard from another build?); rebuild the store")
            shards.append(TokenDatastore.from_manifest(folder, shard_manifest, native=False))  # sizes were checked above
        total = sum(len(shard) for shard in shards)
        if total != manifest.stats.get("token_count"):
            raise StoreError(f"sharded {KIND} at {path}: its shards hold {total} tokens, the manifest says "
                             f"{manifest.stats.get('token_count')}; rebuild the store")
        return cls(shards, path)

    def __len__(self) -> int:
        """Real tokens in the corpus (separators excluded)."""
        return sum(len(shard) for shard in self.shards)

    def find(self, pattern: Sequence[int]) -> list[tuple[int, int]]:
        """The range [lo, hi) of the suffixes starting with `pattern` in each shard's suffix array."""
        return [shard.find(pattern) for shard in self.shards]

    def count(self, pattern: Sequence[int]) -> int:
        return sum(shard.count(pattern) for shard in self.shards)

    def longest_suffix_match(self, context: Sequence[int], max_span: int = 16,
                             min_span: int = 2) -> tuple[int, list[tuple[int, int]]]:
        """(length, ranges): the longest suffix of `context` of min_span..max_span tokens that
        occurs in any shard, and its range in each shard ((0, 0) where it does not occur)."""
        return _longest_in_shards(self.shards, context, max_span, min_span)

    def lookup(self, context: Sequence[int], max_span: int = 16, min_span: int = 2, max_length: int = 16,
               max_candidates: int = 8, max_occurrences: int = 256) -> DatastoreMatch:
        """`TokenDatastore.lookup` over every shard: the same result as one store over the same corpus
        while the match occurs at most `max_occurrences` times. Past that, each shard is sampled
        in proportion to its share of the occurrences (evenly spaced inside its range, so each
        continuation keeps its share); a one-shard store samples its single range, so the two agree
        on every continuation's share, not row for row."""
        return merged_lookup(self.shards, context, max_span, min_span, max_length, max_candidates,
                             max_occurrences)


TokenStore = TokenDatastore | ShardedTokenDatastore  # what TokenDatastore.load returns; REST takes either


def _longest_in_shards(shards: Sequence[TokenDatastore], context: Sequence[int], max_span: int,
                       min_span: int) -> tuple[int, list[tuple[int, int]]]:
    """(length, ranges): the longest suffix of `context` of min_span..max_span tokens found in any
    shard, and its range in each ((0, 0) where it does not occur)."""
    window = list(context[-max_span:])
    best, ranges = 0, [(0, 0)] * len(shards)
    for number, shard in enumerate(shards):
        # Spans shorter than the best so far are no use, and a shard without the shortest span
        # still useful holds no longer one: one range search rules most shards out, where a
        # binary search over the spans takes about four.
        shortest = max(1, min_span, best)
        if shortest > len(window):
            break
        lo, hi = shard.find(window[len(window) - shortest:])
        if lo == hi:
            continue
        length, longer_lo, longer_hi = shard.longest_suffix_match(window, max_span, shortest + 1)
        if length:
            lo, hi = longer_lo, longer_hi
        else:
            length = shortest
        if length > best:
            best, ranges = length, [(0, 0)] * len(shards)
        ranges[number] = (lo, hi)
    return best, ranges


def merged_lookup(shards: Sequence[TokenDatastore], context: Sequence[int], max_span: int, min_span: int,
                  max_length: int, max_candidates: int, max_occurrences: int) -> DatastoreMatch:
    """The lookup of `TokenDatastore` and `ShardedTokenDatastore` (a one-shard store is the case of
    one shard): the longest match, a sample of its occurrences, their distinct continuations.

    The sample takes `max_occurrences` evenly spaced positions over the shards' ranges laid end to
    end: with one shard, even spacing over its sorted range; with several, each shard's share of
    the sample is its share of the occurrences, evenly spaced inside it. The continuations read are
    sorted as one suffix-array range would order them, so `_distinct_continuations` (and its
    tie-break) sees the same rows whichever way the corpus was cut whenever nothing was sampled out.
    """
    _check_lookup_limits(max_length, max_candidates, max_occurrences)
    length, ranges = _longest_in_shards(shards, context, max_span, min_span)
    if length == 0:
        return DatastoreMatch.none()
    sizes = np.array([hi - lo for lo, hi in ranges], dtype=np.int64)  # [shards]
    occurrences = int(sizes.sum())
    sampled = min(occurrences, max_occurrences)
    picks = (np.arange(sampled, dtype=np.int64) * occurrences) // sampled  # [s] positions in the ranges end to end
    ends = np.cumsum(sizes)  # [shards] where each shard's range ends in that line-up
    cuts = np.searchsorted(picks, np.concatenate(([0], ends)))  # [shards + 1] each shard's slice of picks
    parts = []
    for shard, (lo, _), start, begin, end in zip(shards, ranges, ends - sizes, cuts[:-1], cuts[1:]):
        if end > begin:
            parts.append(shard._followers(lo + picks[begin:end] - start, length, max_length))
    followers = parts[0]  # [s, max_length]
    if len(parts) > 1:
        followers = np.concatenate(parts)
        followers = followers[np.lexsort(followers.T[::-1])]  # rows in order, first column most significant
    continuations, prefix_counts = _distinct_continuations(followers, max_candidates)
    return DatastoreMatch(length, occurrences, sampled, continuations, prefix_counts)


def _check_lookup_limits(max_length: int, max_candidates: int, max_occurrences: int) -> None:
    if max_length < 1 or max_candidates < 1 or max_occurrences < 1:
        raise ValueError(f"lookup needs max_length, max_candidates and max_occurrences >= 1, got "
                         f"{max_length}, {max_candidates}, {max_occurrences}")


def _native_lookup(store: "TokenDatastore") -> tuple[NativeSuffixLookup | None, str]:
    """The compiled lookup bound to `store`'s arrays, or (None, why not)."""
    arrays = (store.tokens, store.suffix_array, store.prefix_keys)
    if not all(array.flags.c_contiguous for array in arrays) or store.tokens.dtype != np.int32:
        return None, "the store's arrays are not contiguous int32 / int32|int64 / uint64 arrays"
    library, reason = NativeSuffixLookup.build(cache_root() / "native")
    if library is None:
        return None, reason
    return NativeSuffixLookup(library, *arrays, store.key_bits, where=store.path), ""


def _distinct_continuations(followers: np.ndarray, max_candidates: int) -> tuple[list[list[int]], list[list[int]]]:
    """followers [s, L] sorted rows (a suffix-array range is sorted by what follows) -> the
    best `max_candidates` distinct non-empty rows, cut at their first SEPARATOR, with their
    prefix counts (how many rows share each prefix).

    Best = the largest sum of prefix counts; between equal sums, the row that comes first in the
    sorted order (the lexicographically smaller continuation, a document's end below every token).
    The order of the rows is the order of their content, so the choice does not depend on where
    the occurrences sit in the corpus or in which shard."""
    sampled, width = followers.shape
    if sampled == 0 or width == 0:
        return [], []
    # new_prefix[i, d]: row i starts a new run of rows sharing followers[:, :d + 1]
    new_prefix = np.ones((sampled, width), dtype=bool)
    new_prefix[1:] = np.logical_or.accumulate(followers[1:] != followers[:-1], axis=1)
    run_of = np.cumsum(new_prefix, axis=0) - 1  # [s, L] run index per depth
    flat_runs = (run_of + np.arange(width) * sampled).ravel()  # distinct ids across depths
    run_sizes = np.bincount(flat_runs, minlength=sampled * width)
    prefix_counts = run_sizes[flat_runs].reshape(sampled, width)
    valid = followers != SEPARATOR
    prefix_counts = np.where(valid, prefix_counts, 0)
    distinct = np.flatnonzero(new_prefix[:, -1] & valid[:, 0])  # first row of each distinct continuation
    if distinct.size == 0:
        return [], []
    value = prefix_counts[distinct].sum(axis=1)
    best = distinct[np.sort(np.argsort(-value, kind="stable")[:max_candidates])]
    lengths = valid[best].sum(axis=1).tolist()
    rows, counts = followers[best].tolist(), prefix_counts[best].tolist()
    return ([row[:n] for row, n in zip(rows, lengths)], [count[:n] for count, n in zip(counts, lengths)])


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


def _load_array(directory: Path, name: str, dtypes: tuple) -> np.ndarray:
    try:
        array = np.load(directory / name, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as error:
        raise StoreError(f"{KIND} at {directory}: cannot read {name} ({error}); rebuild the store") from None
    if array.ndim != 1 or array.dtype not in [np.dtype(d) for d in dtypes]:
        raise StoreError(f"{KIND} at {directory}: {name} holds {array.dtype} {array.shape}, expected a 1-D "
                         f"{' or '.join(np.dtype(d).name for d in dtypes)} array; rebuild the store")
    return array.view(np.ndarray)  # same mapped memory; plain ndarray slicing is cheaper than memmap's


# ---- building --------------------------------------------------------------------------------


def _concatenate(documents: Iterable[Sequence[int]], vocab_size: int | None) -> tuple[np.ndarray, int]:
    """Documents -> (tokens [n] int32 with a SEPARATOR after each document, document count)."""
    for tokens, count, _ in _shards_of(enumerate(documents), None, vocab_size):
        return tokens, count
    raise StoreError("the corpus holds no tokens: every source is empty, so there is nothing to index")


def _shards_of(documents: Iterable[tuple[int, Sequence[int]]], shard_tokens: int | None,
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


def _index(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
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


def build_token_datastore(out: str | Path, documents: Iterable[Sequence[int]], fingerprint: dict,
                          sources: Sequence[str] = (), progress: bool = True,
                          shard_tokens: int | None = None) -> StoreManifest:
    """Builds a token datastore from token-id documents (e.g. a corpus shipped as ids).

    `fingerprint` is the tokenizer's (`tokenizer_fingerprint`); ids at or above its vocab_size
    are refused. `shard_tokens`: cut into shards of about that many tokens (None: one suffix
    array). Nothing at `out` changes unless the whole build succeeds; an interrupted build starts
    over (an iterable cannot be checked to be the same again: `TokenDatastoreBuilder` resumes).
    """
    started = time.perf_counter()
    if shard_tokens is None:
        tokens, document_count = _concatenate(documents, fingerprint.get("vocab_size"))
        return _write(Path(out), tokens, document_count, fingerprint, list(sources), started, progress)
    _check_shard_tokens(shard_tokens)
    numbered = enumerate(documents)  # read once: without a resume key the build always starts at document 0
    return _write_sharded(Path(out), lambda resume_at: numbered, fingerprint, list(sources), shard_tokens, started,
                          progress, resume_key=None)


def _check_shard_tokens(shard_tokens) -> None:
    if shard_tokens is not None and (isinstance(shard_tokens, bool) or not isinstance(shard_tokens, int)
                                     or shard_tokens < 1):
        raise ConfigError(f"store.shard_tokens must be a positive number of tokens per shard, or null for one "
                          f"suffix array; got {shard_tokens!r}")


def _write(out: Path, tokens: np.ndarray, document_count: int, fingerprint: dict, sources: list[str],
           started: float, progress: bool, extra_stats: dict | None = None) -> StoreManifest:
    def write_files(staging: Path) -> dict:
        if progress:
            tqdm.write(f"token_datastore: sorting the suffixes of {len(tokens) - document_count:,} tokens"
                       f"{f' ({out.name})' if extra_stats else ''}", file=sys.stderr)
        suffix_array, prefix_keys, key_bits = _index(tokens)
        for name, array in ((TOKENS_FILE, tokens), (SUFFIX_ARRAY_FILE, suffix_array), (PREFIX_KEYS_FILE, prefix_keys)):
            np.save(staging / name, array, allow_pickle=False)
        return {"token_count": int(len(suffix_array)), "documents": document_count, "key_bits": key_bits,
                "build_seconds": round(time.perf_counter() - started, 3),
                "bytes": sum(path.stat().st_size for path in staging.iterdir()), **(extra_stats or {})}

    return write_store(out, KIND, FORMAT_VERSION, fingerprint, write_files, sources)


def _shard_name(number: int) -> str:
    return f"shard-{number:05d}"


def _write_sharded(out: Path, documents_from: Callable[[int], Iterable[tuple[int, Sequence[int]]]],
                   fingerprint: dict, sources: list[str], shard_tokens: int, started: float, progress: bool,
                   resume_key: dict | None) -> StoreManifest:
    """Builds a sharded store at `out`: `documents_from(n)` gives the (number, ids) documents from
    number n on; each shard is indexed and written (a complete store, atomically) before the next
    is read, and the folder of shards is swapped in whole at the end.

    With a `resume_key` (what identifies the corpus and the settings), the shards are staged in
    `.<name>.building-sharded/`, which outlives a failed run: a rerun with the same key skips the
    documents of the shards it finds finished there. Without one, a failure discards them.
    """
    def write_files(staging: Path) -> dict:
        finished = _finished_shards(staging, fingerprint)
        resume_at = finished[-1].stats["source_end"] if finished else 0
        if finished and progress:
            tqdm.write(f"token_datastore: resuming the build of {out}: {len(finished)} shards done, from "
                       f"document {resume_at:,}", file=sys.stderr)
        for tokens, document_count, source_end in _shards_of(documents_from(resume_at), shard_tokens,
                                                             fingerprint.get("vocab_size")):
            finished.append(_write(staging / _shard_name(len(finished)), tokens, document_count, fingerprint, [],
                                   time.perf_counter(), progress, {"source_end": source_end}))
            del tokens  # let the next shard's tokens take its place rather than sit beside it
        if not finished:
            raise StoreError("the corpus holds no tokens: every source is empty, so there is nothing to index")
        shards = [{"name": _shard_name(number), "token_count": manifest.stats["token_count"],
                   "documents": manifest.stats["documents"]} for number, manifest in enumerate(finished)]
        return {"token_count": sum(shard["token_count"] for shard in shards),
                "documents": sum(shard["documents"] for shard in shards), "shards": shards,
                "shard_tokens": shard_tokens, "build_seconds": round(time.perf_counter() - started, 3),
                "bytes": sum(path.stat().st_size for path in staging.rglob("*") if path.is_file())}

    if resume_key is None:
        return write_store(out, KIND, SHARDED_FORMAT_VERSION, fingerprint, write_files, sources)
    staging = out.parent / f".{out.name}.building-sharded"
    with _resumable(staging, resume_key, out):
        return write_store(out, KIND, SHARDED_FORMAT_VERSION, fingerprint, write_files, sources, staging=staging)


@contextmanager
def _resumable(staging: Path, key: dict, out: Path) -> Iterator[None]:
    """Holds the lock of the staging folder `staging` (a sibling `.json` file recording `key`) for
    one build; empties the folder when it was started for another key. The record is removed when
    the build succeeds and kept, with the folder, when it fails."""
    staging.parent.mkdir(parents=True, exist_ok=True)
    record = staging.parent / f"{staging.name}.json"
    with open(record, "a+", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreError(f"another build of {out} is running (it holds {record}); wait for it to finish or "
                             f"stop it") from None
        handle.seek(0)
        try:
            previous = json.loads(handle.read() or "null")
        except json.JSONDecodeError:
            previous = None
        if previous != key:  # other sources or settings: its shards would be other cuts of other text
            shutil.rmtree(staging, ignore_errors=True)
            handle.seek(0)
            handle.truncate()
            handle.write(json.dumps(key, sort_keys=True))
            handle.flush()
        yield
        record.unlink(missing_ok=True)  # still locked by this handle until it closes


def _finished_shards(staging: Path, fingerprint: dict) -> list[StoreManifest]:
    """The manifests of the shards a previous run completed in `staging` (consecutive from the
    first, each whole); everything else there is removed: a shard cut off mid-write, one after a
    gap, a stray file."""
    finished: list[StoreManifest] = []
    while (staging / _shard_name(len(finished)) / MANIFEST).is_file():
        folder = staging / _shard_name(len(finished))
        try:
            manifest = read_manifest(folder, KIND, FORMAT_VERSION)
            verify_files(folder, manifest, checksums=False)
        except StoreError:
            break
        if manifest.fingerprint != fingerprint or not isinstance(manifest.stats.get("source_end"), int):
            break
        finished.append(manifest)
    keep = {_shard_name(number) for number in range(len(finished))}
    for entry in list(staging.iterdir()):
        if entry.name in keep:
            continue
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    return finished


class TokenDatastoreBuilder:
    """`task=build_store store=tokens_from_files`: a token datastore over the user's files.

    Sources are files or folders (searched recursively for .jsonl, .parquet, .txt, .md).
    A JSONL record or Parquet row gives token ids (`ids_field`, taken as they are), text
    (`text_field`), or a chat: `turns` (strings) or `messages` ({role, content}), one
    document per turn. A text or markdown file is one document.

    `shard_tokens`: None builds one suffix array (the whole corpus in memory while it sorts, ~55
    bytes per token at peak); a number streams the corpus into shards of about that many tokens,
    each sorted and written before the next is read, so memory is bounded by one shard. A sharded
    build that is interrupted resumes from its finished shards when rerun with the same sources
    (same paths, sizes and modification times) and settings.
    """

    def __init__(self, tokenizer, sources: Sequence[str] | str | None = None, out: str | None = None,
                 name: str = "tokens_from_files", text_field: str = "text", ids_field: str = "input_ids",
                 batch_size: int = 64, progress: bool = True, shard_tokens: int | None = None) -> None:
        if isinstance(sources, str):
            sources = [sources]
        self.sources = [str(source) for source in sources or ()]
        if not self.sources:  # `sources: ???` left unset in the config arrives here as None
            raise ConfigError("a token datastore needs sources: add store.sources=[FILE_OR_FOLDER,...] "
                              "(.jsonl, .parquet, .txt, .md files, or folders of them)")
        if batch_size < 1:
            raise ConfigError(f"store.batch_size must be >= 1, got {batch_size}")
        _check_shard_tokens(shard_tokens)
        self.tokenizer = tokenizer
        self.out = check_output_folder(out) if out else default_store_path(check_store_name(name))
        self.text_field = text_field
        self.ids_field = ids_field
        self.batch_size = batch_size
        self.progress = progress
        self.shard_tokens = shard_tokens

    def build(self) -> StoreManifest:
        started = time.perf_counter()
        files = corpus_files(self.sources)  # every path checked before anything is read or written
        fingerprint = tokenizer_fingerprint(self.tokenizer)
        sources = [str(path) for path in files]
        bar = tqdm(desc="token_datastore: tokenizing", unit=" doc", file=sys.stderr, disable=not self.progress)
        try:
            if self.shard_tokens is not None:
                return _write_sharded(self.out, lambda resume_at: self._tokenized(files, bar, resume_at), fingerprint,
                                      sources, self.shard_tokens, started, self.progress,
                                      self._resume_key(files, fingerprint))
            tokens, document_count = _concatenate((ids for _, ids in self._tokenized(files, bar)),
                                                  len(self.tokenizer))
        finally:
            bar.close()
        return _write(self.out, tokens, document_count, fingerprint, sources, started, self.progress)

    def _resume_key(self, files: list[Path], fingerprint: dict) -> dict:
        """What an interrupted sharded build must share with its rerun: the same documents cut the same way."""
        sources = []
        for path in files:
            stat = path.stat()
            sources.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
        return {"format_version": SHARDED_FORMAT_VERSION, "fingerprint": fingerprint, "shard_tokens": self.shard_tokens,
                "text_field": self.text_field, "ids_field": self.ids_field, "sources": sources}

    def _tokenized(self, files: list[Path], bar, first: int = 0) -> Iterator[tuple[int, Sequence[int]]]:
        """(number, token ids) per document, in file order from document `first` on (those before
        are read, not tokenized), counted on the progress bar."""
        token_total, number = 0, first
        bar.update(first)
        for batch in self._batches(files, first):
            token_total += sum(len(ids) for ids in batch)
            bar.update(len(batch))
            bar.set_postfix(tokens=f"{token_total:,}", refresh=False)
            for ids in batch:
                yield number, ids
                number += 1

    def _batches(self, files: list[Path], first: int = 0) -> Iterator[list[Sequence[int]]]:
        """Texts are tokenized `batch_size` at a time; documents given as ids pass through."""
        texts: list[str] = []
        documents = (document for path in files for document in read_documents(path, self.text_field, self.ids_field))
        for document in itertools.islice(documents, first, None):
            if isinstance(document, str):
                texts.append(document)
                if len(texts) == self.batch_size:
                    yield self._encode(texts)
                    texts = []
                continue
            if texts:  # keep file order: the texts read before these ids go first
                yield self._encode(texts)
                texts = []
            yield [document]
        if texts:
            yield self._encode(texts)

    def _encode(self, texts: list[str]) -> list[list[int]]:
        # verbose=False: long documents are fine here (no model sees them whole); no length warning
        return self.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]


# ---- reading corpora ------------------------------------------------------------------------


def corpus_files(sources: Sequence[str]) -> list[Path]:
    """The corpus files named by `sources` (files, or folders searched recursively), in order."""
    files: list[Path] = []
    for source in sources:
        path = Path(source).expanduser()
        if not path.exists():
            raise ConfigError(f"corpus source {source} does not exist")
        if path.is_dir():
            found = sorted(candidate for candidate in path.rglob("*")
                           if candidate.is_file() and candidate.suffix.lower() in CORPUS_SUFFIXES
                           and not any(part.startswith(".") for part in candidate.relative_to(path).parts))
            if not found:
                raise ConfigError(f"corpus folder {source} holds no {', '.join(CORPUS_SUFFIXES)} files")
            files.extend(found)
        elif path.suffix.lower() in CORPUS_SUFFIXES:
            files.append(path)
        else:
            raise ConfigError(f"corpus source {source}: unsupported file type {path.suffix!r}; "
                              f"use {', '.join(CORPUS_SUFFIXES)} files or a folder of them")
    return files


def read_documents(path: Path, text_field: str = "text", ids_field: str = "input_ids") -> Iterator[str | list[int]]:
    """The documents of one corpus file: text, or token ids when the file carries them."""
    suffix = path.suffix.lower()
    try:
        if suffix in TEXT_SUFFIXES:
            yield path.read_text(encoding="utf-8")
        elif suffix in JSONL_SUFFIXES:
            yield from _jsonl_documents(path, text_field, ids_field)
        else:
            yield from _parquet_documents(path, text_field, ids_field)
    except StoreError:
        raise
    except (OSError, UnicodeDecodeError, ValueError) as error:  # pyarrow's errors are OSError/ValueError kinds
        raise StoreError(f"cannot read corpus file {path}: {type(error).__name__}: {error}") from None


def _jsonl_documents(path: Path, text_field: str, ids_field: str) -> Iterator[str | list[int]]:
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise StoreError(f"cannot read corpus file {path}: line {line_number} is not JSON ({error})") from None
            yield from _record_documents(record, text_field, ids_field, f"{path} line {line_number}")


def _record_documents(record, text_field: str, ids_field: str, where: str) -> Iterator[str | list[int]]:
    if isinstance(record, str):
        yield record
        return
    if not isinstance(record, dict):
        raise StoreError(f"{where}: expected a JSON object or string, got {type(record).__name__}")
    if record.get(ids_field) is not None:
        ids = record[ids_field]
        if not isinstance(ids, list) or not all(isinstance(token, int) for token in ids):
            raise StoreError(f"{where}: {ids_field!r} must be a list of token ids")
        yield ids
    elif isinstance(record.get(text_field), str):
        yield record[text_field]
    elif isinstance(record.get("turns"), list):
        yield from (turn for turn in record["turns"] if isinstance(turn, str))
    elif isinstance(record.get("messages"), list):
        for message in record["messages"]:
            content = message.get("content") if isinstance(message, dict) else message
            if isinstance(content, str):
                yield content
    else:
        raise StoreError(f"{where}: no {text_field!r} text, {ids_field!r} ids, 'turns' or 'messages' "
                         f"(fields: {sorted(record)}); set store.text_field=NAME")


def _parquet_documents(path: Path, text_field: str, ids_field: str) -> Iterator[str | list[int]]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    names = parquet.schema_arrow.names
    column = ids_field if ids_field in names else text_field if text_field in names else None
    if column is None:
        raise StoreError(f"cannot read corpus file {path}: no {text_field!r} (text) or {ids_field!r} (token ids) "
                         f"column (columns: {names}); set store.text_field=NAME")
    for batch in parquet.iter_batches(columns=[column], batch_size=1024):
        for value in batch.column(0).to_pylist():
            if value is not None:
                yield value
