"""The reduced draft vocabulary pinned beside a head or a draft (`draft_vocab.npz`, `<draft>.vocab.npz`):
the loaders draft over it instead of counting the shipped corpus, an explicit `vocab_counts` still
wins, the training tasks write it, and a bad file is refused with a message."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import eagle_head_dir, medusa_head_dir, random_prompts, tiny_draft_dir
from specpipe.errors import ConfigError
from specpipe.paths import PACKAGE_ROOT
from specpipe.pipelines.builder import build_pipeline
from specpipe.stages.draft.draft_vocab import TokenRanking, pinned_vocab_path, read_ranking, write_ranking
from specpipe.stages.draft.reduced_vocab import ReducedVocabHead
from specpipe.stores.manifest import tokenizer_fingerprint
from test_draft_model import write_answer_corpus

REPO = Path(__file__).resolve().parents[1]


def favourite_tokens(model, count: int) -> list[int]:
    """`count` tokens the tiny model's greedy answers use (so their drafts are sometimes accepted)."""
    prompts = random_prompts(4, seed=41)
    return sorted({t for p in prompts for t in model.greedy_hf(p, 16)})[:count]


def pin(artifact: Path, tokenizer, favourite: list[int], vocab_size: int) -> None:
    """A ranking whose most frequent tokens are `favourite`, written beside `artifact`."""
    counts = np.zeros(vocab_size, np.int64)
    counts[favourite] = 100 + np.arange(len(favourite))
    counts[np.arange(vocab_size) % 7 == 0] += 1  # a tail, which the top-k must leave out
    write_ranking(pinned_vocab_path(artifact), TokenRanking(
        counts, "a test ranking", tokenizer_fingerprint(tokenizer)["vocab_sha256"]))


def test_a_ranking_round_trips_and_ranks_by_count_then_id(tiny_mixed, tmp_path):
    from specpipe.stages.draft.draft_vocab import rank_tokens

    fingerprint = tokenizer_fingerprint(tiny_mixed.tokenizer)["vocab_sha256"]
    ranking = rank_tokens(np.array([9, 5, 5, 9, 700, 3]), 1000, "five answers", fingerprint)
    assert ranking.ids[:4].tolist() == [5, 9, 3, 700]  # ties (3 and 700, once each) by id, then the unused ids
    ids, coverage = ranking.top(3, "test")
    assert ids.tolist() == [3, 5, 9] and coverage == pytest.approx(5 / 6)
    path = tmp_path / "draft_vocab.npz"
    write_ranking(path, ranking)
    back = read_ranking(path, tiny_mixed.tokenizer, 1000, "test")
    assert back.counts.tolist() == ranking.counts.tolist() and back.source == "five answers"
    with pytest.raises(ConfigError, match="vocab_top_k must be between 1 and the 1000 tokens"):
        ranking.top(1001, "test")


DRAFTER_KEY = {"draft_model": "model", "eagle": "eagle", "medusa": "medusa", "hydra": "hydra"}  # pipeline.drafters.KEY


def check_greedy_over_reduced_vocabulary(harness, pipeline: str, tmp_path: Path, *overrides: str) -> None:
    """The pipeline's drafter scores only `favourite_tokens` (vocab_top_k over a counted corpus): its greedy
    output equals HF greedy, and every node it drafts is one of those tokens. tests/test_cuda.py runs the
    same check with the model on the GPU, where the drafter's token ids must live beside its logits."""
    favourite = favourite_tokens(harness, 24)
    corpus = tmp_path / "answers.parquet"
    write_answer_corpus(corpus, [favourite * 3])
    key = DRAFTER_KEY[pipeline]
    pipe = build_pipeline(harness.config(pipeline, f"pipeline.drafters.{key}.vocab_top_k={len(favourite)}",
                                         f"pipeline.drafters.{key}.vocab_counts={corpus}", *overrides),
                          loaded=harness.loaded)
    drafted = set()
    original = pipe.decoder.tree_builder.build

    def build(state, proposals, drafters):
        tree = original(state, proposals, drafters)
        drafted.update(tree.tokens.tolist())
        return tree

    pipe.decoder.tree_builder.build = build
    for prompt in random_prompts(3, seed=42):
        assert pipe.generate(prompt, max_new_tokens=12).token_ids == harness.greedy_hf(prompt, 12)
    assert drafted and drafted <= set(favourite)


@pytest.mark.parametrize("pipeline", sorted(DRAFTER_KEY))
def test_greedy_over_a_reduced_vocabulary_equals_greedy(tiny_mixed, tmp_path, pipeline):
    check_greedy_over_reduced_vocabulary(tiny_mixed, pipeline, tmp_path)


def test_a_reduced_vocabulary_head_keeps_its_token_ids_on_its_weights_device():
    """The tree builders index these ids with top-k columns computed beside the weights (on a GPU: a CPU
    buffer there failed every reduced-vocabulary drafter, run 36)."""
    head = ReducedVocabHead(torch.empty(1000, 16, device="meta"), torch.tensor([3, 7, 500]), 1000)
    assert head.ids.device.type == "meta" and head.target_ids.device.type == "meta"


@pytest.mark.parametrize("pipeline", ["eagle", "medusa", "draft_model"])
def test_a_draft_drafts_over_the_ranking_pinned_beside_it(tiny_mixed, tmp_path, pipeline):
    vocab = tiny_mixed.loaded.model.config.vocab_size
    favourite = favourite_tokens(tiny_mixed, 24)
    source = {"eagle": lambda: eagle_head_dir(tiny_mixed.loaded.model.config, "random"),
              "medusa": lambda: medusa_head_dir(tiny_mixed.loaded.model.config, "random"),
              "draft_model": lambda: tiny_draft_dir()}[pipeline]()
    artifact = tmp_path / "artifact"
    shutil.copytree(source, artifact)
    pin(artifact, tiny_mixed.tokenizer, favourite, vocab)
    key = DRAFTER_KEY[pipeline]
    overrides = [f"pipeline.drafters.{key}.path={artifact}", f"pipeline.drafters.{key}.vocab_top_k={len(favourite)}"]

    def output_layer(pipe):
        drafter = pipe.decoder.drafters[0] if pipe.decoder.drafters else pipe.decoder.proposers[0]
        return {"eagle": lambda: drafter.head, "medusa": lambda: drafter.outputs[0],
                "draft_model": lambda: drafter.runner.model.get_output_embeddings()}[pipeline]()

    pipe = build_pipeline(tiny_mixed.config(pipeline, *overrides), loaded=tiny_mixed.loaded)
    head = output_layer(pipe)
    assert isinstance(head, ReducedVocabHead) and head.ids.tolist() == favourite
    for prompt in random_prompts(2, seed=42):
        assert pipe.generate(prompt, max_new_tokens=12).token_ids == tiny_mixed.greedy_hf(prompt, 12)

    # An explicit corpus is counted instead of the pinned ranking.
    corpus = tmp_path / "answers.parquet"
    others = [t for t in range(10, 10 + 3 * len(favourite)) if t not in favourite][: len(favourite)]
    write_answer_corpus(corpus, [others * 2])
    counted = build_pipeline(tiny_mixed.config(pipeline, *overrides, f"pipeline.drafters.{key}.vocab_counts={corpus}"),
                             loaded=tiny_mixed.loaded)
    assert output_layer(counted).ids.tolist() == sorted(others)


def test_a_bad_pinned_ranking_is_refused_with_a_message(tiny_mixed, tmp_path):
    vocab = tiny_mixed.loaded.model.config.vocab_size
    folder = tmp_path / "head"
    shutil.copytree(eagle_head_dir(tiny_mixed.loaded.model.config, "random"), folder)
    overrides = (f"pipeline.drafters.eagle.path={folder}", "pipeline.drafters.eagle.vocab_top_k=16")
    path = pinned_vocab_path(folder)

    write_ranking(path, TokenRanking(np.ones(vocab, np.int64), "another model's answers", "0" * 32))
    with pytest.raises(ConfigError, match="counted with another tokenizer"):
        build_pipeline(tiny_mixed.config("eagle", *overrides), loaded=tiny_mixed.loaded)
    fingerprint = tokenizer_fingerprint(tiny_mixed.tokenizer)["vocab_sha256"]
    write_ranking(path, TokenRanking(np.ones(vocab + 1, np.int64), "a longer vocabulary", fingerprint))
    with pytest.raises(ConfigError, match=f"malformed: at most {vocab} non-negative counts expected"):
        build_pipeline(tiny_mixed.config("eagle", *overrides), loaded=tiny_mixed.loaded)
    path.write_bytes(b"not an npz")
    with pytest.raises(ConfigError, match="cannot be read"):
        build_pipeline(tiny_mixed.config("eagle", *overrides), loaded=tiny_mixed.loaded)
    with pytest.raises(ConfigError, match="vocab_top_k must be between 1 and the vocabulary size"):
        build_pipeline(tiny_mixed.config("eagle", f"pipeline.drafters.eagle.path={folder}",
                                         f"pipeline.drafters.eagle.vocab_top_k={vocab}"), loaded=tiny_mixed.loaded)


CHAT_2M = (2_076_540, "37ac301229ebb209")  # the 2.08M-token corpus (sha256 37ac3012...) of run 18
CHAT_3M = (3_140_420, "47b7fe8633c2ed9d")  # the 3.14M-token corpus (sha256 47b7fe86...) of run 33


@pytest.mark.parametrize("artifact,corpus", [
    ("data/eagle/smollm2_135m", CHAT_2M), ("data/eagle/smollm2_135m_bf16", CHAT_2M), ("data/medusa/smollm2_135m", CHAT_2M),
    ("data/layer_skip/smollm2_135m_layers.json", CHAT_2M),
    ("data/draft/smollm2_135m_draft.safetensors", CHAT_3M),  # distilled on that corpus in run 40
    ("data/hydra/smollm2_135m", CHAT_3M),  # trained on that corpus in run 49
])
def test_each_shipped_head_and_draft_pins_its_vocabulary(artifact, corpus):
    """What the shipped artifacts draft over no longer moves with the chat corpus: each carries the
    ranking of the corpus it was served with since it shipped."""
    tokens, sha256 = corpus
    with np.load(pinned_vocab_path(PACKAGE_ROOT / artifact), allow_pickle=False) as data:
        counts, source = data["counts"], str(data["source"])
    assert counts.shape == (49152,) and counts.sum() == tokens and sha256 in source


@pytest.mark.parametrize("where", ["middle", "end"])
def test_a_garbled_pinned_ranking_is_refused_naming_the_file_and_the_rebuild(tiny_mixed, tmp_path, where):
    """Bytes of draft_vocab.npz overwritten in place (the size unchanged): a ConfigError naming the file and
    how to write it again, not a traceback from inside numpy or zipfile."""
    fingerprint = tokenizer_fingerprint(tiny_mixed.tokenizer)["vocab_sha256"]
    vocab = tiny_mixed.loaded.model.config.vocab_size
    path = tmp_path / "head" / "draft_vocab.npz"
    path.parent.mkdir()
    rng = np.random.default_rng(0)
    write_ranking(path, TokenRanking(rng.integers(0, 1000, vocab), "a test ranking", fingerprint))
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if where == "middle" else len(data) - 30
    data[at:at + 16] = bytes(range(200, 216))
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=rf"{path}.*(task=train_heads|git checkout)"):
        read_ranking(path, tiny_mixed.tokenizer, vocab, "eagle")
