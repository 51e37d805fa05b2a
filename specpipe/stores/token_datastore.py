"""The REST token datastore as decoding uses it: `TokenDatastore` holds one suffix array over a corpus's token
ids (memory-mapped from a built store, or indexed in memory) and answers REST's lookup, the longest suffix of
the context found in the corpus and the most frequent continuations after it; `ShardedTokenDatastore` gives
the same lookups over a store cut into shards, searching every shard and merging their answers (`lookup`
equals the one-shard store's over the same corpus whenever `max_occurrences` is not reached). Lookups only
read the arrays, so one store is shared by every thread and request. The files and their checks are
`specpipe.stores.token_datastore_format`'s, the sorting `specpipe.stores.token_datastore_index`'s, and the
builds `specpipe.stores.token_datastore_build`'s.
"""
from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specpipe.errors import StoreError
from specpipe.models import cache_root
from specpipe.stores.manifest import StoreManifest, check_fingerprint, check_store_name, read_manifest, verify_files
from specpipe.stores.suffix_lookup import NativeSuffixLookup
from specpipe.stores.token_datastore_format import (FORMAT_VERSION, KIND, PREFIX_KEYS_FILE, SEPARATOR,
                                                    SHARDED_FORMAT_VERSION, SUFFIX_ARRAY_FILE, TOKENS_FILE,
                                                    content_fingerprint, load_array, validate_arrays)
from specpipe.stores.token_datastore_index import concatenate_documents, index_tokens, shards_of

# Below this many suffixes a range is narrowed by one vectorised gather; above it by binary search.
GATHER_NARROW_LIMIT = 256


def default_store_path(name: str) -> Path:
    """Where a named store lives unless a path is given: `<cache>/stores/NAME` (a plain name: ConfigError
    for a path, which would lead outside the cache)."""
    return cache_root() / "stores" / check_store_name(name, "store")


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
        tokens, _ = concatenate_documents(documents, vocab_size=None)
        suffix_array, prefix_keys, key_bits = index_tokens(tokens)
        return cls(tokens, suffix_array, prefix_keys, key_bits, native=native)

    @classmethod
    def load(cls, path: str | Path, tokenizer=None, verify_checksums: bool = False,
             native: bool = True) -> "TokenDatastore | ShardedTokenDatastore":
        """Memory-maps a built store, one-shard or sharded (then a `ShardedTokenDatastore`, which
        has the same lookups); refuses one built for a tokenizer other than `tokenizer`. `native=False`
        keeps a one-shard store's lookup in numpy (sharded stores always merge their shards in numpy).

        The arrays are mapped (`allow_pickle=False`) once the manifest and the file sizes check out.
        Full SHA-256 checksums are opt-in (`verify_checksums=True`): they read every byte, ~0.25 s for a
        10M-token store (160 MB) against ~2 ms for sizes + mapping, and grow with the store, which would
        defeat memory-mapping a store opened by every process."""
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
            check_fingerprint(path, manifest, content_fingerprint(tokenizer), "tokenizer")
        tokens = load_array(path, TOKENS_FILE, (np.int32,))
        suffix_array = load_array(path, SUFFIX_ARRAY_FILE, (np.int32, np.int64))
        prefix_keys = load_array(path, PREFIX_KEYS_FILE, (np.uint64,))
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
        shards = [TokenDatastore(tokens, *index_tokens(tokens), native=False)
                  for tokens, _, _ in shards_of(enumerate(documents), shard_tokens, vocab_size=None)]
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
            check_fingerprint(path, manifest, content_fingerprint(tokenizer), "tokenizer")
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
