"""task=search_layers (specpipe.distill.layer_search): which target layers drafter=layer_skip keeps.

The agreement a subset scores is checked against its definition (the full model agrees with its
own choices everywhere; a vocabulary without the reference tokens agrees nowhere), the shared-prefix
shortcut against evaluating every subset from scratch, each elimination step against a brute-force
search over single removals, and the task end to end, down to the drafter reading its result."""
from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from conftest import random_prompts
from specpipe.distill.layer_search import AgreementProbe, ProbeSequence, backward_elimination, elimination_forwards
from specpipe.errors import ConfigError
from specpipe.paths import DATA_DIR
from specpipe.pipelines.builder import compose_config, load_model
from specpipe.stages.draft.draft_vocab import pinned_vocab_path, read_ranking
from specpipe.stages.draft.layer_search_file import read_searched_layers
from specpipe.stages.draft.layer_skip import load_layer_skip
from specpipe.stages.draft.reduced_vocab import ReducedVocabHead
from specpipe.target import TargetModel
from test_distill_draft import write_corpus


@pytest.fixture(scope="module")
def four_layers():
    return load_model(compose_config(["model=tiny_random", "model.num_hidden_layers=4", "model.seed=5"]).model).model


def own_choices(model, count: int = 3, length: int = 48, scored: int = 24) -> list[ProbeSequence]:
    """Sequences whose reference tokens are the full model's own top-1 at the last `scored` positions."""
    sequences = []
    for prompt in random_prompts(count, seed=41):
        ids = torch.tensor(prompt[:length])
        with torch.inference_mode():
            choices = model(input_ids=ids[None], use_cache=False).logits[0].argmax(-1)  # [T]
        positions = torch.arange(max(0, len(ids) - scored), len(ids))
        sequences.append(ProbeSequence(ids, positions, choices[positions]))
    return sequences


def without(layers, index):
    return [layer for i, layer in enumerate(layers) if i != index]


def test_agreement_means_top1_equals_the_reference(four_layers):
    sequences = own_choices(four_layers)
    probe = AgreementProbe(four_layers, sequences)
    assert probe.positions == sum(len(s.positions) for s in sequences) > 40
    assert probe.agreement([0, 1, 2, 3]) == 1.0  # the full model agrees with its own choices
    assert probe.agreement([0]) < 1.0
    # Restricting the argmax to tokens that include every reference token can only agree more;
    # a vocabulary without them agrees nowhere.
    references = torch.cat([s.targets for s in sequences]).unique()
    others = torch.tensor([t for t in range(50, 400) if t not in set(references.tolist())][:64])
    restricted = AgreementProbe(four_layers, sequences, torch.cat([references, others]))
    assert restricted.agreement([0]) >= probe.agreement([0])
    assert AgreementProbe(four_layers, sequences, others).agreement([0, 1, 2, 3]) == 0.0


def test_dropping_each_layer_from_a_shared_prefix_equals_evaluating_each_subset(four_layers):
    probe = AgreementProbe(four_layers, own_choices(four_layers))
    for layers in ([0, 1, 2, 3], [0, 2, 3], [1, 3]):
        calls = []
        shortcut = probe.agreement_without_each(layers, lambda: calls.append(1))
        assert shortcut == [probe.agreement(without(layers, i)) for i in range(len(layers))]
        assert len(calls) == len(layers) * len(probe.sequences)


def test_each_elimination_step_keeps_the_best_single_removal(four_layers):
    probe = AgreementProbe(four_layers, own_choices(four_layers))
    rows = backward_elimination(probe, min_layers=1)
    assert [len(row.layers) for row in rows] == [4, 3, 2, 1]
    assert rows[0].layers == (0, 1, 2, 3) and rows[0].dropped is None and rows[0].agreement == 1.0
    for before, after in zip(rows, rows[1:]):
        assert set(before.layers) - set(after.layers) == {after.dropped}
        candidates = [probe.agreement(without(before.layers, i)) for i in range(len(before.layers))]
        assert after.agreement == max(candidates) == probe.agreement(after.layers)
    assert elimination_forwards(4, 1, len(probe.sequences)) == 3 * (4 + 3 + 2)


def test_a_model_that_rescales_inputs_embeds_is_refused(four_layers, monkeypatch):
    probe = AgreementProbe(four_layers, own_choices(four_layers, count=1))
    original = probe._layer_inputs
    monkeypatch.setattr(probe, "_layer_inputs", lambda layers, s: [h * 2.0 for h in original(layers, s)])
    with pytest.raises(ConfigError, match="inputs_embeds"):
        backward_elimination(probe, min_layers=2)


def test_bad_search_arguments_are_clear(four_layers):
    with pytest.raises(ConfigError, match="no answer positions"):
        AgreementProbe(four_layers, [])
    probe = AgreementProbe(four_layers, own_choices(four_layers, count=1))
    for bad in (0, 4):
        with pytest.raises(ConfigError, match=r"min_layers must be between 1 and 3"):
            backward_elimination(probe, min_layers=bad)


def test_the_task_writes_a_search_the_drafter_reads(tmp_path):
    from specpipe.tasks import TASKS
    from specpipe.tasks.search_layers import run_search_layers

    assert TASKS["search_layers"] == ("specpipe.tasks.search_layers", "run_search_layers")
    corpus, out = tmp_path / "corpus.parquet", tmp_path / "search" / "layers.json"
    write_corpus(corpus)
    cfg = compose_config(["task=search_layers", "model=tiny_random", f"search_layers.corpus={corpus}",
                          f"search_layers.out={out}", "search_layers.eval_fraction=1.0", "search_layers.min_layers=1",
                          "search_layers.positions=100", "search_layers.vocab_top_k=0", "search_layers.progress=false"])
    result = run_search_layers(cfg)
    with pytest.raises(ConfigError, match=r"no corpus at .*nothing.parquet: .* or set search_layers.corpus"):
        run_search_layers(compose_config(["task=search_layers", "model=tiny_random",
                                          f"search_layers.corpus={tmp_path / 'nothing.parquet'}"]))
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(result))
    assert [row["kept"] for row in written["rows"]] == [2, 1] and 0 < written["positions"] <= 100
    # The corpus holds the tiny model's own greedy answers: the full model agrees (nearly) everywhere.
    assert written["rows"][0]["agreement"] >= 0.95
    assert written["rows"][0]["early_exit_agreement"] == written["rows"][0]["agreement"]
    assert (out.parent / "layer_search.png").is_file()

    loaded = load_model(compose_config(["model=tiny_random"]).model)
    target = TargetModel(loaded.model, name="tiny_random")
    drafter = load_layer_skip(target, loaded.tokenizer, "searched", keep=1, search=str(out))
    assert list(drafter.runner.model.kept_layers) == written["rows"][1]["layers"]
    # Beside the search: the ranking of the corpus's tokens, which layer_skip's reduced vocabulary reads.
    pinned = read_ranking(pinned_vocab_path(out), loaded.tokenizer, loaded.model.config.vocab_size, "test")
    answers = np.concatenate(pq.read_table(corpus, columns=["answer_ids"]).column("answer_ids").to_pylist())
    np.testing.assert_array_equal(pinned.counts, np.bincount(answers, minlength=loaded.model.config.vocab_size))
    reduced = load_layer_skip(target, loaded.tokenizer, [0], vocab_top_k=5, search=str(out))
    head = reduced.runner.model.get_output_embeddings()
    assert isinstance(head, ReducedVocabHead) and head.ids.tolist() == pinned.top(5, "test")[0].tolist()

    vocab = written["tokenizer"]["vocab_sha256"]
    with pytest.raises(ConfigError, match=r"holds sets of 1\.\.2 layers"):
        read_searched_layers(out, "tiny_random", vocab, 5)
    with pytest.raises(ConfigError, match=r"searched for model=tiny_random, not smollm2_135m"):
        read_searched_layers(out, "smollm2_135m", vocab, 1)
    with pytest.raises(ConfigError, match="task=search_layers"):
        read_searched_layers(tmp_path / "missing.json", "tiny_random", vocab, 1)
    out.write_text("{not json")
    with pytest.raises(ConfigError, match="not a readable layer search"):
        read_searched_layers(out, "tiny_random", vocab, 1)
    with pytest.raises(ConfigError, match="needs drafter.keep"):
        load_layer_skip(target, loaded.tokenizer, "searched")


@pytest.mark.embedded
def test_the_shipped_search_drafts_losslessly_for_the_embedded_model(embedded):
    """data/layer_skip/ holds the search for the embedded model: `layers=searched keep=20` builds the
    drafter on that row's layers, and decoding through it stays plain greedy."""
    search = json.loads((DATA_DIR / "layer_skip" /
                         "smollm2_135m_layers.json").read_text())
    row = next(r for r in search["rows"] if r["kept"] == 20)
    pipe = embedded.pipeline("draft_model", "~pipeline.drafters.model", "+drafter@pipeline.drafters.skip=layer_skip",
                             "pipeline.drafters.skip.layers=searched", "pipeline.drafters.skip.keep=20", fresh=True)
    assert list(pipe.decoder.drafters[0].runner.model.kept_layers) == row["layers"]
    prompt_ids = pipe.encode("Explain what a Python decorator is.")
    assert pipe.generate(prompt_ids, max_new_tokens=24).token_ids == embedded.greedy_hf(prompt_ids, 24)
