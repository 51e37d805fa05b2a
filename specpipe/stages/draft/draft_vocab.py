"""The reduced vocabulary a draft scores (`vocab_top_k`): the target's tokens ranked by how often its own
answers used them, pinned beside the weights it belongs to.

Why pinned: the ranking used to be counted at load time in the shipped chat corpus, so growing that
corpus silently changed which tokens every shipped head and draft could propose. A head is trained
over the top tokens of its own training corpus; `task=train_heads` and `task=distill_draft` write
that ranking beside the weights (`draft_vocab.npz` in a head folder, `<draft>.vocab.npz` beside a
draft file), and the loaders read it before counting any corpus.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from specpipe.errors import ConfigError

VOCAB_FILE = "draft_vocab.npz"  # in a head folder
DRAFT_FILE_SUFFIX = ".vocab.npz"  # beside a draft file: smollm2_135m_draft.vocab.npz


@dataclass(frozen=True)
class TokenRanking:
    """How often each token id occurred in `source`; `ids` ranks them (most frequent first, ties by id)."""

    counts: np.ndarray  # [vocab] int: counts[t] is token t's count
    source: str  # what was counted: a corpus file and its SHA-256
    vocab_sha256: str  # the tokenizer the ids belong to (tokenizer_fingerprint)

    @property
    def ids(self) -> np.ndarray:
        """[vocab] token ids by descending count."""
        return np.argsort(-self.counts, kind="stable")

    def top(self, count: int, name: str) -> tuple[Tensor, float]:
        """The `count` most frequent ids (ascending [count]) and the share of the counted tokens they cover."""
        if not 0 < count <= len(self.counts):
            raise ConfigError(f"{name}: vocab_top_k must be between 1 and the {len(self.counts)} tokens of the "
                              f"ranking ({self.source}), got {count}")
        ids = self.ids[:count]
        coverage = float(self.counts[ids].sum() / max(1, self.counts.sum()))
        return torch.from_numpy(np.sort(ids).astype(np.int64)), coverage


def rank_tokens(answer_ids: np.ndarray, vocab_size: int, source: str, vocab_sha256: str) -> TokenRanking:
    """answer_ids [N] (every answer token of a corpus, concatenated) -> their TokenRanking."""
    return TokenRanking(np.bincount(answer_ids, minlength=vocab_size).astype(np.int64), source, vocab_sha256)


def pinned_vocab_path(artifact: str | Path) -> Path:
    """Where the ranking of a head folder or a draft file lives."""
    artifact = Path(artifact)
    return artifact / VOCAB_FILE if artifact.is_dir() else artifact.with_suffix(DRAFT_FILE_SUFFIX)


def write_ranking(path: str | Path, ranking: TokenRanking) -> None:
    from specpipe.distill.corpus import write_atomically

    def write(tmp):
        with open(tmp, "wb") as handle:
            np.savez_compressed(handle, counts=ranking.counts.astype(np.int32), source=np.array(ranking.source),
                                vocab_sha256=np.array(ranking.vocab_sha256))

    write_atomically(Path(path), write)


def read_ranking(path: str | Path, tokenizer: PreTrainedTokenizerBase, vocab_size: int, name: str) -> TokenRanking:
    """The ranking at `path`, checked against the target's tokenizer and vocabulary (ConfigError)."""
    from specpipe.stores.manifest import tokenizer_fingerprint

    try:
        with np.load(path, allow_pickle=False) as data:
            ranking = TokenRanking(data["counts"].astype(np.int64), str(data["source"]), str(data["vocab_sha256"]))
    except Exception as error:  # a damaged zip: BadZipFile, zlib.error, EOFError, ValueError, KeyError, OSError...
        raise ConfigError(f"{name}: the pinned draft vocabulary {path} cannot be read ({type(error).__name__}: "
                          f"{str(error).strip().splitlines()[0] if str(error).strip() else 'damaged'}). Restore it "
                          f"(a shipped one: `git checkout -- {path}`) or write it again with the task that wrote it "
                          f"beside its weights (task=train_heads, task=distill_draft or task=search_layers); or "
                          f"delete it to count the shipped corpus instead, or set vocab_counts=FILE") from None
    if ranking.vocab_sha256 != tokenizer_fingerprint(tokenizer)["vocab_sha256"]:
        raise ConfigError(f"{name}: the pinned draft vocabulary {path} was counted with another tokenizer "
                          f"({ranking.vocab_sha256}): it belongs to a head or draft of another model")
    counts = ranking.counts
    if counts.ndim != 1 or len(counts) > vocab_size or (counts < 0).any():
        raise ConfigError(f"{name}: the pinned draft vocabulary {path} is malformed: at most {vocab_size} "
                          f"non-negative counts expected (one per token id of the target's vocabulary), found shape "
                          f"{tuple(counts.shape)}")
    # A tokenizer may hold fewer tokens than the output layer has rows (padded vocabularies): never drafted.
    return TokenRanking(np.pad(counts, (0, vocab_size - len(counts))), ranking.source, ranking.vocab_sha256)
