"""drafter=medusa and tree=static: heads on the target's hidden state, Medusa's sparse tree, the released
checkpoint layouts, and the errors. Lossless runs of `pipeline=medusa` are in the generic tests
(identity heads of conftest.medusa_head_dir on the tiny models)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from conftest import medusa_head_dir, random_prompts, run_steps
from specpipe.cost import CostCurve
from specpipe.errors import ConfigError
from specpipe.pipelines.builder import build_pipeline
from specpipe.stages.draft.medusa import ROOT, load_medusa
from specpipe.stages.tree.static import StaticTreeBuilder
from specpipe.target import TargetModel
from specpipe.types import DecodeState
from specpipe.stages.base import StepDrafter


def test_right_drafts_are_accepted_whole_and_stay_lossless(tiny):
    """The stock tiny model repeats its last token and identity heads draft exactly that: every node of
    the static tree's main path is accepted, output = greedy. The default choices reach depth 4 but
    there are 3 heads: nothing is drafted past the last head."""
    pipe = build_pipeline(tiny.config("medusa"), loaded=tiny.loaded)
    for prompt in random_prompts(3, seed=41):
        tokens, steps = run_steps(pipe, prompt, 20)
        assert tokens == tiny.greedy_hf(prompt, 20)
        assert all(len(step.tokens) == 4 for step in steps[1:-1])  # 3 drafted + the bonus


def test_each_head_drafts_its_own_depth_from_the_hidden_state(tiny_mixed):
    drafter = load_medusa(TargetModel(tiny_mixed.loaded.model, name="tiny_mixed"), tiny_mixed.tokenizer,
                          path=str(medusa_head_dir(tiny_mixed.loaded.model.config, "random")), vocab_top_k=0)
    hidden = torch.randn(tiny_mixed.loaded.model.config.hidden_size)
    state = DecodeState(tokens=[5, 6, 7], prompt_length=2, hidden=hidden)
    drafter.reset(state)
    root = drafter.start(state)
    with torch.inference_mode():
        expected = [torch.log_softmax(drafter.outputs[k](head(hidden[None])).float(), dim=-1)[0]
                    for k, head in enumerate(drafter.heads)]
    torch.testing.assert_close(root, expected[0])
    tokens, parents = [11, 12, 13, 14], [ROOT, ROOT, 0, 2]  # depths 1, 1, 2, 3
    rows = drafter.step(state, tokens, parents, [ROOT, 1, 2, 3])
    torch.testing.assert_close(rows[0], expected[0])
    torch.testing.assert_close(rows[1], expected[1])
    torch.testing.assert_close(rows[2], expected[2])
    assert torch.isinf(rows[3]).all() and (rows[3] < 0).all()  # depth 3: past the 3 heads


@pytest.mark.parametrize("hydra", [False, True])
def test_heads_over_a_reduced_vocabulary_draft_their_best_target_tokens(tiny_mixed, hydra):
    """With vocab_top_k the heads score the 1000 most frequent tokens and hand out those columns only
    (draft_vocab): the static tree's children of the root, and of its first child, are the heads'
    most likely target tokens with their probabilities, as over the whole vocabulary."""
    config = tiny_mixed.loaded.model.config
    drafter = load_medusa(TargetModel(tiny_mixed.loaded.model, name="tiny_mixed"), tiny_mixed.tokenizer, hydra=hydra,
                          path=str(medusa_head_dir(config, "random", hydra=hydra)), vocab_top_k=1000)
    assert drafter.draft_vocab is not None and len(drafter.draft_vocab) == 1000
    assert not torch.equal(drafter.draft_vocab, torch.arange(1000))  # columns are not token ids
    hidden = torch.randn(config.hidden_size)
    state = DecodeState(tokens=[5, 6, 7], prompt_length=2, hidden=hidden)
    drafter.reset(state)
    grown = StaticTreeBuilder([[0], [1], [2], [0, 0], [0, 1]]).grow(state, drafter)

    def full_vocab(depth: int, path: list[int]) -> torch.Tensor:  # [vocab], -inf outside the reduced vocabulary
        with torch.inference_mode():
            rows = hidden.to(drafter.target.dtype)[None]  # [1, hidden]
            if hydra:
                prefix = tiny_mixed.loaded.model.get_input_embeddings()(torch.tensor([[7, *path]]))
                rows = drafter.heads.run(depth, rows, prefix)
            else:
                rows = drafter.heads[depth](rows)
            return torch.log_softmax(drafter.outputs[depth](rows).float(), dim=-1)[0]

    first = full_vocab(0, []).topk(3)
    assert grown.tokens[:3].tolist() == first.indices.tolist()
    torch.testing.assert_close(grown.scores[:3], first.values.exp(), atol=1e-5, rtol=1e-4)
    second = full_vocab(1, [int(first.indices[0])]).topk(2)
    assert grown.tokens[3:].tolist() == second.indices.tolist()
    torch.testing.assert_close(grown.scores[3:], first.values[0].exp() * second.values.exp(), atol=1e-5, rtol=1e-4)
    chain = drafter.propose(state)  # one greedy chain (pipeline.proposers, tree=trie)
    assert chain.tokens[:2].tolist() == [int(first.indices[0]), int(second.indices[0])]


class KnownDrafter(StepDrafter):
    """A StepDrafter whose distribution after a node at depth d ranks token ids 100 d + 0, 1, 2, ..."""

    name = "known"
    vocab = 1000

    def start(self, state):
        return self._row(0)

    def step(self, state, tokens, parents, frontier):
        rows = []
        for node in frontier:
            depth, walk = 0, node
            while walk != ROOT:
                depth, walk = depth + 1, parents[walk]
            rows.append(self._row(depth))
        return torch.stack(rows)

    def _row(self, depth):
        logits = torch.full((self.vocab,), -50.0)
        logits[100 * depth: 100 * depth + 10] = -torch.arange(10.0)
        return torch.log_softmax(logits, dim=-1)


def test_the_static_tree_follows_the_choices():
    builder = StaticTreeBuilder([[0], [2], [0, 1], [0, 0], [2, 0], [0, 1, 3]], cost_curve=CostCurve.flat())
    proposal = builder.grow(DecodeState(tokens=[1, 2], prompt_length=1), KnownDrafter())
    tokens, parents = proposal.tokens.tolist(), proposal.parents.tolist()
    paths = {}
    for node, (token, parent) in enumerate(zip(tokens, parents)):
        paths[node] = (paths[parent] if parent != ROOT else ()) + (token,)
    # [0] -> token 0, [2] -> 2, [0, 0] -> 100, [0, 1] -> 101, [2, 0] -> 100, [0, 1, 3] -> 203
    assert sorted(paths.values()) == sorted([(0,), (2,), (0, 100), (0, 101), (2, 100), (0, 101, 203)])
    scores = proposal.scores.tolist()
    assert all(scores[node] <= scores[parent] for node, parent in enumerate(parents) if parent != ROOT)
    with pytest.raises(ConfigError, match=r"choice \[1, 0\] has no parent \[1\]"):
        StaticTreeBuilder([[0], [1, 0]])
    with pytest.raises(ConfigError, match="non-empty paths"):
        StaticTreeBuilder([[0], []])


def released_medusa(folder, hidden: int, vocab: int, heads: int = 2, layers: int = 1, layout: str = "original",
                    seed: int = 0) -> dict:
    """A synthetic checkpoint in the layout of Medusa's repository (config medusa_num_heads /
    medusa_num_layers, medusa_lm_head.safetensors with HEAD.BLOCK.linear.* and HEAD.LAYERS.weight), the
    same under a `medusa_head.` prefix (Medusa-2 model files), or vLLM's converted one (num_heads /
    num_hidden_layers, blocks.HEAD.layers.BLOCK.*, lm_heads.HEAD.weight). Returns the tensors in the
    original names."""
    generator = torch.Generator().manual_seed(seed)
    original = {}
    for head in range(heads):
        for block in range(layers):
            original[f"{head}.{block}.linear.weight"] = torch.randn(hidden, hidden, generator=generator) * 0.1
            original[f"{head}.{block}.linear.bias"] = torch.randn(hidden, generator=generator) * 0.1
        original[f"{head}.{layers}.weight"] = torch.randn(vocab, hidden, generator=generator) * 0.1
    folder.mkdir(parents=True, exist_ok=True)
    if layout == "converted":
        tensors = {}
        for key, value in original.items():
            head, block, rest = key.split(".", 2)
            if rest == "weight":
                tensors[f"lm_heads.{head}.weight"] = value
            else:
                tensors[f"blocks.{head}.layers.{block}.{rest.split('.')[1]}"] = value
        config = {"num_heads": heads, "num_hidden_layers": layers, "hidden_size": hidden, "vocab_size": vocab,
                  "truncated_vocab_size": vocab}
        save_file(tensors, str(folder / "model.safetensors"))
    else:
        prefix = "medusa_head." if layout == "prefixed" else ""
        config = {"medusa_num_heads": heads, "medusa_num_layers": layers, "base_model_name_or_path": "base"}
        save_file({prefix + key: value for key, value in original.items()}, str(folder / "medusa_lm_head.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return original


@pytest.mark.parametrize("layout", ["original", "prefixed", "converted"])
def test_released_medusa_layouts_load(tiny_mixed, tmp_path, layout):
    config = tiny_mixed.loaded.model.config
    original = released_medusa(tmp_path / "heads", config.hidden_size, config.vocab_size, layout=layout)
    drafter = load_medusa(TargetModel(tiny_mixed.loaded.model, name="tiny_mixed"), tiny_mixed.tokenizer,
                          path=str(tmp_path / "heads"), vocab_top_k=0)
    assert len(drafter.heads) == 2
    for key, value in drafter.heads.state_dict().items():
        assert torch.equal(value, original[key]), key
    for head in range(2):  # each head's own output layer, applied after its blocks (in a Sequential the engine swaps it in)
        assert torch.equal(drafter.outputs[head][0].weight, original[f"{head}.1.weight"])
    prompt = random_prompts(2, seed=42)[1]
    cfg = tiny_mixed.config("medusa", f"pipeline.drafters.medusa.path={tmp_path / 'heads'}")
    assert build_pipeline(cfg, loaded=tiny_mixed.loaded).generate(prompt, max_new_tokens=12).token_ids == \
        tiny_mixed.greedy_hf(prompt, 12)


def test_bad_medusa_checkpoints_are_refused(tiny_mixed, tmp_path):
    config = tiny_mixed.loaded.model.config
    target = TargetModel(tiny_mixed.loaded.model, name="tiny_mixed")

    def load(folder, **kwargs):
        return load_medusa(target, tiny_mixed.tokenizer, path=str(folder), vocab_top_k=0, **kwargs)

    released_medusa(tmp_path / "wide", 2 * config.hidden_size, config.vocab_size)
    with pytest.raises(ConfigError, match=rf"hidden size {config.hidden_size}.*another model"):
        load(tmp_path / "wide")
    released_medusa(tmp_path / "vocab", config.hidden_size, config.vocab_size + 3)
    with pytest.raises(ConfigError, match=rf"{config.vocab_size + 3} tokens.*another model"):
        load(tmp_path / "vocab")
    released_medusa(tmp_path / "count", config.hidden_size, config.vocab_size)
    (tmp_path / "count" / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1}))
    with pytest.raises(ConfigError, match="does not fit 3 heads"):
        load(tmp_path / "count")
    released_medusa(tmp_path / "noconfig", config.hidden_size, config.vocab_size)
    (tmp_path / "noconfig" / "config.json").write_text(json.dumps({"hidden_size": config.hidden_size}))
    with pytest.raises(ConfigError, match="not a Medusa checkpoint"):
        load(tmp_path / "noconfig")
    released_medusa(tmp_path / "ok", config.hidden_size, config.vocab_size)
    with pytest.raises(ConfigError, match="heads must be between 1 and the checkpoint's 2"):
        load(tmp_path / "ok", heads=3)
    assert len(load(tmp_path / "ok", heads=1).heads) == 1
    eagle = tmp_path / "eagle"
    eagle.mkdir()
    (eagle / "config.json").write_text(json.dumps({"medusa_num_heads": 1, "medusa_num_layers": 1}))
    save_file({"fc.weight": torch.zeros(4, 8)}, str(eagle / "model.safetensors"))
    with pytest.raises(ConfigError, match="EAGLE-1 checkpoint.*pipeline=eagle"):
        load(eagle)
    with pytest.raises(ConfigError, match="not a directory"):
        load(tmp_path / "missing")


def test_a_greedy_chain_under_the_trie_builder(tiny):
    """Under pipeline.proposers the heads draft one chain (each head's argmax): on the stock tiny model
    with identity heads the chain of 3 (the root repeated) is verified every step and accepted whole
    wherever the model repeats its last token, and the output is greedy."""
    from specpipe.pipelines.builder import compose_config

    cfg = compose_config([*tiny.overrides, "pipeline=medusa", "cost_curve=flat", "~pipeline.drafters.medusa",
                          "+drafter@pipeline.proposers.medusa=medusa",
                          f"pipeline.proposers.medusa.path={medusa_head_dir(tiny.loaded.model.config)}",
                          "pipeline.proposers.medusa.vocab_top_k=0", "tree@pipeline.tree=trie"])
    pipe = build_pipeline(cfg, loaded=tiny.loaded)
    assert len(pipe.decoder.proposers) == 1 and not pipe.decoder.drafters
    for prompt in random_prompts(2, seed=43):
        tokens, steps = run_steps(pipe, prompt, 16)
        assert tokens == tiny.greedy_hf(prompt, 16)
        decode_steps = steps[1:-1]
        assert all(step.stats.tree_size == 3 for step in decode_steps)
        assert sum(len(step.tokens) == 4 for step in decode_steps) >= len(decode_steps) / 2


# ---- Hydra ----------------------------------------------------------------------------------------
def hydra_drafter(model, kind: str = "random"):
    return load_medusa(TargetModel(model.loaded.model, name=model.name), model.tokenizer, name="hydra", hydra=True,
                       path=str(medusa_head_dir(model.loaded.model.config, kind, hydra=True)), vocab_top_k=0)


def test_hydra_heads_read_the_tokens_on_the_node_path(tiny_mixed):
    """Head d of a node at depth d reads [hidden, embedding(root), embeddings of the node's path]: two
    nodes at one depth with different paths get different distributions, each what the head computes
    for its own path; past the last head nothing is drafted."""
    drafter = hydra_drafter(tiny_mixed)
    embed = tiny_mixed.loaded.model.get_input_embeddings()
    hidden = torch.randn(tiny_mixed.loaded.model.config.hidden_size)
    state = DecodeState(tokens=[5, 6, 7], prompt_length=2, hidden=hidden)
    drafter.reset(state)

    def expected(path: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            prefix = embed(torch.tensor([[7] + path]))  # the root (7), then the path
            out = drafter.heads.run(len(path), hidden[None], prefix)
            return torch.log_softmax(drafter.outputs[len(path)](out).float(), dim=-1)[0]

    torch.testing.assert_close(drafter.start(state), expected([]))
    tokens, parents = [11, 12, 13, 14, 15], [ROOT, ROOT, 0, 1, 2]  # depths 1, 1, 2, 2, 3
    rows = drafter.step(state, tokens, parents, [0, 1, 2, 3, 4])
    torch.testing.assert_close(rows[0], expected([11]))
    torch.testing.assert_close(rows[1], expected([12]))
    assert not torch.allclose(rows[0], rows[1])
    torch.testing.assert_close(rows[2], expected([11, 13]))
    torch.testing.assert_close(rows[3], expected([12, 14]))
    assert torch.isinf(rows[4]).all()  # depth 3: past the 3 heads
    chain = drafter.propose(state)  # a greedy chain: each head reads the chain's own tokens
    assert chain.tokens.tolist()[0] == int(expected([]).argmax())
    assert chain.tokens.tolist()[1] == int(expected(chain.tokens.tolist()[:1]).argmax())


def test_hydra_heads_are_lossless_and_accepted_where_right(tiny, tiny_mixed):
    """Identity Hydra heads (input projections that ignore the tokens) draft the root again: accepted
    whole on the stock tiny model; random ones stay lossless on the mixed one."""
    pipe = build_pipeline(tiny.config("hydra"), loaded=tiny.loaded)
    for prompt in random_prompts(2, seed=45):
        tokens, steps = run_steps(pipe, prompt, 16)
        assert tokens == tiny.greedy_hf(prompt, 16)
        assert all(len(step.tokens) == 4 for step in steps[1:-1])
    random_heads = medusa_head_dir(tiny_mixed.loaded.model.config, "random", hydra=True)
    pipe = build_pipeline(tiny_mixed.config("hydra", f"pipeline.drafters.hydra.path={random_heads}"),
                          loaded=tiny_mixed.loaded)
    for prompt in random_prompts(3, seed=46):
        assert run_steps(pipe, prompt, 24)[0] == tiny_mixed.greedy_hf(prompt, 24)


def test_hydra_and_medusa_checkpoints_are_told_apart(tiny_mixed, tmp_path):
    target = TargetModel(tiny_mixed.loaded.model)
    with pytest.raises(ConfigError, match="holds Hydra heads, not Medusa heads: load it with drafter=hydra, "
                                          "e.g. `pipeline=hydra pipeline.drafters.hydra.path="):
        load_medusa(target, tiny_mixed.tokenizer, vocab_top_k=0,
                    path=str(medusa_head_dir(tiny_mixed.loaded.model.config, "random", hydra=True)))
    with pytest.raises(ConfigError, match="holds Medusa heads, not Hydra heads: load it with drafter=medusa"):
        load_medusa(target, tiny_mixed.tokenizer, vocab_top_k=0, hydra=True,
                    path=str(medusa_head_dir(tiny_mixed.loaded.model.config, "random")))
    source = medusa_head_dir(tiny_mixed.loaded.model.config, "random", hydra=True)
    config = json.loads((source / "config.json").read_text())
    config["specpipe"].pop("weights_sha256")  # each case writes other weights: the checksum is not theirs
    hidden = tiny_mixed.loaded.model.config.hidden_size
    for name, tensors, match in (
            ("wide", {"0.input.weight": torch.zeros(hidden, 2 * hidden + 2)}, r"for another model"),
            ("foreign", {"0.input.weight": torch.zeros(hidden, 2 * hidden), "0.0.linear.weight": torch.zeros(2)},
             "unexpected tensor '0.0.linear.weight' for Hydra heads")):
        folder = tmp_path / name
        folder.mkdir()
        save_file(tensors, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(ConfigError, match=match):
            load_medusa(target, tiny_mixed.tokenizer, vocab_top_k=0, hydra=True, path=str(folder))
