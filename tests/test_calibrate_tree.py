"""A static tree calibrated on held-out answers (task=calibrate_tree, tree=static calibration=FILE): the
path statistics, the file's checks, the per-step size the cost curve pays for, and the ranks the task
measures against the drafter's own drafting API."""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from conftest import medusa_head_dir, random_prompts, run_steps
from specpipe.cost import CostCurve
from specpipe.errors import ConfigError
from specpipe.pipelines.builder import build_pipeline, compose_config
from specpipe.stages.draft.medusa import ROOT, load_medusa
from specpipe.stages.tree.calibration import (best_size, count_paths, ranked_paths, read_calibration,
                                              write_calibration)
from specpipe.stages.tree.static import StaticTreeBuilder
from specpipe.target import TargetModel
from specpipe.types import DecodeState
from test_distill_draft import write_corpus
from test_medusa import KnownDrafter


def test_paths_count_every_prefix_up_to_the_first_miss():
    ranks = torch.tensor([[0, 0, 1], [0, 2, -1], [1, 0, 0], [0, 12, 0], [-1, 0, 0], [0, 0, 1]])
    counts = count_paths(ranks, max_rank=10)
    assert counts == Counter({(0,): 4, (0, 0): 2, (0, 0, 1): 2, (0, 2): 1, (1,): 1, (1, 0): 1, (1, 0, 0): 1})
    paths, probabilities = ranked_paths(counts, positions=6, keep=5)
    # ties: shorter first, then lower ranks, so a path never comes before its prefix
    assert paths == [(0,), (0, 0), (0, 0, 1), (1,), (0, 2)]
    assert probabilities == pytest.approx([4 / 6, 2 / 6, 2 / 6, 1 / 6, 1 / 6])


def curve(*times: float) -> CostCurve:
    """A cost curve of the given milliseconds at 1, 2, 3, ... query rows (rising on past the last)."""
    return CostCurve(tuple(range(1, len(times) + 1)), tuple(float(t) for t in times))


def test_best_size_maximises_expected_tokens_per_millisecond():
    probabilities = [0.5, 0.3, 0.2, 0.1, 0.05]
    assert best_size(probabilities, CostCurve.flat()) == 5  # every path adds tokens at no cost
    assert best_size(probabilities, curve(10, 100)) == 0  # any draft costs 10x a plain step
    times = (10, 11, 12, 14, 17, 21)
    brute = max(range(6), key=lambda n: (1 + sum(probabilities[:n])) / times[n])
    assert best_size(probabilities, curve(*times)) == brute == 2


def test_calibration_files_are_checked(tmp_path):
    good = tmp_path / "tree.json"
    write_calibration(good, [(0,), (0, 0), (1,)], [0.5, 0.25, 0.2], {"drafter": "medusa"})
    assert read_calibration(good) == ([(0,), (0, 0), (1,)], [0.5, 0.25, 0.2])
    with pytest.raises(ConfigError, match="task=calibrate_tree"):
        read_calibration(tmp_path / "missing.json")

    def broken(**fields) -> str:
        document = {**json.loads(good.read_text()), **fields}
        (tmp_path / "bad.json").write_text(json.dumps(document))
        with pytest.raises(ConfigError) as error:
            read_calibration(tmp_path / "bad.json")
        return str(error.value)

    assert "not a tree calibration" in broken(format="something else")
    assert "format_version" in broken(format_version=99)
    assert "most likely first" in broken(probabilities=[0.2, 0.25, 0.5])
    assert "before its prefix" in broken(paths=[[0], [1, 0], [1]])
    assert "as many probabilities" in broken(probabilities=[0.5])
    assert "probability in [0, 1]" in broken(probabilities=[1.5, 0.25, 0.2])


def test_a_calibrated_static_tree_verifies_the_paths_the_cost_curve_pays_for(tmp_path):
    calibration = tmp_path / "tree.json"
    write_calibration(calibration, [(0,), (0, 0), (1,), (0, 0, 0), (0, 1)], [0.6, 0.4, 0.2, 0.15, 0.1], {})
    state = DecodeState(tokens=[1, 2], prompt_length=1)

    def drafted(cost: CostCurve, max_nodes: int = 64) -> set[tuple[int, ...]]:
        tree = StaticTreeBuilder(calibration=str(calibration), cost_curve=cost, max_nodes=max_nodes).build(
            state, [], [KnownDrafter()])
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        paths: dict[int, tuple[int, ...]] = {}
        for node, (token, parent) in enumerate(zip(tokens, parents)):
            paths[node] = (paths[parent] if parent != ROOT else ()) + (token,)
        return set(paths.values())

    # KnownDrafter ranks token ids 100 d + 0, 1, ... after a node at depth d: path [0, 1] -> tokens (0, 101)
    assert drafted(CostCurve.flat()) == {(0,), (0, 100), (1,), (0, 100, 200), (0, 101)}
    assert drafted(CostCurve.flat(), max_nodes=2) == {(0,), (0, 100)}
    assert drafted(curve(10, 12, 13, 30)) == {(0,), (0, 100)}  # (1 + 1.0) / 13 beats 1.6/12 and 2.2/30
    assert drafted(curve(10, 100)) == set()  # a plain step: nothing drafted
    with pytest.raises(ConfigError, match="task=calibrate_tree"):
        StaticTreeBuilder(calibration=str(tmp_path / "none.json"))


@pytest.mark.parametrize("hydra", [False, True])
def test_true_path_ranks_match_the_drafters_own_distributions(tiny_mixed, hydra):
    """The ranks the task counts equal the ranks of the same tokens in what the drafter hands a tree
    builder when it drafts along the true path (start, then step on the true tokens)."""
    config = tiny_mixed.loaded.model.config
    drafter = load_medusa(TargetModel(tiny_mixed.loaded.model, name="tiny_mixed"), tiny_mixed.tokenizer, hydra=hydra,
                          path=str(medusa_head_dir(config, "random", hydra=hydra)), vocab_top_k=1000)
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(6, config.hidden_size, generator=generator)  # [n, hidden]
    following = torch.randint(0, config.vocab_size, (6, 4), generator=generator)  # [n, K + 1]
    following[:, 1:] = drafter.draft_vocab[torch.randint(0, 1000, (6, 3), generator=generator)]
    following[0, 2] = int(torch.ones(config.vocab_size).index_fill(0, drafter.draft_vocab, 0).nonzero()[0])
    ranks = drafter.true_path_ranks(hidden, following)
    assert ranks.shape == (6, 3) and ranks[0, 1] == -1  # a token outside the reduced vocabulary
    column_of = {int(token): column for column, token in enumerate(drafter.draft_vocab)}
    for n in range(6):
        state = DecodeState(tokens=[5, int(following[n, 0])], prompt_length=1, hidden=hidden[n])
        drafter.reset(state)
        rows = [drafter.start(state)]
        tokens, parents = following[n, 1:].tolist(), [ROOT, 0, 1]
        rows += list(drafter.step(state, tokens, parents, [0, 1]))  # the nodes at depths 1 and 2 of the true path
        for k, row in enumerate(rows):
            column = column_of.get(tokens[k])
            expected = -1 if column is None else int((row > row[column]).sum())
            assert int(ranks[n, k]) == expected, (n, k)


def test_calibrate_tree_task_writes_a_tree_the_pipeline_reads(tiny_mixed, tmp_path):
    """The task writes tree.json beside the heads; tree=static (calibration=auto) then uses it for those
    heads, keeps its listed choices for heads without one, and decodes greedy output either way."""
    import shutil

    from specpipe.tasks import TASKS
    from specpipe.tasks.calibrate_tree import run_calibrate_tree

    assert TASKS["calibrate_tree"] == ("specpipe.tasks.calibrate_tree", "run_calibrate_tree")
    corpus, heads = tmp_path / "corpus.parquet", tmp_path / "heads"
    write_corpus(corpus)
    shutil.copytree(medusa_head_dir(tiny_mixed.loaded.model.config, "random"), heads)
    drafter = [f"pipeline.drafters.medusa.path={heads}", "pipeline.drafters.medusa.vocab_top_k=0"]
    config = compose_config(["task=calibrate_tree", "model=tiny_random", "pipeline=medusa", "cost_curve=flat", *drafter,
                             f"calibrate_tree.corpus={corpus}", "calibrate_tree.eval_fraction=0.5",
                             "calibrate_tree.paths=12", "calibrate_tree.progress=false"])
    result = run_calibrate_tree(config)
    out = heads / "tree.json"
    document = json.loads(out.read_text())
    paths, probabilities = read_calibration(out)
    assert result["out"] == str(out) and document["positions"] == result["positions"] > 0 and len(paths) <= 12
    assert document["corpus"]["held_out_answers"] >= 1 and document["heads_sha256"]
    assert [list(p) for p in result["paths"]] == document["paths"]
    assert result["chosen"] == len(paths)  # a flat cost curve pays for every path

    with pytest.raises(ConfigError, match=r"no corpus at .*nothing.parquet: .* or set calibrate_tree.corpus"):
        run_calibrate_tree(compose_config(["task=calibrate_tree", "model=tiny_random", "pipeline=medusa", *drafter,
                                           f"calibrate_tree.corpus={tmp_path / 'nothing.parquet'}"]))
    with pytest.raises(ConfigError, match="calibrates Medusa or Hydra heads"):
        run_calibrate_tree(compose_config(["task=calibrate_tree", "model=tiny_random", "pipeline=lookahead_trie",
                                           f"calibrate_tree.corpus={corpus}", "calibrate_tree.progress=false"]))

    calibrated = build_pipeline(tiny_mixed.config("medusa", *drafter), loaded=tiny_mixed.loaded)
    uncalibrated = medusa_head_dir(tiny_mixed.loaded.model.config, "random")  # the same heads, no tree.json
    listed = build_pipeline(tiny_mixed.config("medusa", f"pipeline.drafters.medusa.path={uncalibrated}",
                                              "pipeline.drafters.medusa.vocab_top_k=0"), loaded=tiny_mixed.loaded)
    for prompt in random_prompts(4, seed=9):
        expected = tiny_mixed.greedy_hf(prompt, 16)
        assert run_steps(calibrated, prompt, 16)[0] == expected
        assert run_steps(listed, prompt, 16)[0] == expected
    assert calibrated.decoder.tree_builder.ranked == paths
    assert listed.decoder.tree_builder.probabilities is None
    assert len(listed.decoder.tree_builder.choices) == len(compose_config(["pipeline=medusa"]).pipeline.tree.choices)

    # Other weights copied in beside the calibration: it does not describe them, so the listed choices serve.
    swapped = tmp_path / "swapped"
    shutil.copytree(heads, swapped)
    identity = medusa_head_dir(tiny_mixed.loaded.model.config, "identity")
    for weights in [*identity.glob("*.safetensors"), identity / "config.json"]:  # with the checksum of their own
        shutil.copy(weights, swapped / weights.name)
    stale = build_pipeline(tiny_mixed.config("medusa", f"pipeline.drafters.medusa.path={swapped}",
                                             "pipeline.drafters.medusa.vocab_top_k=0"), loaded=tiny_mixed.loaded)
    prompt = random_prompts(1, seed=10)[0]
    assert run_steps(stale, prompt, 16)[0] == tiny_mixed.greedy_hf(prompt, 16)
    assert stale.decoder.tree_builder.probabilities is None
    assert stale.decoder.tree_builder.choices == listed.decoder.tree_builder.choices
