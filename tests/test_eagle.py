"""drafter=eagle: an EAGLE-1 head on the target's features, its cache, the tree it grows, the released
checkpoint layout, and the errors. The tree and cache tests also run the EAGLE-3 head (drafter=eagle3,
same drafter; the rest of its tests are in test_eagle3.py).

Lossless runs of the `eagle` pipeline are in the generic tests (test_lossless.py, with the identity
head of conftest.eagle_head_dir on the tiny models); here: what the head computes for each tree
node, its cache after commits, acceptance where its drafts are right, and loading.
"""
from __future__ import annotations

import json
import pickle

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from conftest import eagle3_head_dir, eagle_head_dir, random_prompts, run_steps
from specpipe.engine.cpu import onednn_available
from specpipe.engine.onednn import OneDNNLinear
from specpipe.errors import ConfigError
from specpipe.kv_cache import PositionIndexedCache
from specpipe.pipelines.builder import build_pipeline
from specpipe.stages.draft.eagle import ROOT, EagleDrafter, load_eagle
from specpipe.stages.draft.eagle3 import load_eagle3
from specpipe.stages.draft.reduced_vocab import ReducedVocabHead
from specpipe.target import TargetModel
from specpipe.types import DecodeState


VARIANTS = ["eagle", "eagle3"]  # EAGLE-1 reads the target's last hidden states, EAGLE-3 three of its layers
EAGLE3_LAYERS = (0, 1, 1)  # what conftest.eagle3_head_dir's heads read on the 2-layer tiny models


def drafter_for(model, kind: str = "random", variant: str = "eagle", layers: int = 1) -> EagleDrafter:
    target = TargetModel(model.loaded.model, name=model.name)
    if variant == "eagle3":
        return load_eagle3(target, model.tokenizer, path=str(eagle3_head_dir(model.loaded.model, kind)))
    return load_eagle(target, model.tokenizer, path=str(eagle_head_dir(model.loaded.model.config, kind, layers=layers)),
                      vocab_top_k=0)


def target_features(model, tokens: list[int], variant: str = "eagle") -> torch.Tensor:
    """What the head's committed rows read, from a plain causal forward (no cache): the last hidden
    states [len(tokens), hidden] (EAGLE-1), or the states entering EAGLE3_LAYERS side by side
    [len(tokens), 3 * hidden] (EAGLE-3)."""
    with torch.inference_mode():
        states = model.reference(input_ids=torch.tensor([tokens]), use_cache=False, output_hidden_states=True).hidden_states
    if variant == "eagle3":
        return torch.cat([states[layer][0] for layer in EAGLE3_LAYERS], dim=-1)
    return states[-1][0]


def reference_logprobs(drafter: EagleDrafter, features: torch.Tensor, tokens: list[int], path: list[int],
                       fed: list[int] | None = None) -> torch.Tensor:
    """[vocab] the head's log-probs after `path` drafted past the root, recomputed with no cache: the
    rows of the committed positions `fed` (default: every one, 0 .. len(tokens) - 2) again through a
    causal forward at their own positions, then the path's rows, each reading the previous row's
    prediction (EAGLE-3's committed rows go through its fc first, as its drafter does: one forward then
    reads them and the path's hidden-size rows together)."""
    fed = list(range(len(tokens) - 1)) if fed is None else fed
    committed = features[fed]  # f_p for p in fed
    with torch.inference_mode():
        rows_features = list(drafter.net.fc(committed) if drafter.aux_hidden else committed)
        rows_tokens = [tokens[p + 1] for p in fed]  # s_{p+1}
        positions = list(fed)

        def predict() -> torch.Tensor:
            q = len(rows_tokens)
            out = drafter.net(drafter.embed(torch.tensor(rows_tokens)), torch.stack(rows_features),
                              torch.tensor(positions), torch.ones(q, q, dtype=torch.bool).tril(), None)
            return out[-1]
        feature = predict()
        for token in path:
            rows_features.append(feature)
            rows_tokens.append(token)
            positions.append(positions[-1] + 1)
            feature = predict()
        return torch.log_softmax(drafter.head(feature[None]).float(), dim=-1)[0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_tree_nodes_see_exactly_their_path(tiny_mixed, variant):
    """Each expanded node's log-probs equal a cache-free recomputation over the committed rows and
    its own path (the root's children first, then siblings expanded in one forward, then two
    branches at depth 3)."""
    drafter = drafter_for(tiny_mixed, variant=variant)
    prompt = random_prompts(1, seed=31)[0][:30]
    tokens = prompt + [777]  # the root: a committed token the target has not seen yet
    features = target_features(tiny_mixed, prompt, variant)
    state = DecodeState(tokens=list(tokens), prompt_length=len(prompt),
                        **{"prompt_aux_hidden" if variant == "eagle3" else "prompt_hidden": features})
    drafter.reset(state)
    vocab = drafter.draft_vocab  # [k] the target ids of the drafter's columns (EAGLE-3), or None (all)

    def columns(full: torch.Tensor) -> torch.Tensor:
        return full if vocab is None else full[..., vocab]

    def token_ids(indices: torch.Tensor) -> torch.Tensor:
        return indices if vocab is None else vocab[indices]

    root = drafter.start(state)
    reference = reference_logprobs(drafter, features, tokens, [])
    torch.testing.assert_close(root, columns(reference), atol=1e-4, rtol=1e-4)
    if variant == "eagle3":  # only its draft vocabulary is scored, and only those columns handed out
        assert root.shape == (drafter.head.width,) and torch.isfinite(root).all()
        assert torch.isinf(reference).sum() == reference.numel() - drafter.head.width
    tree, parents = [], []
    children = token_ids(drafter.step(state, tree, parents, [ROOT]).topk(3).indices)  # [1, 3]
    tree += children[0].tolist()
    parents += [ROOT] * 3
    grandchildren = token_ids(drafter.step(state, tree, parents, [2, 0]).topk(3).indices)  # [2, 3]
    tree += grandchildren.flatten().tolist()
    parents += [2] * 3 + [0] * 3
    drafter.step(state, tree, parents, [len(tree) - 1, 3])  # depth 3, two branches
    session = state.stage_state[drafter]
    for node in (0, 2, 3, len(tree) - 1):
        path, walk = [], node
        while walk != ROOT:
            path.append(tree[walk])
            walk = parents[walk]
        expected = reference_logprobs(drafter, features, tokens, path[::-1])
        torch.testing.assert_close(session.logprobs[node], columns(expected), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", VARIANTS)
def test_context_rows_feeds_only_the_newest_committed_rows(tiny_mixed, variant):
    """With `context_rows`, a prompt longer than it is fed by its last rows only, at their own
    positions: the root's and a depth-2 node's log-probs equal a cache-free recomputation over just
    those rows (and differ from the whole prompt's). After a commit the catch-up is cut the same way."""
    drafter = drafter_for(tiny_mixed, variant=variant)
    drafter.context_rows = 8
    with torch.no_grad():  # sharper attention than the random head's near-uniform one: positions matter
        for name, module in drafter.net.named_modules():
            if name.endswith(("q_proj", "k_proj")):
                module.weight *= 6.0
    prompt = random_prompts(1, seed=41)[0][:30]
    tokens = prompt + [777]
    features = target_features(tiny_mixed, tokens + [5, 6], variant)  # the last two rows: a later commit's
    state = DecodeState(tokens=list(tokens), prompt_length=len(prompt),
                        **{"prompt_aux_hidden" if variant == "eagle3" else "prompt_hidden": features[:len(prompt)]})
    drafter.reset(state)
    columns = (lambda full: full) if drafter.draft_vocab is None else (lambda full: full[..., drafter.draft_vocab])
    first = len(tokens) - 1 - 8  # committed rows: positions 0 .. len(tokens) - 2, the newest 8 fed
    newest = list(range(first, len(tokens) - 1))
    torch.testing.assert_close(drafter.start(state), columns(reference_logprobs(drafter, features, tokens, [], newest)),
                               atol=1e-4, rtol=1e-4)
    assert not torch.allclose(drafter.start(state), columns(reference_logprobs(drafter, features, tokens, [])), atol=1e-3)
    session = state.stage_state[drafter]
    assert session.cache.get_seq_length() == 8 and session.synced == len(tokens) - 1 and session.unfed == first
    drafter.step(state, [3], [ROOT], [ROOT])
    node = drafter.step(state, [3, 4], [ROOT, 0], [1])[0]  # depth 2
    torch.testing.assert_close(node, columns(reference_logprobs(drafter, features, tokens, [3, 4], newest)),
                               atol=1e-4, rtol=1e-4)

    # the root (777) and two accepted tokens commit: 3 rows pending, context_rows=2 feeds the last two
    drafter.context_rows = 2
    from specpipe.types import VerifyResult
    state.tokens += [5, 6, 7]
    hidden = features[len(tokens) - 1:]  # [3, ...] the verify rows of the root and the two kept nodes
    drafter.on_commit(state, VerifyResult(accepted=[0, 1], bonus=7, logits=torch.zeros(3, 1),
                                          hidden=hidden if variant == "eagle" else None,
                                          aux_hidden=hidden if variant == "eagle3" else None))
    root = drafter.start(state)
    assert session.cache.get_seq_length() == 8 + 2 and session.unfed == first + 1
    # the 8 rows fed first, then the two newest (committed position len(tokens) - 1, the old root, never is)
    fed = [*newest, len(tokens), len(tokens) + 1]
    torch.testing.assert_close(root, columns(reference_logprobs(drafter, features, state.tokens, [], fed)),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pipeline", ["eagle", "eagle_mix"])
def test_context_rows_stays_lossless(tiny_mixed, pipeline):
    """Heads fed only the newest rows (a 40-token prompt's last 4, and catch-ups after a gate's skips)
    still give the target's greedy output: what the head sees changes the drafts only. eagle_mix's gate
    skips by the online curve's timings (the catch-ups); `eagle` drafts by the flat curve, since on a slow
    machine the online curve found that the tiny model's drafts never pay and drafted nothing at all."""
    head = eagle_head_dir(tiny_mixed.loaded.model.config, "random")
    pipe = build_pipeline(tiny_mixed.config(pipeline, f"pipeline.drafters.eagle.path={head}",
                                            "pipeline.drafters.eagle.context_rows=4",
                                            cost_curve="online" if pipeline == "eagle_mix" else "flat"),
                          loaded=tiny_mixed.loaded)
    drafter = pipe.decoder.drafters[0]
    assert drafter.context_rows == 4
    for i, prompt in enumerate(random_prompts(6, seed=43)):
        tokens, steps = run_steps(pipe, prompt, 30)
        assert tokens == tiny_mixed.greedy_hf(prompt, 30), f"{pipeline}, prompt {i}"
        assert sum(step.stats.tree_size for step in steps) > 0


def test_context_rows_below_one_is_refused(tiny_mixed):
    target = TargetModel(tiny_mixed.loaded.model, name=tiny_mixed.name)
    with pytest.raises(ConfigError, match="context_rows must be >= 1"):
        load_eagle(target, tiny_mixed.tokenizer, path=str(eagle_head_dir(tiny_mixed.loaded.model.config, "random")),
                   vocab_top_k=0, context_rows=0)


def test_the_tree_holds_the_heads_best_tokens_of_its_draft_vocabulary(tiny_mixed):
    """EAGLE-3's head scores its draft vocabulary only (a random 3/4 of the tokens) and hands out
    those columns: the tree builder's children of the root are the head's most likely target
    tokens, with their probabilities."""
    from specpipe.cost import CostCurve
    from specpipe.stages.tree.eagle2 import Eagle2TreeBuilder

    drafter = drafter_for(tiny_mixed, variant="eagle3")
    prompt = random_prompts(1, seed=37)[0][:30]
    tokens = prompt + [777]
    features = target_features(tiny_mixed, prompt, "eagle3")
    state = DecodeState(tokens=list(tokens), prompt_length=len(prompt), prompt_aux_hidden=features)
    drafter.reset(state)
    assert not torch.equal(drafter.draft_vocab, torch.arange(len(drafter.draft_vocab)))  # columns are not ids
    builder = Eagle2TreeBuilder(CostCurve.flat(), depth=1, top_k=1, children=4, min_score=0.0)
    grown, _ = builder.grow(state, drafter)
    best = reference_logprobs(drafter, features, tokens, []).topk(4)  # over the whole vocabulary, -inf outside
    assert grown.tokens.tolist() == best.indices.tolist()
    torch.testing.assert_close(grown.scores, best.values.exp(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_head_cache_after_commits_equals_recomputing_the_committed_rows(tiny_mixed, variant):
    """After a generation (accepted paths of several lengths, rejected branches) the head's cache
    holds exactly the rows of the committed text: keys and values equal a fresh causal forward over
    [target feature f_p, token s_{p+1}] for every committed position."""
    head = eagle3_head_dir(tiny_mixed.loaded.model, "random") if variant == "eagle3" \
        else eagle_head_dir(tiny_mixed.loaded.model.config, "random")
    pipe = build_pipeline(tiny_mixed.config(variant, f"pipeline.drafters.{variant}.path={head}",
                                            f"pipeline.drafters.{variant}.context_rows=null"), loaded=tiny_mixed.loaded)
    drafter = pipe.decoder.drafters[0]
    captured = {}

    def capture_finish(state):
        drafter.start(state)  # catch up with the last commit, as the next step would
        captured["tokens"] = list(state.tokens)
        captured["cache"] = [(layer.keys.clone(), layer.values.clone()) for layer in state.stage_state[drafter].cache.layers]

    drafter.on_finish = capture_finish
    prompt = random_prompts(3, seed=32)[2]
    try:
        tokens, steps = run_steps(pipe, prompt, 24)
    finally:
        del drafter.on_finish
    assert tokens == tiny_mixed.greedy_hf(prompt, 24)
    assert sum(step.stats.tree_size for step in steps) > 0
    committed = captured["tokens"]
    features = target_features(tiny_mixed, committed[:-1], variant)
    fresh = drafter.runner.new_cache()
    q = len(committed) - 1
    with torch.inference_mode():
        drafter.net(drafter.embed(torch.tensor(committed[1:])), features, torch.arange(q),
                    torch.ones(q, q, dtype=torch.bool).tril(), fresh)
    for (keys, values), layer in zip(captured["cache"], fresh.layers):
        assert keys.shape == layer.keys.shape == (1, keys.shape[1], q, keys.shape[-1])
        torch.testing.assert_close(keys, layer.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(values, layer.values, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", VARIANTS)
def test_right_drafts_are_accepted_whole_and_stay_lossless(tiny, variant):
    """The stock tiny model repeats its last token, and the identity head drafts exactly that: every
    drafted chain is accepted (the pipeline verifies the head's tree for real), output = greedy."""
    cfg = tiny.config(variant, "pipeline.tree.top_k=1", "pipeline.tree.children=1", "pipeline.tree.depth=4")
    pipe = build_pipeline(cfg, loaded=tiny.loaded)
    for prompt in random_prompts(3, seed=33):
        tokens, steps = run_steps(pipe, prompt, 20)
        assert tokens == tiny.greedy_hf(prompt, 20)
        decode_steps = steps[1:-1]
        # chains of 4 (the 4th node's score can vanish in float rounding on this random model's flat
        # distributions), every node accepted
        assert all(step.stats.tree_size >= 3 for step in decode_steps)
        assert all(len(step.tokens) == step.stats.tree_size + 1 for step in decode_steps)


def test_chain_under_the_trie_builder_is_lossless(tiny_mixed):
    from specpipe.pipelines.builder import compose_config

    head = eagle_head_dir(tiny_mixed.loaded.model.config, "random")
    cfg = compose_config([*tiny_mixed.overrides, "pipeline=eagle", "cost_curve=flat", "~pipeline.drafters.eagle",
                          "+drafter@pipeline.proposers.eagle=eagle", f"pipeline.proposers.eagle.path={head}",
                          "tree@pipeline.tree=trie", "pipeline.proposers.eagle.min_score=0",
                          "pipeline.proposers.eagle.vocab_top_k=0"])
    pipe = build_pipeline(cfg, loaded=tiny_mixed.loaded)
    assert len(pipe.decoder.proposers) == 1 and not pipe.decoder.drafters
    for prompt in random_prompts(3, seed=34):
        tokens, steps = run_steps(pipe, prompt, 20)
        assert tokens == tiny_mixed.greedy_hf(prompt, 20)
        # chains drafted and verified (the 4th and 5th nodes' scores vanish in float rounding on
        # this random model's flat distributions)
        assert all(step.stats.tree_size >= 3 for step in steps[1:-1])


# ---- checkpoints --------------------------------------------------------------------------------
def released_eagle1(folder, config, *, bias: bool = True, layers: int = 1, hidden: int | None = None,
                    vocab: int | None = None, fmt: str = "bin") -> dict:
    """A synthetic checkpoint in the layout of the released EAGLE-1 heads (e.g. yuhuili/EAGLE-Vicuna-7B-v1.3:
    config.json with Llama fields and `bias`, pytorch_model.bin with fc.*, layers.N.* whose layer 0
    has no input_layernorm, and the base model's embed_tokens.weight)."""
    hidden = hidden or config.hidden_size
    vocab = vocab or config.vocab_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = hidden // heads
    generator = torch.Generator().manual_seed(5)

    def randn(*shape):
        return torch.randn(*shape, generator=generator) * 0.02

    tensors = {"fc.weight": randn(hidden, 2 * hidden), "embed_tokens.weight": randn(vocab, hidden)}
    if bias:
        tensors["fc.bias"] = randn(hidden)
    for index in range(layers):
        prefix = f"layers.{index}."
        tensors.update({prefix + "self_attn.q_proj.weight": randn(heads * head_dim, hidden),
                        prefix + "self_attn.k_proj.weight": randn(kv_heads * head_dim, hidden),
                        prefix + "self_attn.v_proj.weight": randn(kv_heads * head_dim, hidden),
                        prefix + "self_attn.o_proj.weight": randn(hidden, heads * head_dim),
                        prefix + "mlp.gate_proj.weight": randn(config.intermediate_size, hidden),
                        prefix + "mlp.up_proj.weight": randn(config.intermediate_size, hidden),
                        prefix + "mlp.down_proj.weight": randn(hidden, config.intermediate_size),
                        prefix + "post_attention_layernorm.weight": torch.ones(hidden)})
        if index > 0:
            tensors[prefix + "input_layernorm.weight"] = torch.ones(hidden)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "bias": bias, "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": config.intermediate_size, "max_position_embeddings": 2048,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "num_hidden_layers": layers,
        "rms_norm_eps": 1e-6, "vocab_size": vocab, "torch_dtype": "float16", "tie_word_embeddings": False}))
    if fmt == "bin":
        torch.save(tensors, folder / "pytorch_model.bin")
    else:
        save_file(tensors, str(folder / "model.safetensors"))
    return tensors


@pytest.mark.parametrize("fmt,bias,layers", [("bin", True, 1), ("safetensors", False, 1), ("safetensors", True, 2)])
def test_released_eagle1_layouts_load(tiny_mixed, tmp_path, fmt, bias, layers):
    tensors = released_eagle1(tmp_path / "head", tiny_mixed.loaded.model.config, bias=bias, layers=layers, fmt=fmt)
    drafter = load_eagle(TargetModel(tiny_mixed.loaded.model, name="tiny_mixed"), tiny_mixed.tokenizer,
                         path=str(tmp_path / "head"), vocab_top_k=0)
    state = drafter.net.state_dict()
    assert (drafter.net.fc.bias is not None) == bias and len(drafter.net.layers) == layers
    assert isinstance(drafter.net.layers[0].input_layernorm, torch.nn.Identity)
    for key, value in tensors.items():
        if key == "embed_tokens.weight":
            assert key not in state  # the base model's: the target's own embedding is used
        else:
            assert torch.equal(state[key], value), key
    assert drafter.embed is tiny_mixed.loaded.model.get_input_embeddings()
    prompt = random_prompts(2, seed=35)[1]
    cfg = tiny_mixed.config("eagle", f"pipeline.drafters.eagle.path={tmp_path / 'head'}")
    assert build_pipeline(cfg, loaded=tiny_mixed.loaded).generate(prompt, max_new_tokens=12).token_ids == \
        tiny_mixed.greedy_hf(prompt, 12)


def test_bad_checkpoints_are_refused_with_what_is_wrong(tiny_mixed, tmp_path):
    config = tiny_mixed.loaded.model.config
    target = TargetModel(tiny_mixed.loaded.model, name="tiny_mixed")

    def load(folder):
        return load_eagle(target, tiny_mixed.tokenizer, path=str(folder), vocab_top_k=0)

    with pytest.raises(ConfigError, match="not a directory"):
        load(tmp_path / "missing")
    released_eagle1(tmp_path / "wide", config, hidden=2 * config.hidden_size)
    with pytest.raises(ConfigError, match=rf"hidden size {config.hidden_size}.*another model"):
        load(tmp_path / "wide")
    released_eagle1(tmp_path / "vocab", config, vocab=config.vocab_size + 8)
    with pytest.raises(ConfigError, match=rf"vocabulary of {config.vocab_size + 8} tokens"):
        load(tmp_path / "vocab")
    released_eagle1(tmp_path / "layers", config, layers=2, fmt="safetensors")
    data = json.loads((tmp_path / "layers" / "config.json").read_text())
    (tmp_path / "layers" / "config.json").write_text(json.dumps({**data, "num_hidden_layers": 3}))
    with pytest.raises(ConfigError, match=r"declares 3 layer\(s\), the weights hold layers \[0, 1\]"):
        load(tmp_path / "layers")
    released_eagle1(tmp_path / "noweights", config)
    (tmp_path / "noweights" / "pytorch_model.bin").unlink()
    with pytest.raises(ConfigError, match="holds no weights"):
        load(tmp_path / "noweights")
    released_eagle1(tmp_path / "noconfig", config)
    (tmp_path / "noconfig" / "config.json").unlink()
    with pytest.raises(ConfigError, match="no config.json"):
        load(tmp_path / "noconfig")
    released_eagle1(tmp_path / "truncated", config, fmt="safetensors")
    weights = tmp_path / "truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ConfigError, match="cannot read the weights"):
        load(tmp_path / "truncated")
    released_eagle1(tmp_path / "pickle", config)
    with open(tmp_path / "pickle" / "pytorch_model.bin", "wb") as handle:  # code in a pickle: never run
        pickle.dump({"fc.weight": Exploit()}, handle)
    with pytest.raises(ConfigError, match="cannot read the weights"):
        load(tmp_path / "pickle")
    assert not Exploit.ran
    eagle3 = tmp_path / "eagle3"
    eagle3.mkdir()
    (eagle3 / "config.json").write_text(json.dumps({"hidden_size": config.hidden_size, "draft_vocab_size": 32}))
    save_file({"fc.weight": torch.zeros(config.hidden_size, 3 * config.hidden_size), "d2t": torch.zeros(32, dtype=torch.long),
               "midlayer.self_attn.q_proj.weight": torch.zeros(4, 4)}, str(eagle3 / "model.safetensors"))
    with pytest.raises(ConfigError, match="holds an EAGLE-3 head, not an EAGLE-1 head: load it with drafter=eagle3"):
        load(eagle3)
    medusa = tmp_path / "medusa"
    medusa.mkdir()
    (medusa / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    save_file({"0.0.linear.weight": torch.zeros(4, 4), "0.1.weight": torch.zeros(8, 4)}, str(medusa / "model.safetensors"))
    with pytest.raises(ConfigError, match="holds Medusa heads, not an EAGLE-1 head: load it with drafter=medusa"):
        load(medusa)


def head_copy(source, folder):
    import shutil

    shutil.copytree(source, folder)
    return folder


def load_head(kind: str, tiny_mixed, folder):
    from specpipe.stages.draft.medusa import load_medusa

    target = TargetModel(tiny_mixed.loaded.model, name="tiny_mixed")
    if kind == "eagle":
        return load_eagle(target, tiny_mixed.tokenizer, path=str(folder), vocab_top_k=0)
    if kind == "eagle3":
        return load_eagle3(target, tiny_mixed.tokenizer, path=str(folder))
    return load_medusa(target, tiny_mixed.tokenizer, path=str(folder), vocab_top_k=0)


def written_head(kind: str, tiny_mixed):
    from conftest import medusa_head_dir

    config = tiny_mixed.loaded.model.config
    if kind == "eagle":
        return eagle_head_dir(config, "random")
    if kind == "eagle3":
        return eagle3_head_dir(tiny_mixed.loaded.model, "random")
    return medusa_head_dir(config, "random")


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa"])
def test_a_head_garbled_in_place_is_refused_by_the_checksum_its_writer_recorded(tiny_mixed, tmp_path, kind):
    """Weights overwritten without changing the file's size load as a head that drafts nothing; the SHA-256
    the writer records in config.json (`specpipe.weights_sha256`) tells, and the load refuses them."""
    from specpipe.stores.manifest import sha256_file

    folder = head_copy(written_head(kind, tiny_mixed), tmp_path / "head")
    weights = folder / "model.safetensors"
    recorded = json.loads((folder / "config.json").read_text())["specpipe"]["weights_sha256"]
    assert recorded == {"model.safetensors": sha256_file(weights)}
    load_head(kind, tiny_mixed, folder)  # as written: loads
    data = bytearray(weights.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(64)  # zeros: finite values, only the checksum can tell
    weights.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=rf"{weights} does not match the SHA-256 .*config.json.*damaged or replaced"):
        load_head(kind, tiny_mixed, folder)


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa"])
def test_a_head_with_non_finite_weights_is_refused_naming_the_tensor(tiny_mixed, tmp_path, kind):
    """A released head carries no checksum of its weights; a value that is not finite is refused anyway."""
    from safetensors.torch import load_file

    folder = head_copy(written_head(kind, tiny_mixed), tmp_path / "head")
    config = json.loads((folder / "config.json").read_text())
    config.pop("specpipe")  # as a third-party head: no checksum, no tokenizer record
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(folder / "model.safetensors")
    load_head(kind, tiny_mixed, folder)  # without a checksum: loads
    key = sorted(name for name, tensor in tensors.items() if tensor.is_floating_point())[0]
    tensors[key].view(-1)[3] = float("nan")
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ConfigError, match=rf"{folder / 'model.safetensors'}.*tensor {key} holds 1 NaN or infinite"):
        load_head(kind, tiny_mixed, folder)


class Exploit:
    ran = False

    def __reduce__(self):
        return (Exploit._run, ())

    @staticmethod
    def _run():
        Exploit.ran = True
        return torch.zeros(1)


def test_a_head_for_another_tokenizer_and_a_missing_default_are_refused(tiny_mixed, tmp_path):
    folder = tmp_path / "head"
    released_eagle1(folder, tiny_mixed.loaded.model.config, fmt="safetensors")
    data = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**data, "specpipe": {"target": "other", "vocab_sha256": "0" * 32}}))
    target = TargetModel(tiny_mixed.loaded.model, name="tiny_mixed")
    with pytest.raises(ConfigError, match="another tokenizer"):
        load_eagle(target, tiny_mixed.tokenizer, path=str(folder), vocab_top_k=0)
    import specpipe.stages.draft.eagle_checkpoint as eagle

    default = eagle.DEFAULT_EAGLE_DIR
    eagle.DEFAULT_EAGLE_DIR = str(tmp_path / "nothing-here")
    try:
        with pytest.raises(ConfigError, match=r"task=train_heads.*drafter.path"):
            load_eagle(target, tiny_mixed.tokenizer)
    finally:
        eagle.DEFAULT_EAGLE_DIR = default


@pytest.mark.parametrize("pipeline", ["eagle", "medusa"])
def test_heads_never_run_the_target(tiny, pipeline):
    """A head drafts from the hidden states the verify forwards already computed: one target forward
    per step (the prefill, then one verify each), however many nodes the head drafted."""
    pipe = build_pipeline(tiny.config(pipeline), loaded=tiny.loaded)
    model = pipe.target.model
    calls = []
    handle = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        tokens, steps = run_steps(pipe, random_prompts(2, seed=36)[1], 16)
    finally:
        handle.remove()
    assert sum(step.stats.tree_size for step in steps) > 0
    assert len(calls) == len(steps)


@pytest.mark.skipif(not onednn_available(), reason="oneDNN prepacking needs torch's mkldnn ops")
def test_the_heads_own_output_layers_run_under_the_targets_engine(tiny_mixed, tmp_path):
    """The pipeline builder hands a head's own weights to the target's engine: an EAGLE head's reduced
    output layer and Medusa/Hydra heads, which no draft runner covers (unpacked, a few-row fp32 product
    of an 8192-row output layer measured ~6x slower). Same products, same greedy output."""
    from test_draft_model import write_answer_corpus

    corpus = tmp_path / "answers.parquet"
    prompts = random_prompts(3, seed=37)
    frequent = sorted({t for p in prompts for t in tiny_mixed.greedy_hf(p, 16)})[:40]
    write_answer_corpus(corpus, [frequent * 3])
    pipe = build_pipeline(tiny_mixed.config("eagle", f"pipeline.drafters.eagle.vocab_top_k={len(frequent)}",
                                            f"pipeline.drafters.eagle.vocab_counts={corpus}",
                                            "pipeline.drafters.eagle.weight_quantization=null"),  # int8: test_quantize.py
                          loaded=tiny_mixed.loaded)
    head = pipe.decoder.drafters[0].head
    assert isinstance(head, ReducedVocabHead) and isinstance(head.linear, OneDNNLinear)
    hidden = torch.randn(5, tiny_mixed.loaded.model.config.hidden_size)  # [q, hidden]
    weight = tiny_mixed.reference.get_output_embeddings().weight[head.ids]  # [k, hidden] the target's rows
    with torch.inference_mode():
        torch.testing.assert_close(head(hidden)[:, head.ids], hidden @ weight.T, atol=1e-4, rtol=1e-4)
    for prompt in prompts:
        assert pipe.generate(prompt, max_new_tokens=16).token_ids == tiny_mixed.greedy_hf(prompt, 16)
    for name in ("medusa", "hydra"):
        heads = build_pipeline(tiny_mixed.config(name), loaded=tiny_mixed.loaded).decoder.drafters[0].heads
        linears = [module for module in heads.modules() if isinstance(module, (nn.Linear, OneDNNLinear))]
        assert linears and all(isinstance(module, OneDNNLinear) for module in linears), name


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_under_the_fast_engine_the_head_runs_its_layers_inline_through_the_kernels(tiny_mixed, dtype, layers):
    """engine=fast hands the EAGLE head the kernels' RMSNorm and attention, and inference runs its layers
    inline: a prompt's rows and then tree rows under a tree mask (both the kernel's attention) give the stock
    layers' predicted features, fp32 to float rounding (bf16: to bf16 rounding); a second layer's input norm,
    which the first layer lacks, included."""
    from specpipe.engine.onednn import OneDNNEngine

    stock = drafter_for(tiny_mixed, layers=layers).net.to(dtype)
    lean = drafter_for(tiny_mixed, layers=layers).net.to(dtype)
    assert len(stock.layers) == layers
    OneDNNEngine(draft_layers=False).apply(lean)  # the layers in one kernel call each: the test below
    assert lean.lean and not stock.lean
    if lean.attention_kernel is None:
        pytest.skip("specpipe's CPU kernel does not build here: the lean loop runs SDPA (covered by the pipelines)")
    rows_seen = []
    kernel = lean.attention_kernel
    lean.attention_kernel = lambda query, *rest: rows_seen.append(query.shape[2]) or kernel(query, *rest)
    hidden = tiny_mixed.loaded.model.config.hidden_size
    generator = torch.Generator().manual_seed(45)
    features = torch.randn(73, hidden, generator=generator).to(dtype)
    tokens = torch.randint(0, 1000, (73,), generator=generator)
    tree_mask = torch.ones(3, 3, dtype=torch.bool).tril()
    tree_mask[2, 1] = False  # two siblings under the first node
    outputs = []
    for net in (stock, lean):
        cache = PositionIndexedCache()
        with torch.inference_mode():
            prompt = net(tokens_embedding(tiny_mixed, tokens[:70], dtype), features[:70], torch.arange(70),
                         torch.ones(70, 70, dtype=torch.bool).tril(), cache)
            mask = torch.cat([torch.ones(3, 70, dtype=torch.bool), tree_mask], dim=1)  # [3, 73]
            tree = net(tokens_embedding(tiny_mixed, tokens[70:], dtype), features[70:], torch.tensor([70, 71, 71]),
                       mask, cache)
        outputs.append((prompt, tree))
    # per layer, the prompt's rows under its causal mask where the kernel's build serves 70 rows (not AVX2's), the tree's
    assert rows_seen == ([70] * layers if lean.attention_max_rows[dtype] >= 70 else []) + [3] * layers
    tolerance = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.05}
    for stock_rows, lean_rows in zip(*outputs):
        torch.testing.assert_close(lean_rows.float(), stock_rows.float(), **tolerance)


@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("layers", [1, 2])
def test_a_bf16_heads_layers_run_one_kernel_call_each_as_the_lean_loop_computes_them(tiny_mixed, layers, quantize):
    """Where the kernel multiplies weights in column blocks (AVX512_BF16), engine=fast runs each of a bf16 EAGLE
    head's decoder layers in one call of its block_decoder_layer: a prompt's causal rows and tree rows under a
    tree mask give the op-by-op lean loop's predicted features and cache rows (to a bf16 step), bf16 and int8 weights, a second layer's input norm included; engine.draft_layers=false and
    rows beyond the kernel's go through the lean loop."""
    from specpipe.engine.onednn import OneDNNEngine

    net = drafter_for(tiny_mixed, layers=layers).net.to(torch.bfloat16)
    OneDNNEngine().apply(net, quantize=quantize)
    if net.layer_kernel is None:
        pytest.skip("the kernel's AVX512_BF16 build (column blocks) does not serve here: the lean loop runs")
    block_layers = net._block_layers()
    assert block_layers is not None and len(block_layers.arguments) == layers
    calls = []
    layer_kernel = net.layer_kernel
    net.layer_kernel = lambda rows, *rest: calls.append(rows.shape[0]) or layer_kernel(rows, *rest)
    hidden = tiny_mixed.loaded.model.config.hidden_size
    generator = torch.Generator().manual_seed(46)
    # a prompt of as many causal rows as the kernel takes in one call, up to 40 (64 serve on a Zen 5, 12 on AMX CPUs)
    n = min(40, block_layers.max_rows)
    features = torch.randn(n + 3, hidden, generator=generator).bfloat16()
    tokens = torch.randint(0, 1000, (n + 3,), generator=generator)
    tree_mask = torch.ones(3, 3, dtype=torch.bool).tril()
    tree_mask[2, 1] = False  # two siblings under the first node
    mask = torch.cat([torch.ones(3, n, dtype=torch.bool), tree_mask], dim=1)  # [3, n + 3]
    outputs = []
    for fused in (True, False):
        net.__dict__.pop("_made_block_layers", None)
        kept = net.layer_kernel
        if not fused:
            net.layer_kernel = None
        cache = PositionIndexedCache()
        with torch.inference_mode():
            prompt = net(tokens_embedding(tiny_mixed, tokens[:n], torch.bfloat16), features[:n], torch.arange(n),
                         torch.ones(n, n, dtype=torch.bool).tril(), cache)
            tree = net(tokens_embedding(tiny_mixed, tokens[n:], torch.bfloat16), features[n:],
                       torch.tensor([n, n + 1, n + 1]), mask, cache)
        net.layer_kernel = kept
        outputs.append((prompt, tree, *(torch.stack([layer.keys, layer.values]) for layer in cache.layers)))
        assert cache.get_seq_length() == n + 3
    assert calls == [n] * layers + [3] * layers  # fused: one call per layer and forward; the lean loop none
    for fused_rows, lean_rows in zip(*outputs):
        torch.testing.assert_close(fused_rows.float(), lean_rows.float(), atol=0.02, rtol=2 ** -7)
    # more rows than the engine routes to the kernel: the lean loop (its products over the weights as packed)
    net.__dict__.pop("_made_block_layers", None)
    calls.clear()
    rows = block_layers.max_rows + 1
    with torch.inference_mode():
        net(tokens_embedding(tiny_mixed, tokens[:1].repeat(rows), torch.bfloat16), features[:1].repeat(rows, 1),
            torch.arange(rows), torch.ones(rows, rows, dtype=torch.bool).tril(), PositionIndexedCache())
    assert calls == []
    # a mask that does not fit the cache: the kernel's error, and the cache as it was
    net.__dict__.pop("_made_block_layers", None)
    cache = PositionIndexedCache()
    with torch.inference_mode():
        net(tokens_embedding(tiny_mixed, tokens[:5], torch.bfloat16), features[:5], torch.arange(5),
            torch.ones(5, 5, dtype=torch.bool).tril(), cache)
        with pytest.raises(RuntimeError, match=r"mask: bool \[q, length \+ q\]"):
            net(tokens_embedding(tiny_mixed, tokens[5:7], torch.bfloat16), features[5:7], torch.tensor([5, 6]),
                torch.ones(2, 9, dtype=torch.bool), cache)
    assert cache.get_seq_length() == 5 and all(layer.length == 5 for layer in cache.layers)
    off = drafter_for(tiny_mixed, layers=layers).net.to(torch.bfloat16)
    OneDNNEngine(draft_layers=False).apply(off, quantize=quantize)
    assert off.layer_kernel is None and off.lean


@pytest.mark.parametrize(("layers", "quantize", "vocab_top_k"), [(1, "null", 40), (2, "int8", 40), (1, "int8", 0)])
def test_a_bf16_heads_whole_level_in_one_kernel_call_drafts_bitwise_as_op_by_op(tiny_mixed, tmp_path, layers, quantize,
                                                                                 vocab_top_k):
    """engine.draft_level: where the kernel multiplies weights in column blocks (AVX512_BF16), each draft level of a
    bf16 EAGLE head (fc, its layers, its output layer's log-probs) runs in one kernel call. In eagle_mix on a bf16
    tiny model every such level gives, bit for bit, the predicted features, log-probs and cache rows of the same level
    op by op (the layers one call each), for a reduced and the full output layer, bf16 and int8 weights, one and two
    layers; a prompt's feed of more rows than the kernel takes goes op by op; the decoded tokens and steps are
    engine.draft_level=false's; a call that fails leaves the cache as it was."""
    import copy

    from test_draft_model import write_answer_corpus

    long_prompt = torch.randint(300, 1300, (100,), generator=torch.Generator().manual_seed(71)).tolist()
    prompts = [*random_prompts(2, seed=71), long_prompt]  # its feed is above the kernel's 64 rows (12 on AMX CPUs)
    corpus = tmp_path / "answers.parquet"
    write_answer_corpus(corpus, [sorted({t for p in prompts for t in tiny_mixed.greedy_hf(p, 12)})[:40] * 3])
    overrides = ["model=tiny_random", "model.dtype=bf16", "pipeline=eagle_mix", "cost_curve=flat",
                 f"pipeline.drafters.eagle.path={eagle_head_dir(tiny_mixed.loaded.model.config, 'random', layers=layers)}",
                 f"pipeline.drafters.eagle.vocab_top_k={vocab_top_k}", f"pipeline.drafters.eagle.vocab_counts={corpus}",
                 f"pipeline.drafters.eagle.weight_quantization={quantize}", "pipeline.tree.min_score=0",
                 "engine.amx_rows=0"]  # the vector product, which the op-by-op path runs too (not AMX tiles)
    from specpipe.pipelines.builder import compose_config

    pipe = build_pipeline(compose_config(overrides))
    drafter = pipe.decoder.drafters[0]
    if drafter.net.layer_kernel is None:
        pytest.skip("the kernel's AVX512_BF16 build (column blocks) does not serve here: the layers run op by op")
    level = drafter._kernel_level()
    assert level is not None and len(level.post_norms) == layers
    kernel, kernel_calls = level.level_kernel, []
    level.level_kernel = lambda *arguments: kernel_calls.append(arguments[0].shape[0]) or kernel(*arguments)
    levels = {"kernel": 0, "op by op": 0}
    run_level = drafter._level

    def compared(features, tokens, positions, mask, cache, logprob_rows):
        before = copy.deepcopy(cache)
        predicted, logprobs = run_level(features, tokens, positions, mask, cache, logprob_rows)
        if not level.serves(tokens.shape[0], logprob_rows, cache):
            levels["op by op"] += 1
            return predicted, logprobs
        levels["kernel"] += 1
        expected = drafter._forward(features, tokens, positions, mask, before)
        assert torch.equal(predicted, expected)
        assert torch.equal(logprobs, drafter._logprobs(expected[-logprob_rows:]))
        assert logprobs.shape[-1] == (vocab_top_k or tiny_mixed.loaded.model.config.vocab_size)
        for ours, theirs in zip(cache.layers, before.layers, strict=True):
            assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
        return predicted, logprobs

    drafter._level = compared
    def decoded(pipeline) -> list[tuple[list[int], list[int]]]:  # per prompt: its tokens, the tokens of each step
        runs = [run_steps(pipeline, prompt, 12) for prompt in prompts]
        return [(tokens, [len(step.tokens) for step in steps]) for tokens, steps in runs]

    steps = decoded(pipe)
    assert levels["kernel"] >= 5 and levels["op by op"] >= 1 and len(kernel_calls) == levels["kernel"]
    off = build_pipeline(compose_config([*overrides, "engine.draft_level=false"]))
    assert off.decoder.drafters[0]._kernel_level() is None
    assert decoded(off) == steps
    # a mask that does not fit the cache: the kernel's error, and the cache as it was
    cache = PositionIndexedCache()
    hidden = tiny_mixed.loaded.model.config.hidden_size
    features = torch.randn(5, hidden).bfloat16()
    with torch.inference_mode():
        level(torch.arange(5), features, torch.arange(5), None, cache, 1)
        with pytest.raises(RuntimeError, match=r"mask: bool \[q, length \+ q\]"):
            level(torch.arange(2), features[:2], torch.tensor([5, 6]), torch.ones(2, 9, dtype=torch.bool), cache, 2)
    assert cache.get_seq_length() == 5 and all(layer.length == 5 for layer in cache.layers)


@pytest.mark.parametrize("tiles", [False, True])
@pytest.mark.parametrize("quantize", ["null", "int8"])
def test_a_batchs_draft_level_runs_in_one_kernel_call_each_request_bitwise_as_alone(tiny_mixed, quantize, tiles):
    """A batch's draft level (several requests' rows, each over its own cache, under its own mask) runs in one call of
    the kernel's level where its rows fit one call, in several where they do not: each request's predicted features,
    log-probs and cache rows are bitwise those of its rows alone; a call that fails leaves every cache as it was.
    On AMX tiles (CPUs that have them), a call of DRAFT_LEVEL_TILE_ROWS rows and more runs its products there, in
    another order of sums, and a level of more rows than one call takes runs op by op in one forward: each request's
    rows then agree with its rows alone to bf16 rounding."""
    import copy

    from specpipe.pipelines.builder import compose_config
    from specpipe.stages.draft.eagle import _Rows

    overrides = ["model=tiny_random", "model.dtype=bf16", "pipeline=eagle_mix", "cost_curve=flat",
                 f"pipeline.drafters.eagle.path={eagle_head_dir(tiny_mixed.loaded.model.config, 'random')}",
                 "pipeline.drafters.eagle.vocab_top_k=0", f"pipeline.drafters.eagle.weight_quantization={quantize}",
                 *([] if tiles else ["engine.amx_rows=0"])]
    drafter = build_pipeline(compose_config(overrides)).decoder.drafters[0]
    level = drafter._kernel_level()
    if level is None:
        pytest.skip("the kernel's AVX512_BF16 build (column blocks) does not serve here: levels run op by op")
    if tiles and level.level_kernel.tile_rows == 0:
        pytest.skip("no AMX tiles here: the level runs the vector product")

    def same(ours: torch.Tensor, theirs: torch.Tensor) -> bool:  # bf16 features and cache rows, fp32 log-probs
        if not tiles:
            return torch.equal(ours, theirs)
        return torch.allclose(ours.float(), theirs.float(), rtol=2 ** -6 if ours.dtype == torch.bfloat16 else 0,
                              atol=2 ** -6)
    kernel, calls = level.level_kernel, []
    level.level_kernel = lambda *arguments: calls.append(arguments[0].shape[0]) or kernel(*arguments)
    hidden = tiny_mixed.loaded.model.config.hidden_size
    generator = torch.Generator().manual_seed(5)

    def feed(cached: int, rows: int, logprob_rows: int, tree: bool) -> _Rows:
        cache = PositionIndexedCache()
        with torch.inference_mode():  # `cached` committed rows, fed op by op
            drafter._forward(torch.randn(cached, hidden, generator=generator).bfloat16(),
                             torch.randint(0, 1000, (cached,), generator=generator), torch.arange(cached),
                             torch.ones(cached, cached, dtype=torch.bool).tril(), cache)
        mask = torch.ones(rows, cached + rows, dtype=torch.bool).tril(cached)
        if tree:  # siblings: each row sees the cache and itself only
            mask[:, cached:] = torch.eye(rows, dtype=torch.bool)
        return _Rows(torch.randn(rows, hidden, generator=generator).bfloat16(),
                     torch.randint(0, 1000, (rows,), generator=generator),
                     torch.arange(cached, cached + rows) if not tree else torch.full((rows,), cached), mask, cache,
                     logprob_rows)

    for shapes in ([(7, 1, 1, False), (30, 3, 3, True), (12, 2, 1, False)],  # one call
                   [(9, 5, 5, True), (20, level.max_rows - 4, 2, False), (3, 4, 4, True), (15, 1, 1, False)]):
        feeds = [feed(*shape) for shape in shapes]
        alone = copy.deepcopy(feeds)
        calls.clear()
        together = drafter._levels(feeds)
        groups = len(calls)
        expected = [drafter._level(*one) for one in alone]
        # more rows than one call takes: first-fit calls by the vector product; one forward op by op on the tiles
        assert groups == (1 if sum(shape[1] for shape in shapes) <= level.max_rows else 0 if tiles else 2)
        for (predicted, logprobs), (predicted_alone, logprobs_alone), ours, theirs in zip(together, expected, feeds,
                                                                                         alone, strict=True):
            assert same(predicted, predicted_alone) and same(logprobs, logprobs_alone)
            for mine, single in zip(ours.cache.layers, theirs.cache.layers, strict=True):
                assert mine.length == single.length
                assert same(mine.keys, single.keys) and same(mine.values, single.values)
    feeds = [feed(6, 2, 1, False), feed(8, 2, 2, False)]
    broken = feeds[1]._replace(mask=torch.ones(2, 5, dtype=torch.bool))  # not [rows, cached + rows]
    with pytest.raises(RuntimeError, match=r"mask: bool \[q, length \+ q\]"):
        drafter._levels([feeds[0], broken])
    assert [one.cache.get_seq_length() for one in feeds] == [6, 8]
    assert all(layer.length == cached for one, cached in zip(feeds, (6, 8)) for layer in one.cache.layers)


def tokens_embedding(model, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    with torch.inference_mode():
        return model.reference.get_input_embeddings()(tokens).to(dtype)  # [q, hidden]


def test_a_bf16_target_drafts_with_the_head_trained_on_bf16_features(tmp_path, monkeypatch):
    """With no drafter.path, a bf16 target gets the shipped head trained on bf16 features and an fp32
    target the fp32-trained one (each records its feature dtype); where no bf16 head ships, bf16
    falls back to the default head."""
    import specpipe.stages.draft.eagle_checkpoint as eagle
    from specpipe.paths import CONFIG_DIR

    for dtype, expected in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        config = json.loads((CONFIG_DIR.parent / eagle.default_eagle_dir(dtype) / "config.json").read_text())
        assert config["specpipe"]["feature_dtype"] == expected
    assert eagle.default_eagle_dir(torch.bfloat16) == eagle.DEFAULT_EAGLE_DIR + "_bf16"
    monkeypatch.setattr(eagle, "DEFAULT_EAGLE_DIR", str(tmp_path / "head"))
    assert eagle.default_eagle_dir(torch.bfloat16) == str(tmp_path / "head")
    (tmp_path / "head_bf16").mkdir()
    assert eagle.default_eagle_dir(torch.bfloat16) == str(tmp_path / "head_bf16")
    assert eagle.default_eagle_dir(torch.float32) == str(tmp_path / "head")
