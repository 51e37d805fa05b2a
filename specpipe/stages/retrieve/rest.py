"""REST (retrieval-based speculative decoding): drafts what followed the context's longest
suffix in a token datastore, the most frequent continuations merged into a trie."""
from __future__ import annotations

from pathlib import Path

from specpipe import distributed
from specpipe.errors import StoreError
from specpipe.paths import local_path
from specpipe.stages.base import Proposer
from specpipe.stages.retrieve.calibration import CalibrationPolicy
from specpipe.stages.retrieve.continuation_trie import ContinuationTrie, TrieSequence
from specpipe.stores.manifest import sha256_file
from specpipe.stores.token_datastore import DatastoreMatch, TokenDatastore, TokenStore, default_store_path
from specpipe.types import DecodeState, Proposal, VerifyResult


class RestRetriever(Proposer):
    """Looks the context up in a token datastore and proposes its frequent continuations.

    The store at `path` may be one suffix array or sharded: `TokenDatastore.load` opens either,
    and both answer `lookup` alike (a sharded store merges what every shard holds).

    Node scores estimate acceptance: the frequency ratio of the branch among the sampled
    occurrences of the match (occurrences followed by a document's end count as misses),
    times an online calibration factor per match length and depth, multiplied along paths.

    `shorter_spans` > 0 goes beyond REST, which drafts from the longest match alone: the
    continuations of the next shorter suffixes of the context (the longest match's length minus
    1, 2, ...) are proposed too, each as its own trie with its own frequency ratios, merged by
    prefix (a node in several keeps its best score). A long match is often one occurrence whose
    continuation is an accident of one answer; a shorter one counts what usually follows.
    """

    def __init__(self, tokenizer=None, path: str | None = None, store: str = "tokens_from_files",
                 name: str = "token_datastore", max_span: int = 16, min_span: int = 2, max_candidates: int = 8,
                 max_length: int = 16, max_occurrences: int = 256, shorter_spans: int = 0, prior: float = 0.5,
                 memory: float = 4000.0, shared_calibration: bool = True, verify_checksums: bool = False,
                 native_lookup: bool = True,
                 datastore: TokenStore | None = None, corpus: str | None = None, ids_field: str = "answer_ids",
                 target=None) -> None:
        # `target` is what the pipeline builder hands every partial stage; REST has no use for it.
        if not 1 <= min_span <= max_span:
            raise ValueError(f"{name}: spans need 1 <= min_span <= max_span, got {min_span}, {max_span}")
        if max_candidates < 1 or max_length < 1 or max_occurrences < 1:
            raise ValueError(f"{name}: max_candidates, max_length and max_occurrences must be >= 1")
        if shorter_spans < 0:
            raise ValueError(f"{name}: shorter_spans must be >= 0 (0 = the longest match alone), got {shorter_spans}")
        self.name = name
        folder = local_path(path) if path else default_store_path(store)
        if datastore is None and corpus and not path:
            source = corpus_file(corpus, folder)
            # refused before loading or building: the store of this corpus may exist, built for its tokenizer
            mismatch = corpus_tokenizer_mismatch(source, tokenizer)
            if mismatch:
                raise StoreError(f"{name}: {mismatch}: build a datastore for this model with `python run.py "
                                 f"task=build_store store=tokens_from_files store.sources=[...]` and give its folder "
                                 f"as this proposer's `path`")
            # one store per corpus version: a corpus that grew (or changed) gets its own, built once
            folder = default_store_path(f"{store}-{sha256_file(source)[:12]}")
            with distributed.main_process_first():  # under torchrun one rank builds it, the others load it
                if not folder.exists():
                    build_from_corpus(folder, source, ids_field, tokenizer)
        self.datastore = datastore if datastore is not None else TokenDatastore.load(
            folder, tokenizer, verify_checksums=verify_checksums, native=native_lookup)
        self.max_span, self.min_span = max_span, min_span
        self.max_candidates, self.max_length, self.max_occurrences = max_candidates, max_length, max_occurrences
        self.shorter_spans = shorter_spans
        self.calibration = CalibrationPolicy(prior, memory, shared_calibration)

    def reset(self, state: DecodeState) -> None:
        state.stage_state[self] = TrieSequence(self.calibration.for_request(), proposed_at=len(state.tokens))

    def propose(self, state: DecodeState) -> Proposal:
        context = state.tokens[-self.max_span:]
        match = self.datastore.lookup(context, self.max_span, self.min_span, self.max_length,
                                      self.max_candidates, self.max_occurrences)
        tries = [self._trie(match)]
        # Every suffix of the longest match occurs too, so each shorter span is found; looked up
        # with min_span = max_span = its length, it costs one range search.
        for span in range(match.match_length - 1, match.match_length - 1 - self.shorter_spans, -1):
            if span < self.min_span:
                break
            tries.append(self._trie(self.datastore.lookup(context, span, span, self.max_length,
                                                          self.max_candidates, self.max_occurrences)))
        return state.stage_state[self].propose_merged(tries, len(state.tokens), self.name)

    @staticmethod
    def _trie(match: DatastoreMatch) -> ContinuationTrie:
        trie = ContinuationTrie(total=match.sampled)
        for continuation, prefix_counts in zip(match.continuations, match.prefix_counts):
            trie.add(continuation, match.match_length, prefix_counts)
        return trie

    def on_commit(self, state: DecodeState, result: VerifyResult) -> None:
        state.stage_state[self].learn(state.tokens)

    def on_finish(self, state: DecodeState) -> None:
        pass


def corpus_file(corpus: str, folder: Path) -> Path:
    """The corpus Parquet: as given, or relative to the package folder (where the shipped one lives)."""
    source = local_path(corpus)
    if not source.is_file():
        raise StoreError(f"the token datastore's corpus {corpus} is missing: restore it from the repository, or "
                         f"build a store with `python run.py task=build_store store=tokens_from_files "
                         f"store.sources=[...]` and give its folder as pipeline.proposers.rest.path")
    return source


def corpus_tokenizer_mismatch(source: Path, tokenizer) -> str:
    """'' when the corpus Parquet's metadata names `tokenizer`'s vocabulary (or names none, or no tokenizer
    is given), else what differs."""
    from specpipe.distill.corpus import CorpusError, read_corpus_metadata
    from specpipe.stores.manifest import tokenizer_fingerprint

    if tokenizer is None:
        return ""
    try:
        recorded = read_corpus_metadata(source).get("tokenizer")
    except CorpusError:  # a Parquet of ids from elsewhere: nothing recorded to check against
        return ""
    ours = tokenizer_fingerprint(tokenizer)
    if isinstance(recorded, dict) and recorded.get("vocab_sha256") != ours["vocab_sha256"]:
        return (f"the corpus {source} holds token ids of another tokenizer ({recorded.get('tokenizer')}), not this "
                f"model's ({ours['tokenizer']})")
    return ""


def build_from_corpus(folder: Path, source: Path, ids_field: str, tokenizer) -> None:
    """Builds the datastore at `folder` from a corpus of token ids shipped as Parquet (the
    self-distilled chat answers in data/self_distill/): seconds, once per machine. The caller has
    checked the corpus's tokenizer (corpus_tokenizer_mismatch)."""
    import sys

    from specpipe.stores.token_datastore_build import TokenDatastoreBuilder

    print(f"specpipe: building the token datastore {folder} from {source} (once per corpus)", file=sys.stderr)
    TokenDatastoreBuilder(tokenizer, sources=[str(source)], out=str(folder), ids_field=ids_field,
                          progress=False).build()
