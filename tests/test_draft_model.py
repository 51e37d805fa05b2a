"""drafter=draft_model and tree=eagle2: a draft LM with its own cache, chains and dynamic trees.

Lossless runs of the `draft_model` pipeline are in the generic tests (test_lossless.py, with the
tiny draft of conftest.draft_overrides); here: what the draft computes, its cache, the tree it
grows, and the errors.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import eagle_head_dir, medusa_head_dir, random_prompts, run_steps, tiny_draft_dir
from specpipe.cost import CostCurve, OnlineCostCurve
from specpipe.errors import ConfigError
from specpipe.pipelines.builder import build_pipeline, compose_config
from specpipe.stages.draft.draft_model import ROOT, DraftModelDrafter, load_drafter
from specpipe.stages.tree.eagle2 import Eagle2TreeBuilder
from specpipe.target import TargetModel
from specpipe.types import DecodeState, Proposal
from specpipe.stages.base import StepDrafter


@pytest.fixture(scope="module")
def self_draft_dir(tiny_mixed):
    """tiny_mixed's own weights as a draft: every draft token is the target's argmax."""
    return tiny_mixed.self_draft()


def drafter_for(model, path, **kwargs) -> DraftModelDrafter:
    return load_drafter(TargetModel(model.loaded.model, name=model.name), model.tokenizer, path=str(path), **kwargs)


def causal_logprobs(drafter: DraftModelDrafter, tokens: list[int]) -> torch.Tensor:
    """[vocab] the draft's next-token log-probs after `tokens`, from a plain causal forward (no cache)."""
    with torch.inference_mode():
        logits = drafter.runner.model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, -1]
    return torch.log_softmax(logits.float(), dim=-1)


def test_a_self_draft_is_accepted_whole_and_stays_lossless(tiny_mixed, self_draft_dir):
    """With the target's own weights as the draft its argmax path is always accepted: the pipeline
    really verifies the draft's tree (not vacuous), and the output is still plain greedy. (One
    child per node: the random tiny model's flat distributions would spread a wider tree's
    budget over siblings. The draft's weights stay as the target's: int8 ones would be another model.)"""
    cfg = tiny_mixed.config("draft_model", f"pipeline.drafters.model.path={self_draft_dir}", "pipeline.tree.depth=4",
                            "pipeline.tree.min_score=0", "pipeline.tree.top_k=1", "pipeline.tree.children=1",
                            "pipeline.drafters.model.weight_quantization=null")
    pipe = build_pipeline(cfg, loaded=tiny_mixed.loaded)
    for prompt in random_prompts(4, seed=21):
        tokens, steps = run_steps(pipe, prompt, 24)
        assert tokens == tiny_mixed.greedy_hf(prompt, 24)
        decode_steps = steps[1:-1]  # after the prefill, before a step max_new_tokens may cut
        assert all(step.stats.tree_size >= 3 for step in decode_steps)  # chains of 4 (the 4th node's
        # score can vanish in float rounding on this random model's flat distributions)
        assert all(len(step.tokens) == step.stats.tree_size + 1 for step in decode_steps)  # all accepted


def test_sps_chain_under_the_trie_builder_is_lossless(tiny_mixed, self_draft_dir):
    cfg = compose_config([*tiny_mixed.overrides, "pipeline=draft_model", "cost_curve=flat", "~pipeline.drafters.model",
                          "+drafter@pipeline.proposers.model=draft_model", f"pipeline.proposers.model.path={self_draft_dir}",
                          "tree@pipeline.tree=trie", "pipeline.proposers.model.min_score=0",
                          "pipeline.proposers.model.vocab_top_k=0", "pipeline.proposers.model.weight_quantization=null"])
    pipe = build_pipeline(cfg, loaded=tiny_mixed.loaded)
    assert len(pipe.decoder.proposers) == 1 and not pipe.decoder.drafters
    for prompt in random_prompts(3, seed=22):
        tokens, steps = run_steps(pipe, prompt, 20)
        assert tokens == tiny_mixed.greedy_hf(prompt, 20)
        assert all(step.stats.tree_size >= 3 and len(step.tokens) == step.stats.tree_size + 1
                   for step in steps[1:-1])  # whole chains accepted (see the test above)


def test_tree_nodes_see_exactly_their_path(tiny_mixed):
    """Each expanded node's draft log-probs equal a causal forward over committed text + its path."""
    drafter = drafter_for(tiny_mixed, tiny_draft_dir())
    prompt = random_prompts(1, seed=23)[0][:40]
    state = DecodeState(tokens=list(prompt), prompt_length=len(prompt))
    drafter.reset(state)
    root = drafter.start(state)
    torch.testing.assert_close(root, causal_logprobs(drafter, prompt), atol=1e-4, rtol=1e-4)
    tokens, parents = [], []
    children = drafter.step(state, tokens, parents, [ROOT]).topk(3).indices  # [1, 3]
    tokens += children[0].tolist()
    parents += [ROOT] * 3
    grandchildren = drafter.step(state, tokens, parents, [2, 0]).topk(3).indices  # [2, 3]: siblings in one forward
    tokens += grandchildren.flatten().tolist()
    parents += [2] * 3 + [0] * 3
    drafter.step(state, tokens, parents, [len(tokens) - 1, 3])  # depth 3, two different branches
    session = state.stage_state[drafter]
    for node in (0, 2, 3, len(tokens) - 1):
        path, walk = [], node
        while walk != ROOT:
            path.append(tokens[walk])
            walk = parents[walk]
        expected = causal_logprobs(drafter, prompt + path[::-1])
        torch.testing.assert_close(session.logprobs[node], expected, atol=1e-4, rtol=1e-4)


def test_the_draft_cache_after_a_step_equals_recomputing_the_committed_text(tiny_mixed):
    """After commits (accepted paths of several lengths) the draft cache's committed entries equal a
    fresh prefill of the committed tokens: the cut-and-catch-up drops every rejected branch."""
    cfg = tiny_mixed.config("draft_model", f"pipeline.drafters.model.path={tiny_draft_dir()}")
    pipe = build_pipeline(cfg, loaded=tiny_mixed.loaded)
    drafter = pipe.decoder.drafters[0]
    prompt = random_prompts(2, seed=24)[1]
    captured = {}

    def capture_finish(state):
        session = state.stage_state[drafter]
        captured["state"] = state
        drafter.start(state)  # catch up with the last commit, as the next step would
        captured["cache"] = [(layer.keys.clone(), layer.values.clone()) for layer in session.cache.layers]

    drafter.on_finish = capture_finish
    try:
        run_steps(pipe, prompt, 20)
    finally:
        del drafter.on_finish
    tokens = captured["state"].tokens
    fresh = drafter.runner.new_cache()
    drafter.runner.prefill(tokens, fresh)
    for (keys, values), layer in zip(captured["cache"], fresh.layers):
        assert keys.shape[-2] == len(tokens)
        torch.testing.assert_close(keys, layer.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(values, layer.values, atol=1e-5, rtol=1e-5)


class ScriptedDrafter(StepDrafter):
    """A StepDrafter whose next-token distribution depends only on depth: p(token t at depth d)."""

    name = "scripted"

    def __init__(self, distributions: list[dict[int, float]], vocab: int = 10) -> None:
        self.distributions = distributions
        self.vocab = vocab
        self.expanded: list[list[int]] = []

    def reset(self, state): ...

    def propose(self, state): raise AssertionError("a StepDrafter is grown, not asked to propose")

    def on_commit(self, state, result): ...

    def start(self, state):
        return self._logprobs(0)

    def step(self, state, tokens, parents, frontier):
        self.expanded.append(list(frontier))
        rows = []
        for node in frontier:
            depth = 0
            walk = node
            while walk != ROOT:
                depth += 1
                walk = parents[walk]
            rows.append(self._logprobs(depth))
        return torch.stack(rows)  # [m, vocab]

    def _logprobs(self, depth: int) -> torch.Tensor:
        probs = torch.zeros(self.vocab)
        for token, p in self.distributions[depth].items():
            probs[token] = p
        return probs.log()


def test_eagle2_expands_the_best_frontier_and_keeps_the_best_nodes_closed_under_ancestors():
    distributions = [{1: 0.6, 2: 0.3, 3: 0.1}, {4: 0.9, 5: 0.1}, {6: 0.5, 7: 0.5}]
    drafter = ScriptedDrafter(distributions)
    builder = Eagle2TreeBuilder(CostCurve.flat(), depth=3, top_k=2, children=2, max_nodes=5, min_score=0.0)
    state = DecodeState(tokens=[0], prompt_length=1)
    grown, _ = builder.grow(state, drafter)
    # depth 1: the root's top 2 (tokens 1, 2); depth 2: both expanded; depth 3: the best two of
    # the four grandchildren by cumulative probability (1-4: 0.54, 2-4: 0.27)
    assert drafter.expanded[0] == [ROOT] and drafter.expanded[1] == [0, 1]
    assert [grown.tokens[n].item() for n in drafter.expanded[2]] == [4, 4]
    scores = grown.scores.tolist()
    for node, parent in enumerate(grown.parents.tolist()):
        if parent >= 0:
            assert scores[node] <= scores[parent]
    tree = builder.build(state, [], [drafter])
    assert len(tree) == 5  # a flat cost curve takes the budget
    kept = sorted(zip(tree.depth.tolist(), tree.tokens.tolist()))
    assert kept == [(0, 1), (0, 2), (1, 4), (1, 4), (2, 6)] or kept == [(0, 1), (0, 2), (1, 4), (1, 4), (2, 7)]
    for node, parent in enumerate(tree.parents.tolist()):  # closed under ancestors, topological
        assert parent < node


def test_eagle2_stops_expanding_below_min_score():
    drafter = ScriptedDrafter([{1: 0.2, 2: 0.1}, {3: 0.2}, {4: 0.9}])
    builder = Eagle2TreeBuilder(CostCurve.flat(), depth=3, top_k=2, children=2, min_score=0.1)
    builder.grow(DecodeState(tokens=[0], prompt_length=1), drafter)
    assert len(drafter.expanded) == 2  # depth 2's best path (0.04) is below 0.1: no third expansion


def test_eagle2_expands_less_where_the_other_sources_already_fill_the_tree():
    """A level costs 1 ms of drafting on a 10 ms + 0.5 ms/row verify: alone, a drafter 90% sure at every
    depth is expanded three levels deep; beside a retrieved chain of eight near-certain nodes, which the
    tree takes anyway, one more of its levels cannot pay and it stops after the first."""
    def expansions(others):
        drafter = ScriptedDrafter([{1: 0.9}, {2: 0.9}, {3: 0.9}])
        drafter.cost_curve = CostCurve((1, 64), (1.0, 1.0))
        builder = Eagle2TreeBuilder(CostCurve((1, 64), (10.0, 41.5)), depth=3, top_k=1, children=1, min_score=0.0)
        builder.build(DecodeState(tokens=[0], prompt_length=1), others, [drafter])
        return len(drafter.expanded)

    retrieved = Proposal.chain([5, 6, 7, 8, 9, 10, 11, 12], [0.99, 0.98, 0.97, 0.96, 0.95, 0.94, 0.93, 0.92], "ngram")
    assert expansions([]) == 3
    assert expansions([retrieved]) == 1


def test_eagle2_prices_a_drafters_levels_by_what_they_take_under_an_online_curve(monkeypatch):
    """A drafter whose cached curve says 2 ms a level but whose levels take 6 ms, on a 10 ms + 0.5 ms/row verify:
    priced by the cached curve it is expanded two levels past the root's children at every step (one 0.9-sure
    child pays while a level costs under ~4 ms: 2.71 tokens for 11 ms + the level against 1.9 for 10.5 ms). With
    the curve online (cost_curve=online) each level it drafts is observed, the price rises to what the levels
    take, and the drafter is no longer grown past the root's children, which come with `start` (no level is
    observed for them)."""
    now = [0.0]  # the tree builder's clock, moved by the levels alone: 6 ms each, however busy this machine is
    monkeypatch.setattr("specpipe.stages.tree.eagle2.time", SimpleNamespace(perf_counter=lambda: now[0]))

    class SlowDrafter(ScriptedDrafter):
        def step(self, state, tokens, parents, frontier):
            if frontier != [ROOT]:
                now[0] += 0.006
            return super().step(state, tokens, parents, frontier)

    def levels_per_build(curve, builds):
        drafter = SlowDrafter([{1: 0.9}, {2: 0.9}, {3: 0.9}])
        drafter.cost_curve = curve
        builder = Eagle2TreeBuilder(CostCurve((1, 64), (10.0, 41.5)), depth=3, top_k=1, children=1, min_score=0.0)
        counts = []
        for _ in range(builds):
            drafter.expanded = []
            builder.build(DecodeState(tokens=[0], prompt_length=1), [], [drafter])
            counts.append(len(drafter.expanded) - 1)  # beyond the root's
        return counts

    cached = CostCurve((1, 64), (2.0, 2.0))
    assert levels_per_build(cached, 5) == [2] * 5
    online = OnlineCostCurve(cached)
    counts = levels_per_build(online, 40)
    assert counts[0] == 2 and counts[-1] == 0
    assert online.observations == sum(counts)
    assert online(1) > 3.97


def test_eagle2_grows_only_the_frontier_nodes_that_pay_for_their_verify_rows():
    """A frontier of one likely node (0.8) and seven unlikely ones (0.02): on a 10 ms + 1 ms/row verify and
    a 1 ms draft level, growing all eight cannot pay (at best (1.8 + 0.94) tokens for 19 + 1 ms, against
    1.8 for 11 ms), so pricing the whole frontier stopped the tree at one level. The likely node alone
    can ((1.8 + 0.8 * 0.8) tokens for 12 + 1 ms: the draft was 0.8 sure of its best child at the level
    before), so the next level expands that one node, in a one-row draft forward."""
    drafter = ScriptedDrafter([{1: 0.8, **{token: 0.02 for token in range(2, 9)}}, {9: 0.9}])
    drafter.cost_curve = CostCurve((1, 64), (1.0, 1.0))
    builder = Eagle2TreeBuilder(CostCurve((1, 64), (10.0, 73.0)), depth=2, top_k=8, children=8, min_score=0.0)
    builder.build(DecodeState(tokens=[0], prompt_length=1), [], [drafter])
    assert drafter.expanded == [[ROOT], [0]]


def test_eagle2_with_fixed_sizes_drafts_and_keeps_what_the_published_method_would_whatever_the_costs():
    """fixed_size (EAGLE-2's own total_tokens): on the costs under which the priced tree above expanded one node
    and would keep only a few, every level of `top_k` nodes is drafted to `depth` and the `max_nodes` best are
    kept; the verify curve and the drafter's own cost are not read."""
    drafter = ScriptedDrafter([{1: 0.8, **{token: 0.02 for token in range(2, 9)}}, {9: 0.9}, {6: 0.5, 7: 0.4}])
    drafter.cost_curve = CostCurve((1, 64), (1.0, 1.0))
    builder = Eagle2TreeBuilder(CostCurve((1, 64), (10.0, 73.0)), depth=3, top_k=4, children=4, max_nodes=9,
                                min_score=0.0, fixed_size=True)
    tree = builder.build(DecodeState(tokens=[0], prompt_length=1), [], [drafter])
    assert [len(level) for level in drafter.expanded] == [1, 4, 4]
    assert len(tree) == 9 and builder.cost_curve(64) == 1.0
    priced = Eagle2TreeBuilder(CostCurve((1, 64), (10.0, 73.0)), depth=3, top_k=4, children=4, max_nodes=9,
                               min_score=0.0)
    assert len(priced.build(DecodeState(tokens=[0], prompt_length=1), [], [drafter])) < 9


def test_draft_model_errors_are_clear(tiny_mixed, tmp_path):
    with pytest.raises(ConfigError, match="not a local model directory"):
        drafter_for(tiny_mixed, tmp_path)
    wrong_vocab = tmp_path / "wrong"
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(wrong_vocab)
    tiny_mixed.tokenizer.save_pretrained(wrong_vocab)
    with pytest.raises(ConfigError, match="vocabulary has 1000 entries and the target's 49152"):
        drafter_for(tiny_mixed, wrong_vocab)
    with pytest.raises(ConfigError, match="tree=eagle2"):
        build_pipeline(compose_config([*tiny_mixed.overrides, "pipeline=draft_model", "cost_curve=flat",
                                       f"pipeline.drafters.model.path={tiny_draft_dir()}", "tree@pipeline.tree=trie"]),
                       loaded=tiny_mixed.loaded)
    with pytest.raises(ConfigError, match="put it under pipeline.proposers"):
        build_pipeline(tiny_mixed.config("draft_model", "+retriever@pipeline.drafters.ngram=prompt_ngram",
                                         f"pipeline.drafters.model.path={tiny_draft_dir()}"), loaded=tiny_mixed.loaded)


def test_a_head_folder_given_to_draft_model_names_the_drafter_that_reads_it(tiny_mixed):
    """transformers would load a head folder as a model with random layers (and print its load report):
    the layout is told first, with a command that works as typed."""
    config = tiny_mixed.loaded.model.config
    for folder, drafter, key in ((eagle_head_dir(config, "random"), "eagle", "eagle"),
                                 (medusa_head_dir(config, "random"), "medusa", "medusa"),
                                 (medusa_head_dir(config, "random", hydra=True), "hydra", "hydra")):
        with pytest.raises(ConfigError) as error:
            drafter_for(tiny_mixed, folder, vocab_top_k=0)
        message = str(error.value)
        assert "not a draft model" in message, message
        assert f"`pipeline={drafter} pipeline.drafters.{key}.path={folder}`" in message, message


def test_a_draft_with_another_tokenizer_is_refused_for_its_tokenizer_first(tiny_mixed, tmp_path):
    """Before anything counts tokens by the target's ids (vocab_top_k), the tokenizer is compared."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tiny_mixed.tokenizer.save_pretrained(tmp_path / "target_tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "target_tokenizer", local_files_only=True)
    tokenizer.add_tokens(["<specpipe-other-token>"])
    folder = tmp_path / "other_tokenizer"
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    with pytest.raises(ConfigError, match=f"{len(tokenizer)} tokens against the target's {len(tiny_mixed.tokenizer)}"):
        drafter_for(tiny_mixed, folder, vocab_top_k=8192)


def test_specinfer_mix_merges_the_draft_tree_and_the_ngram_trie(tiny_mixed):
    """One tree from both sources, by config alone: each source's nodes get accepted somewhere, and
    the output stays plain greedy."""
    pipe = tiny_mixed.pipeline("specinfer_mix")
    assert [type(p).__name__ for p in pipe.decoder.proposers] == ["PromptNgram"]
    assert [d.name for d in pipe.decoder.drafters] == ["draft_model"]
    credited: dict[str, int] = {}
    for prompt in random_prompts(6, seed=25):
        tokens, steps = run_steps(pipe, prompt, 24)
        assert tokens == tiny_mixed.greedy_hf(prompt, 24)
        for step in steps:
            for source, count in step.stats.drafted_by_source.items():
                credited[source] = credited.get(source, 0) + count
    assert credited.get("draft_model", 0) > 0 and credited.get("ngram_trie", 0) > 0, credited


def write_answer_corpus(path, answers: list[list[int]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"answer_ids": pa.array(answers, type=pa.list_(pa.int32()))}), path)


def test_the_reduced_vocabulary_head_scores_only_the_frequent_tokens(tiny_mixed, tmp_path):
    from specpipe.stages.draft.reduced_vocab import ReducedVocabHead, frequent_tokens

    corpus = tmp_path / "answers.parquet"
    write_answer_corpus(corpus, [[5, 5, 5, 9, 9, 700], [9, 5, 42]])
    ids, coverage = frequent_tokens(str(corpus), tiny_mixed.tokenizer, 2)
    assert ids.tolist() == [5, 9] and coverage == pytest.approx(7 / 9)
    weight = torch.randn(1000, 16)
    head = ReducedVocabHead(weight, torch.tensor([3, 7, 500]), 1000)
    hidden = torch.randn(2, 4, 16)  # [batch, q, hidden]
    logits = head(hidden)
    full = hidden @ weight.T
    assert logits.shape == (2, 4, 1000)
    torch.testing.assert_close(logits[..., [3, 7, 500]], full[..., [3, 7, 500]])
    others = torch.ones(1000, dtype=torch.bool)
    others[[3, 7, 500]] = False
    assert torch.isneginf(logits[..., others]).all()


def test_a_bad_reduced_vocabulary_setting_is_refused(tiny_mixed, tmp_path):
    """(Greedy decoding over a reduced vocabulary equals HF greedy: tests/test_draft_vocab.py, for every
    model drafter.)"""
    corpus = tmp_path / "answers.parquet"
    write_answer_corpus(corpus, [[5, 9, 42] * 3])
    with pytest.raises(ConfigError, match="vocab_top_k must be between 1 and the vocabulary size"):
        build_pipeline(tiny_mixed.config("draft_model", "pipeline.drafters.model.vocab_top_k=49152",
                                         f"pipeline.drafters.model.vocab_counts={corpus}"), loaded=tiny_mixed.loaded)
    with pytest.raises(ConfigError, match="does not exist"):
        build_pipeline(tiny_mixed.config("draft_model", "pipeline.drafters.model.vocab_top_k=100",
                                         f"pipeline.drafters.model.vocab_counts={tmp_path / 'none'}"),
                       loaded=tiny_mixed.loaded)


def test_a_reduced_vocabulary_draft_hands_out_log_probs_over_its_own_tokens(tiny_mixed, tmp_path):
    """With vocab_top_k the drafter skips the -inf scatter over the whole vocabulary: its root and node
    rows are [k] over `draft_vocab`, equal to the full-vocabulary rows at those columns (where all the
    probability is), and its SpS chain names target tokens, the same ones."""
    corpus = tmp_path / "answers.parquet"
    write_answer_corpus(corpus, [list(range(300)), list(range(0, 600, 2))])
    reduced = drafter_for(tiny_mixed, tiny_draft_dir(), vocab_top_k=64, vocab_counts=str(corpus), min_score=0.0)
    full = drafter_for(tiny_mixed, tiny_draft_dir(), vocab_top_k=64, vocab_counts=str(corpus), min_score=0.0)
    full.draft_vocab = None  # the same reduced output layer, scattered over the whole vocabulary
    assert reduced.draft_vocab is not None and reduced.draft_vocab.shape == (64,)
    prompt = random_prompts(1, seed=25)[0][:30]
    rows = {}
    for name, drafter in (("reduced", reduced), ("full", full)):
        state = DecodeState(tokens=list(prompt), prompt_length=len(prompt))
        drafter.reset(state)
        root = drafter.start(state)
        nodes = drafter.step(state, [5, 7], [ROOT, ROOT], [0, 1])  # [2, k] or [2, vocab]
        rows[name] = torch.cat([root[None], nodes])
        drafter.reset(state)
        rows[name + " chain"] = drafter.propose(state).tokens.tolist()
    assert rows["reduced"].shape == (3, 64) and rows["full"].shape == (3, tiny_mixed.tokenizer.vocab_size)
    torch.testing.assert_close(rows["reduced"], rows["full"][:, reduced.draft_vocab])
    assert rows["reduced chain"] == rows["full chain"] and rows["reduced chain"]
    assert set(rows["reduced chain"]) <= set(reduced.draft_vocab.tolist())


@pytest.mark.parametrize(("draft", "vocab_top_k", "quantize"), [("tiny", 40, "auto"), ("self", 0, "null")])
def test_a_bf16_draft_models_whole_level_runs_in_one_kernel_call(tiny_mixed, self_draft_dir, tmp_path, draft,
                                                                  vocab_top_k, quantize):
    """engine.draft_level with a bf16 draft model: where the kernel multiplies weights in column blocks (AVX512_BF16),
    each level of the draft (its embeddings, its layers one block_decoder_layer each, its final norm, its output
    layer's log-probs) runs in one kernel call. Its log-probs and cache rows are those of the level through the runner
    to a bf16 step (the layers' SiLU may round one step apart), for a reduced and the full output layer, one and two
    layers; a prompt's feed beyond the kernel's rows goes through the runner; the target gets no such kernel; the
    greedy output is the bf16 `vanilla`'s token for token."""
    import copy

    from specpipe.engine.cpu_kernel_build import kernel_isa

    long_prompt = torch.randint(300, 1300, (100,), generator=torch.Generator().manual_seed(72)).tolist()
    prompts = [*random_prompts(2, seed=72), long_prompt]  # its feed is above the kernel's 64 rows (12 on AMX CPUs)
    corpus = tmp_path / "answers.parquet"
    write_answer_corpus(corpus, [sorted({t for p in prompts for t in tiny_mixed.greedy_hf(p, 12)})[:40] * 3])
    path = tiny_draft_dir("bf16") if draft == "tiny" else self_draft_dir
    common = ["model=tiny_random", "model.dtype=bf16", "cost_curve=flat"]
    pipe = build_pipeline(compose_config([*common, "pipeline=specinfer_mix", "pipeline.tree.min_score=0",
                                          f"pipeline.drafters.model.path={path}",
                                          f"pipeline.drafters.model.vocab_top_k={vocab_top_k}",
                                          f"pipeline.drafters.model.vocab_counts={corpus}",
                                          f"pipeline.drafters.model.weight_quantization={quantize}"]))
    drafter = pipe.decoder.drafters[0]
    level = drafter._kernel_level()
    if kernel_isa() != "avx512_bf16":
        assert level is None
        pytest.skip("the kernel's AVX512_BF16 build (column blocks) does not serve here: the draft runs op by op")
    assert level is not None and pipe.target.model.model.level_kernel is None
    layers = len(drafter.runner.model.model.layers)
    assert len(level.post_norms) == layers == (1 if draft == "tiny" else 2)
    levels = {"kernel": 0, "runner": 0}
    run_level = drafter._forward_logprobs

    def compared(input_ids, positions, mask, cache, rows):
        before = copy.deepcopy(cache)
        served = level.serves(input_ids.shape[0], rows, cache)
        logprobs = run_level(input_ids, positions, mask, cache, rows)
        levels["kernel" if served else "runner"] += 1
        if served:
            reduced = drafter._reduced_head()
            out = drafter.runner.forward_masked(input_ids, positions, mask, before,
                                                logits_rows=drafter._logits_rows(reduced, None))
            expected = drafter._logprobs(out, reduced, 0)[-rows:]
            assert logprobs.shape == expected.shape and logprobs.shape[-1] == (vocab_top_k or 49152)
            torch.testing.assert_close(logprobs, expected, atol=0.05, rtol=0)
            for ours, theirs in zip(cache.layers, before.layers, strict=True):
                torch.testing.assert_close(ours.keys.float(), theirs.keys.float(), atol=0.02, rtol=2 ** -7)
                torch.testing.assert_close(ours.values.float(), theirs.values.float(), atol=0.02, rtol=2 ** -7)
        return logprobs

    drafter._forward_logprobs = compared
    vanilla = build_pipeline(compose_config([*common, "pipeline=vanilla"]))
    for prompt in prompts:
        assert run_steps(pipe, prompt, 12)[0] == run_steps(vanilla, prompt, 12)[0]
    assert levels["kernel"] >= 5 and levels["runner"] >= 1


def test_a_batchs_draft_model_level_runs_in_kernel_calls_each_request_bitwise_as_alone(tiny_mixed):
    """A batch's level of a bf16 draft model (several requests' rows, each over its own cache) runs in as few calls of
    the kernel's level as its row limit allows: each request's log-probs and cache rows are bitwise its rows alone."""
    import copy

    from specpipe.engine.cpu_kernel_build import kernel_isa
    from specpipe.kv_cache import PositionIndexedCache

    pipe = build_pipeline(compose_config(["model=tiny_random", "model.dtype=bf16", "cost_curve=flat",
                                          "pipeline=specinfer_mix",
                                          f"pipeline.drafters.model.path={tiny_draft_dir('bf16')}",
                                          "engine.amx_rows=0"]))  # the vector product (AMX tiles: test_eagle's)
    drafter = pipe.decoder.drafters[0]
    level = drafter._kernel_level()
    if kernel_isa() != "avx512_bf16" or level is None:
        pytest.skip("the kernel's AVX512_BF16 build (column blocks) does not serve here: the draft runs op by op")
    kernel, calls = level.level_kernel, []
    level.level_kernel = lambda *arguments: calls.append(arguments[0].shape[0]) or kernel(*arguments)
    generator = torch.Generator().manual_seed(9)

    def feed(cached: int, rows: int, logprob_rows: int):
        cache = PositionIndexedCache()
        drafter._forward_logprobs(torch.randint(0, 1000, (cached,), generator=generator), torch.arange(cached),
                                  torch.ones(cached, cached, dtype=torch.bool).tril(), cache, 1)
        mask = torch.ones(rows, cached + rows, dtype=torch.bool).tril(cached)
        return (torch.randint(0, 1000, (rows,), generator=generator), torch.arange(cached, cached + rows), mask, cache,
                logprob_rows)

    feeds = [feed(5, 1, 1), feed(11, 3, 2), feed(8, level.max_rows - 3, 1), feed(6, 2, 2)]
    alone = copy.deepcopy(feeds)
    calls.clear()
    together = drafter._levels(feeds)
    assert len(calls) == 2  # max_rows + 3 rows: the long feed alone, the others together
    for logprobs, one, ours in zip(together, alone, feeds, strict=True):
        assert torch.equal(logprobs, drafter._forward_logprobs(*one))
        for mine, single in zip(ours[3].layers, one[3].layers, strict=True):
            assert torch.equal(mine.keys, single.keys) and torch.equal(mine.values, single.values)
