"""Greedy pipelines are lossless: token for token what plain greedy decoding produces (fp32),
and they stop exactly where plain decoding would (max_new_tokens, EOS, stop strings)."""
from __future__ import annotations

import pydoc_data.topics
import pytest
import torch

from conftest import DRAFT_MODEL_PIPELINES, DRAFTING_PIPELINES, HEAD_PIPELINES, PIPELINES, is_repetitive, near_tie_divergence, random_prompts, run_steps, shipped_heads

LENGTHS = (1, 2, 7, 40)


def test_pipelines_are_discovered():
    assert {"vanilla", "prompt_lookup", "lookahead_trie"} <= set(PIPELINES)


@pytest.mark.parametrize("model", ["tiny", "tiny_mixed"])
def test_references_agree(request, model):
    """The two references cross-check each other: HF generate == full-recompute argmax loop."""
    m = request.getfixturevalue(model)
    for i, prompt in enumerate(random_prompts(8, seed=11)):
        n = (3, 12)[i % 2]
        assert m.greedy_hf(prompt, n) == m.greedy_loop(prompt, n), f"prompt {i}"


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_lossless_tiny(any_tiny, pipeline):
    """30 random prompts per model variant, lengths 1, 2, 7, 40: identical to HF greedy."""
    pipe = any_tiny.pipeline(pipeline)
    prompts = random_prompts(30, seed=1)
    drafted_steps, repetitive_tokens, repetitive_steps, tree_nodes = 0, 0, 0, 0
    for i, prompt in enumerate(prompts):
        n = LENGTHS[i % len(LENGTHS)] if not is_repetitive(prompt) else 40
        expected = any_tiny.greedy_hf(prompt, n)
        tokens, steps = run_steps(pipe, prompt, n)
        assert tokens == expected, f"{pipeline} on {any_tiny.name}, prompt {i} ({n} tokens): {tokens} != {expected}"
        assert len(tokens) <= n
        assert steps[-1].finished and not any(step.finished for step in steps[:-1])
        assert all(step.stats.accepted == len(step.tokens) >= 1 for step in steps)
        assert all(step.drafted <= step.stats.tree_size for step in steps)
        tree_nodes += sum(step.stats.tree_size for step in steps)
        if is_repetitive(prompt):
            drafted_steps += sum(step.drafted > 0 for step in steps)
            repetitive_tokens += len(tokens)
            repetitive_steps += len(steps)
    if pipeline == "vanilla":
        assert tree_nodes == 0
    elif pipeline in DRAFTING_PIPELINES:
        # Not vacuous: drafts were made and accepted, several tokens per step on repetitive prompts.
        assert tree_nodes > 0
        # The identity EAGLE/Medusa heads draft the last token again: accepted where the model repeats it.
        if pipeline not in HEAD_PIPELINES or any_tiny.name == "tiny":
            assert drafted_steps > 0
        # The chaotic variant ignores patterns, drafts mostly fail there; a draft model on a tiny
        # random target predicts no repetition (test_draft_model.py checks its acceptance).
        if any_tiny.name != "tiny_chaotic" and pipeline not in DRAFT_MODEL_PIPELINES + HEAD_PIPELINES:
            assert repetitive_tokens / repetitive_steps > 1.5, (repetitive_tokens, repetitive_steps)


@pytest.mark.parametrize("cost_curve", ["measured", "online"])
@pytest.mark.parametrize("pipeline", DRAFTING_PIPELINES)
def test_lossless_tiny_measured_cost_curve(tiny_mixed, pipeline, cost_curve):
    """The same with the measured cost curve (drafts cut to what pays on this machine), and with that
    curve corrected by each step's own verify forward (tree sizes change while the sequence decodes)."""
    pipe = tiny_mixed.pipeline(pipeline, cost_curve=cost_curve)
    for i, prompt in enumerate(random_prompts(12, seed=2)):
        n = (7, 40)[i % 2]
        tokens, _ = run_steps(pipe, prompt, n)
        assert tokens == tiny_mixed.greedy_hf(prompt, n), f"{pipeline}, prompt {i}"


@pytest.mark.parametrize("pipeline", DRAFTING_PIPELINES)
def test_lossless_across_cache_growth(tiny_mixed, pipeline):
    """A 500-token prompt + 60 new tokens crosses the KV cache's initial capacity (512) mid-decode."""
    generator = torch.Generator().manual_seed(5)
    prompt = torch.randint(300, 1300, (470,), generator=generator).tolist()
    prompt += torch.randint(300, 1300, (5,), generator=generator).tolist() * 6
    tokens, steps = run_steps(tiny_mixed.pipeline(pipeline), prompt, 60)
    assert tokens == tiny_mixed.greedy_hf(prompt, 60)
    assert any(step.drafted > 0 for step in steps)


def test_pipeline_reuse_is_stateless(tiny_mixed):
    """A pipeline run on prompt B, then A again, gives A's output again (no state leaks across requests)."""
    pipe = tiny_mixed.pipeline("lookahead_trie")
    a, b = random_prompts(3, seed=3)[1:3]
    first = pipe.generate(a, max_new_tokens=30).token_ids
    pipe.generate(b, max_new_tokens=30)
    assert pipe.generate(a, max_new_tokens=30).token_ids == first == tiny_mixed.greedy_hf(a, 30)


# ---- the embedded model ------------------------------------------------------------------------

def _summarization_prompt() -> str:
    passage = pydoc_data.topics.topics["assert"][:1200]
    return ("Summarize the following passage from the Python documentation, quoting its key sentences "
            "exactly.\n\n" + passage)


EMBEDDED_PROMPTS = [
    "Explain in a few sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    _summarization_prompt(),
]


@pytest.mark.embedded
@pytest.mark.parametrize("pipeline", PIPELINES)
def test_lossless_embedded(embedded, pipeline):
    """Token for token specpipe's plain greedy decoding on the same engine; that one equals HF greedy
    up to near-ties its engine may flip (tests/test_engine.py), checked here too."""
    pipe = embedded.pipeline(pipeline)
    for i, text in enumerate(EMBEDDED_PROMPTS):
        prompt_ids = pipe.encode(text)
        expected, _ = run_steps(embedded.pipeline("vanilla"), prompt_ids, 48)
        divergence = near_tie_divergence(embedded, prompt_ids, expected, embedded.greedy_hf(prompt_ids, 48))
        assert divergence is None or divergence[1] < 1e-3, f"vanilla vs HF greedy, prompt {i}: {divergence}"
        tokens, steps = run_steps(pipe, prompt_ids, 48)
        assert tokens == expected, (
            f"{pipeline}, prompt {i}:\n{embedded.tokenizer.decode(tokens)!r}\n!=\n{embedded.tokenizer.decode(expected)!r}")
        # (EAGLE/Medusa pipelines draft with trained heads only once they ship; until then identity heads)
        trained = pipeline not in HEAD_PIPELINES or shipped_heads(pipeline).is_dir()
        if pipeline in DRAFTING_PIPELINES and trained and i == len(EMBEDDED_PROMPTS) - 1:
            accepted = sum(step.drafted for step in steps)
            assert accepted >= 5, f"{pipeline}: only {accepted} drafted tokens accepted on the summarization prompt"


@pytest.mark.embedded
@pytest.mark.parametrize("cost_curve", ["measured", "online"])
def test_lossless_embedded_measured_cost_curve(embedded, cost_curve):
    pipe = embedded.pipeline("lookahead_trie", cost_curve=cost_curve)
    prompt_ids = pipe.encode(EMBEDDED_PROMPTS[-1])
    tokens, _ = run_steps(pipe, prompt_ids, 48)
    assert tokens == run_steps(embedded.pipeline("vanilla"), prompt_ids, 48)[0]


@pytest.mark.embedded
def test_embedded_chat_and_plain_prompts_match_hf(embedded):
    """The chat template is applied like HF's own; a plain prompt with chat_template=False is just tokenized."""
    pipe = embedded.pipeline("prompt_lookup")
    messages = [{"role": "user", "content": "Name three primary colors."}]
    expected_ids = embedded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                          return_dict=True)["input_ids"]
    assert pipe.encode(messages) == list(expected_ids) == pipe.encode("Name three primary colors.")
    plain = pipe.encode("The capital of France is", chat_template=False)
    assert plain == embedded.tokenizer("The capital of France is")["input_ids"]
    out = pipe.generate("The capital of France is", max_new_tokens=8, chat_template=False)
    assert out.token_ids == embedded.greedy_hf(plain, 8)


# ---- exact stopping ----------------------------------------------------------------------------

def _multi_token_run(model, pipeline: str, min_step: int = 3):
    """A prompt whose unconstrained run has a step committing >= min_step tokens, after the first."""
    pipe = model.pipeline(pipeline)
    for prompt in random_prompts(24, seed=7):
        tokens, steps = run_steps(pipe, prompt, 40)
        offset = 0
        for index, step in enumerate(steps):
            if index > 0 and len(step.tokens) >= min_step:
                return pipe, prompt, tokens, steps, index, offset
            offset += len(step.tokens)
    raise AssertionError(f"no multi-token step found for {pipeline} on {model.name}")


@pytest.mark.parametrize("pipeline", DRAFTING_PIPELINES)
def test_max_new_tokens_exact_inside_a_multi_token_step(tiny_mixed, pipeline):
    pipe, prompt, tokens, steps, index, offset = _multi_token_run(tiny_mixed, pipeline)
    # Stop in the middle of that step: it would overshoot if the cut were per step.
    limit = offset + 1
    assert offset < limit < offset + len(steps[index].tokens)
    cut, cut_steps = run_steps(pipe, prompt, limit)
    assert cut == tokens[:limit] == tiny_mixed.greedy_hf(prompt, limit)
    assert len(cut) == limit
    assert len(cut_steps) == index + 1 and cut_steps[-1].finished
    assert len(cut_steps[-1].tokens) < len(steps[index].tokens)  # the step really was cut
    # And the pipeline is fine afterwards.
    assert run_steps(pipe, prompt, 40)[0] == tokens


@pytest.mark.parametrize("pipeline", PIPELINES)
@pytest.mark.parametrize("limit", [1, 2, 3, 17])
def test_max_new_tokens_exact(tiny, pipeline, limit):
    prompt = random_prompts(2, seed=8)[1]  # repetitive: long accepted steps on the stock tiny model
    tokens, steps = run_steps(tiny.pipeline(pipeline), prompt, limit)
    assert len(tokens) == limit
    assert tokens == tiny.greedy_hf(prompt, limit)


def _ungated(pipe):
    """The pipeline with its tree builder's drafter gate off: the gate decides from measured times, so
    with it two runs of one prompt need not split the output into the same steps (the tokens are equal)."""
    if getattr(pipe.decoder.tree_builder, "gate", None) is not None:
        pipe.decoder.tree_builder.gate = None
    return pipe


def _find_eos_case(model, pipeline):
    """Searches (deterministically) for a run where a token that occurs nowhere earlier in the
    output is committed as a non-first token of a multi-token step: (prompt, tokens, position)."""
    pipe = _ungated(model.pipeline(pipeline, fresh=True))
    for prompt in random_prompts(36, seed=9):
        tokens, steps = run_steps(pipe, prompt, 40)
        offset = 0
        for step in steps:
            for j in range(1, len(step.tokens)):
                if step.tokens[j] not in tokens[:offset + j]:
                    return prompt, tokens, offset + j
            offset += len(step.tokens)
    return None


@pytest.mark.parametrize("model", ["tiny", "tiny_mixed"])
@pytest.mark.parametrize("pipeline", DRAFTING_PIPELINES)
def test_eos_inside_an_accepted_multi_token_step(request, model, pipeline):
    """EOS committed as a non-first token of a multi-token step stops right there (EOS kept),
    exactly where HF generate stops with the same EOS."""
    m = request.getfixturevalue(model)
    case = _find_eos_case(m, pipeline)
    assert case is not None, f"could not construct an EOS inside a multi-token step on {m.name}"
    prompt, tokens, position = case
    eos = tokens[position]
    eos_pipe = _ungated(m.pipeline(pipeline, fresh=True))
    eos_pipe.eos_token_ids = frozenset({eos, *m.eos_token_ids})
    cut, cut_steps = run_steps(eos_pipe, prompt, 40)
    assert cut == tokens[:position + 1]
    assert cut == m.greedy_hf(prompt, 40, eos_token_ids=sorted(eos_pipe.eos_token_ids))
    assert cut_steps[-1].finished and cut[-1] == eos
    assert len(cut_steps[-1].tokens) >= 2  # EOS arrived inside a multi-token step


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_eos_as_first_token(tiny, pipeline):
    """EOS from the prefill step: one token, finished."""
    prompt = random_prompts(2, seed=4)[1]
    first = tiny.greedy_hf(prompt, 1)[0]
    pipe = tiny.pipeline(pipeline, fresh=True)
    pipe.eos_token_ids = frozenset({first})
    tokens, steps = run_steps(pipe, prompt, 40)
    assert tokens == [first] and len(steps) == 1 and steps[0].finished


def test_default_eos_is_the_models(tiny, embedded):
    assert tiny.eos_token_ids == [tiny.tokenizer.eos_token_id] == [tiny.loaded.model.generation_config.eos_token_id]
    eos = embedded.loaded.model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    assert set(embedded.eos_token_ids) == eos | {embedded.tokenizer.eos_token_id}


@pytest.mark.embedded
@pytest.mark.parametrize("pipeline", PIPELINES)
def test_stop_string_across_tokens(embedded, pipeline):
    pipe = embedded.pipeline(pipeline)
    prompt_ids = pipe.encode(EMBEDDED_PROMPTS[-1])
    full = embedded.greedy_hf(prompt_ids, 48)
    decode = lambda ids: embedded.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    # A stop string spanning two tokens, ending on a token boundary, first seen at token `end`.
    for end in range(8, len(full)):
        stop = decode(full[end - 2:end])
        if len(stop.strip()) >= 4 and stop not in decode(full[:end - 1]):
            break
    else:
        pytest.fail("no usable stop string")
    out = pipe.generate(prompt_ids, max_new_tokens=48, stop=[stop])
    assert out.token_ids == full[:end]
    assert out.text.endswith(stop) and out.text.count(stop) == 1
    # And a stop string that never occurs changes nothing.
    assert pipe.generate(prompt_ids, max_new_tokens=48, stop=["\u2603never\u2603"]).token_ids == full


@pytest.mark.parametrize("pipeline", DRAFTING_PIPELINES)
def test_stop_string_inside_a_multi_token_step(tiny_mixed, pipeline):
    pipe, prompt, tokens, steps, index, offset = _multi_token_run(tiny_mixed, pipeline)
    decode = lambda ids: tiny_mixed.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    # The stop string is the text of the step's 2nd token (plus the one before), cut must land there.
    end = offset + 2
    stop = decode(tokens[end - 2:end])
    first = next(m for m in range(1, len(tokens) + 1) if stop in decode(tokens[:m]))
    out = tiny_mixed.pipeline(pipeline).generate(prompt, max_new_tokens=40, stop=stop)
    assert out.token_ids == tokens[:first]
    assert stop in decode(out.token_ids) and stop not in decode(out.token_ids[:-1])
