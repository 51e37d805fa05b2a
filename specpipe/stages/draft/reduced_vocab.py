"""The reduced vocabulary a draft scores (`vocab_top_k`): `ReducedVocabHead`, an output layer over the most
frequent target tokens only, and where those tokens are counted (a corpus of the target's own answers, else the
ranking pinned beside the draft's weights, else the shipped chat corpus where it is this tokenizer's). Why: on a
CPU the full output layer dominates a small draft's step (SmolLM2-135M: 49152 x 576, 113 MB in fp32, against 14 MB
per decoder layer); a token outside the reduced vocabulary is never drafted, which costs acceptance, never
exactness. The draft model's drafter, the layer-skip drafter and the EAGLE and Medusa heads share it.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from specpipe.errors import ConfigError
from specpipe.paths import local_path
from specpipe.stages.base import to_full_vocab
from specpipe.stages.draft.draft_vocab import TokenRanking, rank_tokens, read_ranking

log = logging.getLogger(__name__)
DEFAULT_VOCAB_COUNTS = "data/self_distill/smollm2_135m_chat.parquet"  # the target's own answers


class ReducedVocabHead(nn.Module):
    """The draft's output layer over the `len(ids)` most frequent target tokens only.

    Why: on a CPU the full output layer dominates a small draft's step (SmolLM2-135M: 49152 x 576,
    113 MB in fp32, against 14 MB per decoder layer). Logits come back full size, -inf outside
    `ids`, so everything downstream (log-softmax, top-k, the tree) is unchanged; a token outside
    `ids` is simply never drafted, which costs acceptance, never exactness.
    """

    def __init__(self, weight: Tensor, ids: Tensor, vocab_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(weight.shape[1], ids.shape[0], bias=False, dtype=weight.dtype)
        self.linear.weight = nn.Parameter(weight.detach()[ids].clone(), requires_grad=False)  # [k, hidden]
        # On the weight's device: the tree builders index it with top-k columns computed there (a CPU
        # buffer beside CUDA weights would fail every reduced-vocabulary drafter on a GPU).
        self.register_buffer("ids", ids.to(weight.device).clone(), persistent=False)  # [k]
        self.vocab_size = vocab_size
        self.width = int(ids.shape[0])  # the tokens it scores

    @property
    def target_ids(self) -> Tensor:
        """[k] the target token each column of `reduced_logits` scores."""
        return self.ids

    def reduced_logits(self, hidden: Tensor) -> Tensor:
        """hidden [..., hidden] -> logits [..., k] over `target_ids` only (what a tree builder's top-k needs)."""
        return self.linear(hidden)

    def forward(self, hidden: Tensor) -> Tensor:
        # hidden [..., hidden] -> logits [..., vocab]: -inf but at `ids`
        return to_full_vocab(self.reduced_logits(hidden), self.ids, self.vocab_size)


def head_logprobs(head: nn.Module, hidden: Tensor, reduced: bool) -> Tensor:
    """hidden [m, hidden] through an output layer -> log-probs [m, vocab], or with `reduced` [m, k] over
    the head's own reduced vocabulary (`reduced_logits` of ReducedVocabHead, EAGLE-3's DraftVocabHead)."""
    logits = head.reduced_logits(hidden) if reduced else head(hidden)
    return torch.log_softmax(logits.float(), dim=-1)


def frequent_tokens(corpus: str, tokenizer: PreTrainedTokenizerBase, count: int) -> tuple[Tensor, float]:
    """The `count` most frequent token ids of a corpus Parquet of the target's answers (column
    answer_ids) and the share of the corpus's tokens they cover. A corpus of another tokenizer is
    refused."""
    return corpus_ranking(corpus, tokenizer).top(count, f"vocab_counts={corpus}")


def corpus_ranking(corpus: str, tokenizer: PreTrainedTokenizerBase) -> TokenRanking:
    """The tokens of a corpus Parquet of the target's answers (column answer_ids) ranked by count."""
    import pyarrow.parquet as pq

    from specpipe.distill.corpus import CorpusError, read_corpus_metadata
    from specpipe.stores.manifest import sha256_file, tokenizer_fingerprint

    source = local_path(corpus)
    if not source.is_file():
        raise ConfigError(f"drafter.vocab_counts={corpus} does not exist: give a Parquet file of this model's "
                          f"answers (column answer_ids), e.g. one written by `python run.py task=distill_corpus`")
    try:
        recorded = read_corpus_metadata(source).get("tokenizer")
    except CorpusError:
        recorded = None
    fingerprint = tokenizer_fingerprint(tokenizer)["vocab_sha256"]
    if isinstance(recorded, dict) and recorded.get("vocab_sha256") != fingerprint:
        raise ConfigError(f"drafter.vocab_counts={corpus} holds token ids of another tokenizer "
                          f"({recorded.get('tokenizer')}): count this model's own answers, or set drafter.vocab_top_k=0")
    column = pq.read_table(source, columns=["answer_ids"]).column("answer_ids").combine_chunks()
    return rank_tokens(column.values.to_numpy(), len(tokenizer), f"{corpus} (sha256 {sha256_file(source)[:16]})",
                       fingerprint)


def reduced_ids(tokenizer: PreTrainedTokenizerBase, vocab_size: int, count: int, corpus: str | None,
                pinned: Path | None, name: str) -> tuple[Tensor, float, str] | None:
    """The `count` most frequent ids, their coverage and where they were counted: in `corpus` when
    given; else the ranking pinned beside the weights (`pinned`, where it exists); else the shipped
    chat corpus where it is this tokenizer's. None (logged) when none of these applies."""
    if not 0 < count < vocab_size:
        raise ConfigError(f"{name}: vocab_top_k must be between 1 and the vocabulary size {vocab_size} (0 = off), "
                          f"got {count}")
    if corpus is None and pinned is not None and pinned.is_file():
        ranking = read_ranking(pinned, tokenizer, vocab_size, name)
        return (*ranking.top(count, name), f"the ranking pinned in {pinned.name} ({ranking.source})")
    try:
        return (*frequent_tokens(corpus or DEFAULT_VOCAB_COUNTS, tokenizer, count), corpus or DEFAULT_VOCAB_COUNTS)
    except ConfigError as error:
        if corpus is not None:
            raise
        log.warning("%s: drafting over the full vocabulary (%s)", name, error)
        return None


def reduce_vocabulary(draft: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, count: int,
                      corpus: str | None, name: str, pinned: Path | None = None) -> None:
    """With `count` > 0, swaps the draft's output layer for a ReducedVocabHead over the `count` most
    frequent tokens (`reduced_ids`: of `corpus`, else of the ranking `pinned` beside the draft, else of
    the shipped chat corpus); the full vocabulary stays where none applies (logged)."""
    if not count:
        return
    vocab = int(draft.config.vocab_size)
    found = reduced_ids(tokenizer, vocab, count, corpus, pinned, name)
    if found is None:
        return
    ids, coverage, source = found
    draft.set_output_embeddings(ReducedVocabHead(output_weight(draft, name), ids, vocab))
    log.info("%s: drafting over the %d most frequent tokens of %s (%.1f%% of its tokens; the rest are never "
             "drafted)", name, count, source, 100 * coverage)


def output_weight(model: PreTrainedModel, name: str) -> Tensor:
    """The output layer's weight [vocab, hidden], also after an engine rewrote that layer (tied models)."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if weight is None and model.config.tie_word_embeddings:
        weight = model.get_input_embeddings().weight  # the output layer was rewritten by an engine
    if weight is None:
        raise ConfigError(f"{name}: vocab_top_k needs the model's output weights, which its output layer "
                          f"({type(head).__name__}) does not expose")
    return weight
