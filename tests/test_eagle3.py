"""drafter=eagle3: an EAGLE-3 head on three of the target's layers, with its own draft vocabulary.

Lossless runs of the `eagle3` pipeline are in the generic tests (test_lossless.py, with the identity
head of conftest.eagle3_head_dir on the tiny models); here: the layers the target runner captures,
what the head computes for each tree node, its cache after commits, the training rollouts, the
released checkpoint layout, and the errors.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import eagle3_head_dir, random_prompts
from specpipe.errors import ConfigError
from specpipe.kv_cache import PositionIndexedCache
from specpipe.pipelines.builder import build_pipeline
from specpipe.stages.draft.eagle3 import default_aux_layers, load_eagle3
from specpipe.target import TargetModel
from specpipe.types import DraftTree
from test_eagle import EAGLE3_LAYERS, drafter_for, target_features

LAYERS = EAGLE3_LAYERS


def layer_states(model, tokens: list[int]) -> torch.Tensor:
    return target_features(model, tokens, "eagle3")


def test_the_target_runner_returns_the_captured_layers(tiny_mixed):
    """prefill and verify forwards return the hidden states entering the asked layers, row for row
    what a plain forward over the same text computes; a second, different request is refused."""
    target = TargetModel(tiny_mixed.loaded.model, name="tiny_mixed")
    assert target.prefill([5, 6], target.new_cache()).aux_hidden is None  # nothing asked: nothing returned
    target.capture_layers(LAYERS, "test")
    prompt = random_prompts(1, seed=40)[0][:20]
    cache = target.new_cache()
    first = target.prefill(prompt, cache)
    torch.testing.assert_close(first.aux_hidden, layer_states(tiny_mixed, prompt), atol=1e-5, rtol=1e-5)
    tree = DraftTree.from_parents(torch.tensor([11, 12, 13]), torch.tensor([-1, 0, -1]))
    out = target.forward_tree(prompt[-1] + 1, tree, cache)
    assert out.aux_hidden.shape == (4, 3 * tiny_mixed.loaded.model.config.hidden_size)
    path = prompt + [prompt[-1] + 1, 11, 12]  # the root, node 0, node 1 (node 1's parent is node 0)
    torch.testing.assert_close(out.aux_hidden[[0, 1, 2]], layer_states(tiny_mixed, path)[-3:], atol=1e-4, rtol=1e-4)
    target.capture_layers(LAYERS, "again")  # the same layers: fine
    with pytest.raises(ConfigError, match=r"already reads layers \[0, 1, 1\]"):
        target.capture_layers((1, 1, 1), "another head")
    with pytest.raises(ConfigError, match="has layers 0..1"):
        TargetModel(tiny_mixed.loaded.model).capture_layers((0, 1, 5), "a head")


@pytest.mark.parametrize("variant", ["eagle3", "eagle"])
def test_training_rollouts_compute_what_the_drafter_computes(tiny_mixed, variant):
    """Training-time test: rollout k's row p (one batched forward per rollout under rollout_mask)
    equals drafting at inference: the committed rows 0..p-k read the target's layers (EAGLE-1: its
    last hidden states), then k tree nodes with the answer's tokens, each reading the draft's output
    at its parent."""
    from transformers.cache_utils import DynamicCache

    from specpipe.training.eagle3 import rollout_mask

    drafter = drafter_for(tiny_mixed, variant=variant)
    net, embed = drafter.net, drafter.embed
    tokens = random_prompts(1, seed=43)[0][:14]
    width = len(tokens) - 1
    aux = target_features(tiny_mixed, tokens, variant)[:width]  # row p reads position p's features and s_{p+1}
    embeds = embed(torch.tensor(tokens[1:]))[None]
    positions = torch.arange(width)[None]
    valid = torch.ones(1, width, dtype=torch.bool)
    cache = DynamicCache(config=net.config)
    inputs, outputs = aux[None], []
    with torch.inference_mode():
        for step in range(3):
            out = net.rows(embeds, inputs, positions, rollout_mask(valid, step), cache)[0]
            outputs.append(out)
            inputs = torch.cat([out.new_zeros(1, out.shape[1]), out[:-1]])[None]
        for step, p in ((0, 5), (1, 5), (2, 5), (2, 2), (2, width - 1)):
            committed = p - step + 1  # rows 0..p-step
            head_cache = PositionIndexedCache()
            feature = net(embed(torch.tensor(tokens[1:committed + 1])), aux[:committed], torch.arange(committed),
                          torch.ones(committed, committed, dtype=torch.bool).tril(), head_cache)[-1]
            for depth in range(1, step + 1):
                position = committed - 1 + depth
                feature = net(embed(torch.tensor([tokens[position + 1]])), feature[None], torch.tensor([position]),
                              torch.ones(1, position + 1, dtype=torch.bool), head_cache)[0]
            torch.testing.assert_close(outputs[step][p], feature, atol=1e-4, rtol=1e-4)
    mask = rollout_mask(valid, 2)[0, 0]
    assert mask[5].nonzero().flatten().tolist() == [0, 1, 2, 3, width + 4, 2 * width + 5]
    assert not mask[1, :width].any() and mask[1, 2 * width + 1]  # no committed row under it (never scored)


def test_released_eagle3_layout_loads(tiny_mixed, tmp_path):
    """A checkpoint written key for key as the released EAGLE-3 heads are (midlayer.*, fc without
    bias, own norm and lm_head, d2t and t2d, the base model's embed_tokens beside them, the layers
    under eagle_config) loads and drafts exactly what the head it came from drafts."""
    source = eagle3_head_dir(tiny_mixed.loaded.model, "random")
    tensors = load_file(source / "model.safetensors")
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight",
            "midlayer.input_layernorm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= set(tensors)
    assert "fc.bias" not in tensors
    hidden = tiny_mixed.loaded.model.config.hidden_size
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * hidden
    config = json.loads((source / "config.json").read_text())
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": list(LAYERS)}
    tensors["embed_tokens.weight"] = tiny_mixed.loaded.model.get_input_embeddings().weight.detach().clone()
    released = tmp_path / "released"
    released.mkdir()
    torch.save(tensors, released / "pytorch_model.bin")
    config.pop("specpipe")
    config["eagle_aux_hidden_state_layer_ids"] = config.pop("eagle_config")["eagle_aux_hidden_state_layer_ids"]
    (released / "config.json").write_text(json.dumps(config))
    target = TargetModel(tiny_mixed.loaded.model, name=tiny_mixed.name)
    ours = load_eagle3(target, tiny_mixed.tokenizer, path=str(source))
    theirs = load_eagle3(target, tiny_mixed.tokenizer, path=str(released))
    assert target.aux_layers == LAYERS
    for key, value in ours.net.state_dict().items():
        torch.testing.assert_close(theirs.net.state_dict()[key], value)
    assert theirs.head.width == 3 * tiny_mixed.loaded.model.config.vocab_size // 4
    assert default_aux_layers(32) == (2, 16, 29)  # Llama-3-8B's: what vLLM and SGLang read


def test_bad_eagle3_checkpoints_are_refused_with_what_is_wrong(tiny_mixed, tmp_path):
    source = eagle3_head_dir(tiny_mixed.loaded.model, "random")
    good = load_file(source / "model.safetensors")
    good_config = json.loads((source / "config.json").read_text())
    good_config["specpipe"].pop("weights_sha256")  # each case writes other weights: the checksum is not theirs
    target = TargetModel(tiny_mixed.loaded.model, name=tiny_mixed.name)

    def refused(name: str, tensors: dict, config: dict, match: str) -> None:
        folder = tmp_path / name
        folder.mkdir()
        save_file(tensors, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(ConfigError, match=match):
            load_eagle3(target, tiny_mixed.tokenizer, path=str(folder))

    hidden = tiny_mixed.loaded.model.config.hidden_size
    refused("hidden", {**good, "fc.weight": torch.zeros(hidden, 3 * hidden + 6)}, good_config, "for another model")
    refused("vocab", good, {**good_config, "vocab_size": 7}, "vocabulary of 7 tokens")
    far = good["d2t"].clone()
    far[-1] = 10 ** 6
    refused("d2t", {**good, "d2t": far}, good_config, "outside the target's")
    refused("layers", good, {**good_config, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 9]}},
            r"layers \[0, 1, 9\]; the target has 2 layers")
    refused("two", good, {**good_config, "num_hidden_layers": 2}, "declares 2 draft layers")
    eagle1 = {"fc.weight": torch.zeros(hidden, 2 * hidden), "layers.0.mlp.up_proj.weight": torch.zeros(4, hidden)}
    refused("eagle1", eagle1, {}, "holds an EAGLE-1 head, not an EAGLE-3 head: load it with drafter=eagle, "
                                   "e.g. `pipeline=eagle pipeline.drafters.eagle.path=")
    refused("missing", {k: v for k, v in good.items() if k != "norm.weight"}, good_config, r"lacks \['norm.weight'\]")
    refused("shape", {**good, "midlayer.mlp.up_proj.weight": torch.zeros(3, hidden)}, good_config,
            "midlayer.mlp.up_proj.weight is")


def test_an_eagle3_checkpoint_given_to_drafter_eagle_is_named(tiny_mixed):
    from specpipe.stages.draft.eagle import load_eagle

    with pytest.raises(ConfigError, match="holds an EAGLE-3 head, not an EAGLE-1 head"):
        load_eagle(TargetModel(tiny_mixed.loaded.model), tiny_mixed.tokenizer,
                   path=str(eagle3_head_dir(tiny_mixed.loaded.model, "random")), vocab_top_k=0)


def test_train_heads_eagle3_trains_and_exports_a_head_the_pipeline_loads(tmp_path):
    from specpipe.pipelines.builder import compose_config, load_model
    from specpipe.tasks.train_heads import run_train_heads
    from test_distill_draft import write_corpus
    from test_train_heads import assert_greedy

    corpus, out, checkpoints = tmp_path / "corpus.parquet", tmp_path / "eagle3", tmp_path / "ck"
    write_corpus(corpus)
    settings = [
        "task=train_heads", "model=tiny_random", "train_heads.kind=eagle3",
        f"train_heads.corpus={corpus}", f"train_heads.checkpoint_dir={checkpoints}", f"train_heads.out={out}",
        "train_heads.steps=6", "train_heads.lr=0.003", "train_heads.warmup=0", "train_heads.batch=128",
        "train_heads.checkpoint_every=2", "train_heads.eval_every=0", "train_heads.eval_fraction=0.3",
        "train_heads.vocab_top_k=2000", "train_heads.eval_chains=8", "train_heads.progress=false"]
    result = run_train_heads(compose_config([*settings, "train_heads.aux_layers=[0,1,1]"]))
    losses = [entry["loss"] for entry in result["train_log"]]
    assert result["step"] == 6 and losses[-1] < losses[0]
    assert sorted((checkpoints / "features-fp32-layers-0-1-1").glob("*.feat.npy"))
    exported = json.loads((out / "config.json").read_text())
    assert exported["draft_vocab_size"] == 2000 and exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 1]
    assert exported["specpipe"]["training"]["steps"] == 6 and set(exported["specpipe"]["eval"]["acceptance_per_depth"]) \
        == {"1", "2", "3", "4", "5"}
    loaded = load_model(compose_config(["model=tiny_random"]).model)
    pipe = build_pipeline(compose_config(["model=tiny_random", "pipeline=eagle3", "cost_curve=flat",
                                          f"pipeline.drafters.eagle3.path={out}"]), loaded=loaded)
    assert pipe.decoder.target.aux_layers == (0, 1, 1)
    assert_greedy(pipe)
    assert np.isfinite(losses).all()
    # eval_of reads the head's own layers (no aux_layers given; the default ones do not fit this target)
    # and its own draft vocabulary: the exported eval again, up to the bf16 export's rounding
    scored = run_train_heads(compose_config([*settings, f"train_heads.eval_of={out}"]))["eval"]
    assert scored["positions"] == result["eval"]["positions"]
    assert scored["loss"] == pytest.approx(result["eval"]["loss"], rel=0.02)
    with pytest.raises(ConfigError, match=r"eval_of fuses layers \[0, 1, 1\]; drop train_heads.aux_layers"):
        run_train_heads(compose_config([*settings, f"train_heads.eval_of={out}", "train_heads.aux_layers=[1,1,1]"]))
