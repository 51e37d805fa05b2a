"""drafter=layer_skip: the target drafts with a subset of its own layers (shared, never copied)."""
from __future__ import annotations

import copy

import pytest
import torch

from conftest import random_prompts, run_steps
from specpipe.cost import OtherProcessesLoad
from specpipe.errors import ConfigError
from specpipe.pipelines.builder import build_pipeline, compose_config
from specpipe.stages.draft.layer_skip import LayerSubsetCache, layer_subset_model, load_layer_skip
from specpipe.target import TargetModel
from specpipe.types import DecodeState


@pytest.fixture(scope="module")
def three_layers():
    """A 3-layer tiny Llama (stock weights), so that a subset can skip a middle layer."""
    from specpipe.pipelines.builder import load_model

    return load_model(compose_config(["model=tiny_random", "model.num_hidden_layers=3", "model.seed=3"]).model)


def layer_skip_config(*overrides: str):
    return compose_config(["model=tiny_random", "model.num_hidden_layers=3", "model.seed=3", "pipeline=draft_model",
                           "cost_curve=flat", "~pipeline.drafters.model", "+drafter@pipeline.drafters.skip=layer_skip",
                           "pipeline.drafters.skip.vocab_top_k=0", "pipeline.tree.min_score=0", *overrides])


@torch.inference_mode()
def stock_greedy(reference, prompt: list[int], max_new_tokens: int, eos_token_ids) -> list[int]:
    """Plain greedy decoding by HF generate on a stock copy of the model."""
    ids = torch.tensor([prompt])
    return reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                              eos_token_id=sorted(eos_token_ids), pad_token_id=0)[0, len(prompt):].tolist()


def test_the_subset_shares_the_targets_modules_and_leaves_the_target_whole(three_layers):
    target = three_layers.model
    draft = layer_subset_model(target, [0, 2])
    assert [id(layer) for layer in draft.model.layers] == [id(target.model.layers[0]), id(target.model.layers[2])]
    assert draft.model.embed_tokens is target.model.embed_tokens and draft.lm_head is target.lm_head
    assert len(target.model.layers) == 3  # the target keeps all its layers


def test_the_draft_computes_the_kept_layers_only(three_layers):
    """Root log-probs from the drafter's own cache equal a plain causal forward of a copy of the
    model cut down to the kept layers (layer 1 skipped)."""
    drafter = load_layer_skip(TargetModel(three_layers.model, name="tiny3"), three_layers.tokenizer, [0, 2])
    reference = copy.deepcopy(three_layers.model)
    reference.model.layers = torch.nn.ModuleList([reference.model.layers[0], reference.model.layers[2]])
    prompt = random_prompts(1, seed=31)[0][:30]
    state = DecodeState(tokens=list(prompt), prompt_length=len(prompt))
    drafter.reset(state)
    root = drafter.start(state)
    with torch.inference_mode():
        expected = torch.log_softmax(reference(input_ids=torch.tensor([prompt]), use_cache=False).logits[0, -1].float(), -1)
    torch.testing.assert_close(root, expected, atol=1e-4, rtol=1e-4)
    cache = state.stage_state[drafter].cache
    assert isinstance(cache, LayerSubsetCache) and len(cache.layers) == 2
    assert cache.get_seq_length() == len(prompt)


@pytest.mark.parametrize("where", ["drafters", "proposers"])
def test_layer_skip_is_lossless_as_a_tree_and_as_a_chain(three_layers, where):
    if where == "drafters":
        cfg = layer_skip_config("pipeline.drafters.skip.layers=[0,2]")
    else:
        cfg = compose_config(["model=tiny_random", "model.num_hidden_layers=3", "model.seed=3", "pipeline=lookahead_trie",
                              "cost_curve=flat", "~pipeline.proposers.ngram", "+drafter@pipeline.proposers.skip=layer_skip",
                              "pipeline.proposers.skip.layers=[0,2]", "pipeline.proposers.skip.vocab_top_k=0",
                              "pipeline.proposers.skip.min_score=0"])
    reference = copy.deepcopy(three_layers.model)  # stock weights: greedy by HF generate
    pipe = build_pipeline(cfg)  # its own instance (the engine rewrites it)
    drafted = 0
    for prompt in random_prompts(6, seed=32):
        tokens, steps = run_steps(pipe, prompt, 20)
        assert tokens == stock_greedy(reference, prompt, 20, pipe.eos_token_ids)
        drafted += sum(step.drafted for step in steps)
    assert drafted > 0  # the stock tiny model copies its last token, and so does its subset


def test_bad_layer_choices_are_clear(three_layers):
    target = TargetModel(three_layers.model, name="tiny3")
    for layers, message in (([], "distinct ascending"), ([2, 0], "distinct ascending"), ([0, 3], r"0\.\.2"),
                            ([0, 1, 2], "keeps all 3 layers")):
        with pytest.raises(ConfigError, match=message):
            load_layer_skip(target, three_layers.tokenizer, layers)


@pytest.mark.parametrize("cost_curve", ["measured", "online"])
def test_a_measured_draft_cost_curve_runs_on_the_drafts_own_cache(three_layers, tmp_path, monkeypatch, cost_curve):
    """cost_curve=measured (and online, the target's curve then corrected as it decodes) also measures the
    drafter (its forwards are not free on a CPU), through the layer subset's own cache (layer 2 of the
    target is row 1 there), and stays lossless."""
    # a fresh folder for the cost curves alone (the whole cache there would rebuild the engine's kernel, ~40 s)
    monkeypatch.setattr("specpipe.cost.cache_root", lambda: tmp_path)
    # cached even when measured on a busy machine (test_cost_curve checks that a busy one is not)
    monkeypatch.setattr(OtherProcessesLoad, "competed", lambda self, threads=None: False)
    pipe = build_pipeline(layer_skip_config("pipeline.drafters.skip.layers=[0,2]", f"cost_curve={cost_curve}"))
    drafter = pipe.decoder.drafters[0]
    assert drafter.cost_curve is not None and 0 < drafter.cost_curve(1) <= drafter.cost_curve(64)
    assert list((tmp_path / "cost").glob("*layer_skip-2L*V-*.json")), "the draft's curve is cached under its own shape"
    reference = copy.deepcopy(three_layers.model)
    prompt = random_prompts(1, seed=33)[0]
    tokens, _ = run_steps(pipe, prompt, 16)
    assert tokens == stock_greedy(reference, prompt, 16, pipe.eos_token_ids)
