"""Sampling verifiers: rejection sampling reproduces the target distribution (seeded
statistical tests with explicit bounds, and a deliberately broken variant that must fail
them), temperature/top-k/top-p exactly as transformers applies them, typical acceptance."""
from __future__ import annotations

import math
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from specpipe.cost import CostCurve
from specpipe.pipelines.decoder import SpeculativeDecoder
from specpipe.pipelines.stopping import StopCondition
from specpipe.sampling import greedy_tokens, target_probs
from specpipe.stages.base import Proposer, StepDrafter
from specpipe.stages.commit.kv_compact import KVCompactCommit
from specpipe.stages.draft.draft_model import DraftModelDrafter
from specpipe.stages.tree.eagle2 import Eagle2TreeBuilder
from specpipe.stages.tree.trie import TrieTreeBuilder
from specpipe.stages.verify.rejection import RejectionSamplingVerifier
from specpipe.stages.verify.typical import TypicalAcceptanceVerifier
from specpipe.target import TargetModel
from specpipe.types import DecodeState, DraftTree, Proposal, SamplingConfig

SEED = int(os.environ.get("SPECPIPE_SAMPLING_SEED", "0"))  # vary it to re-run the statistics
VOCAB = 8


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def tv_bound(p: torch.Tensor, samples: int, failure: float = 1e-4) -> float:
    """A TV distance an empirical distribution of `samples` draws from p exceeds with
    probability below `failure`: its mean is at most 0.5 * sum sqrt(p (1 - p) / N), and one
    draw moves it by at most 1/N, so McDiarmid adds sqrt(ln(1/failure) / 2N)."""
    mean_bound = 0.5 * float((p * (1 - p) / samples).sqrt().sum())
    return mean_bound + math.sqrt(math.log(1 / failure) / (2 * samples))


class ResampleFromTarget(RejectionSamplingVerifier):
    """Broken on purpose: after a rejection it samples from p instead of the residual."""

    @staticmethod
    def _reject(residual, token, q):
        return residual


def distribution(p_logits: torch.Tensor) -> torch.Tensor:
    return p_logits.softmax(-1)


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(SEED)


def random_logits(rows: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=generator) * 0.8  # no token dominates: a wrong sampler shows


# ---- the sampling distribution ---------------------------------------------------------------


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 3, 1.0),
                                                     (0.8, 0, 0.9), (0.6, 5, 0.75), (1.0, 1, 1.0)])
def test_target_probs_match_transformers_warpers(temperature, top_k, top_p):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)) * 3
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1:
        expected = TopPLogitsWarper(top_p)(None, expected)
    got = target_probs(logits, SamplingConfig(temperature, top_k, top_p))
    torch.testing.assert_close(got, expected.softmax(-1), rtol=0, atol=1e-6)
    if top_k:
        assert int((got[0] > 0).sum()) <= top_k


# ---- rejection sampling on synthetic distributions ------------------------------------------------


def first_tokens_of_chain(verifier, p_logits, q, samples, rng, sampling):
    """Per trial: draft x ~ q, verify a one-node chain, record the first emitted token."""
    counts = torch.zeros(VOCAB)
    for _ in range(samples):
        x = int(torch.multinomial(q, 1, generator=rng))
        tree = DraftTree.from_parents(torch.tensor([x]), torch.tensor([-1]), draft_probs=q[None])
        logits = torch.stack([p_logits, p_logits])  # row 1 (after the node) is not needed here
        result = verifier.accept(tree, logits, rng, sampling)
        counts[x if result.accepted else result.bonus] += 1
    return counts / samples


def test_greedy_tokens_are_torch_argmax_on_ties_nan_and_infinities():
    """The verifiers' argmax takes numpy's on CPU fp32 rows: it must pick the same index as torch.argmax wherever
    values tie (the first), a row holds NaN (the first NaN) or only -inf, and on strided rows and other dtypes."""
    generator = torch.Generator().manual_seed(SEED)
    for trial in range(300):
        rows = int(torch.randint(1, 6, (), generator=generator))
        vocab = int(torch.randint(1, 200, (), generator=generator))
        logits = torch.randint(-3, 3, (rows, 2 * vocab), generator=generator).float()[:, ::2]  # ties, strided rows
        if trial % 3 == 0:
            logits[0, int(torch.randint(0, vocab, (), generator=generator))] = float("nan")
        if trial % 5 == 0:
            logits[-1] = float("-inf")
        assert greedy_tokens(logits) == logits.argmax(dim=-1).tolist()
        assert greedy_tokens(logits.bfloat16()) == logits.bfloat16().argmax(dim=-1).tolist()
    wide = torch.randn(3, 49152, generator=generator)
    wide[1, 40000] = wide[1, 123] = wide[1].max() + 1  # a tie far apart: the first wins
    assert greedy_tokens(wide) == wide.argmax(dim=-1).tolist() and greedy_tokens(wide)[1] == 123


def test_rejection_sampling_chain_reproduces_target(rng):
    generator = torch.Generator().manual_seed(SEED + 1)
    p_logits, q_logits = random_logits(2, generator)
    q = q_logits.softmax(-1)
    sampling = SamplingConfig(temperature=1.0)
    samples = 20000
    p = distribution(p_logits)
    bound = tv_bound(p, samples)
    assert tv(first_tokens_of_chain(RejectionSamplingVerifier(), p_logits, q, samples, rng, sampling), p) < bound
    broken = first_tokens_of_chain(ResampleFromTarget(), p_logits, q, samples, rng, sampling)
    assert tv(broken, p) > 2 * bound, "the test must be able to tell a wrong sampler"


def test_rejection_sampling_respects_temperature_top_k_top_p(rng):
    """The draft is built from untempered logits; the output must follow the warped target."""
    generator = torch.Generator().manual_seed(SEED + 2)
    p_logits, q_logits = random_logits(2, generator)
    q = q_logits.softmax(-1)
    sampling = SamplingConfig(temperature=0.7, top_k=5, top_p=0.85)
    samples = 20000
    expected = target_probs(p_logits[None], sampling)[0]
    got = first_tokens_of_chain(RejectionSamplingVerifier(), p_logits, q, samples, rng, sampling)
    assert tv(got, expected) < tv_bound(expected, samples)
    assert float(got[expected == 0].sum()) == 0.0  # never a token the warpers removed
    assert tv(got, p_logits.softmax(-1)) > 3 * tv_bound(expected, samples)  # the untempered p differs


def test_rejection_sampling_tree_of_deterministic_drafts(rng):
    """Root children [a, b, c] and a's children [d, e], all one-hot drafts (retrieval).

    The first token must follow p(root) and, given the first token is a, the second must
    follow p(after a), whatever got accepted or resampled on the way."""
    generator = torch.Generator().manual_seed(SEED + 3)
    logits = random_logits(6, generator)  # rows: root, a, b, c, d, e
    a, b, c, d, e = 2, 5, 0, 1, 2
    tree = DraftTree.from_parents(torch.tensor([a, b, c, d, e]), torch.tensor([-1, -1, -1, 0, 0]))
    sampling = SamplingConfig(temperature=1.0)

    def run(verifier, samples):
        first = torch.zeros(VOCAB)
        second_after_a = torch.zeros(VOCAB)
        for _ in range(samples):
            result = verifier.accept(tree, logits, rng, sampling)
            emitted = [tree.tokens[i].item() for i in result.accepted] + [result.bonus]
            first[emitted[0]] += 1
            if result.accepted[:1] == [0]:  # the first token is node a (a correct sampler never resamples it)
                second_after_a[emitted[1]] += 1
        return first / samples, second_after_a / second_after_a.sum(), int(first[a])

    samples = 20000
    p_root, p_after_a = logits[0].softmax(-1), logits[1].softmax(-1)
    first, second, count_a = run(RejectionSamplingVerifier(), samples)
    assert tv(first, p_root) < tv_bound(p_root, samples)
    assert tv(second, p_after_a) < tv_bound(p_after_a, count_a)
    broken_first, _, _ = run(ResampleFromTarget(), samples)
    assert tv(broken_first, p_root) > 2 * tv_bound(p_root, samples)


def test_rejection_sampling_at_temperature_zero_is_greedy():
    logits = torch.tensor([[0.0, 5.0, 1.0], [4.0, 0.0, 0.0], [0.0, 0.0, 3.0]])
    tree = DraftTree.from_parents(torch.tensor([1, 0]), torch.tensor([-1, 0]))
    result = RejectionSamplingVerifier().accept(tree, logits, None, SamplingConfig(temperature=0.0))
    assert result.accepted == [0, 1] and result.bonus == 2


# ---- end to end on a tiny model with a small vocabulary --------------------------------------------


@pytest.fixture(scope="module")
def small_vocab_target():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=12, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.5, tie_word_embeddings=False)
    return TargetModel(LlamaForCausalLM(config).eval(), "small_vocab")


@torch.inference_mode()
def exact_pair_distribution(target, prompt, sampling):
    """P(t1, t2) of plain sampling from the model: [vocab, vocab]."""
    model = target.model
    first = target_probs(model(torch.tensor([prompt])).logits[0, -1:], sampling)[0]
    following = torch.stack([target_probs(model(torch.tensor([prompt + [t]])).logits[0, -1:], sampling)[0]
                             for t in range(first.shape[0])])
    return first[:, None] * following


class ModelGreedyDrafter(Proposer):
    """Test drafter: the target's own top-2 next tokens, each followed by its greedy chain.

    Its drafts are often right (so acceptance is exercised) and form a two-branch tree."""

    name = "model_greedy"

    def __init__(self, model, length: int = 3) -> None:
        self.model, self.length = model, length

    def reset(self, state):
        pass

    def on_commit(self, state, result):
        pass

    @torch.inference_mode()
    def propose(self, state):
        top2 = self.model(torch.tensor([state.tokens])).logits[0, -1].topk(2).indices.tolist()
        tokens, parents = [], []
        for first in top2:
            chain = [first]
            for _ in range(self.length - 1):
                chain.append(int(self.model(torch.tensor([state.tokens + chain])).logits[0, -1].argmax()))
            parents += [-1] + [len(tokens) + i for i in range(len(chain) - 1)]
            tokens += chain
        return Proposal(torch.tensor(tokens), torch.tensor(parents), torch.full((len(tokens),), 0.5), self.name)


def test_speculative_sampling_end_to_end_matches_plain_sampling(small_vocab_target):
    """Pairs (t1, t2) from the speculative loop follow plain sampling's exact joint distribution;
    t2 is the token a drafted tree decides (accepted node or resampled bonus)."""
    target = small_vocab_target
    prompt = [3, 7, 1, 3, 7, 1, 3, 7, 1, 3, 7]
    sampling = SamplingConfig(temperature=0.9, top_k=8)
    exact = exact_pair_distribution(target, prompt, sampling).flatten()  # [vocab * vocab]

    def sample_pairs(verifier, samples):
        decoder = SpeculativeDecoder(target, [ModelGreedyDrafter(target.model)],
                                     TrieTreeBuilder(CostCurve.flat(), max_nodes=8), verifier, KVCompactCommit())
        counts = torch.zeros_like(exact)
        drafted = 0
        for i in range(samples):
            run = SamplingConfig(sampling.temperature, sampling.top_k, sampling.top_p, seed=SEED * 100000 + i)
            tokens = []
            for step in decoder.decode(prompt, StopCondition(2), run):
                tokens += step.tokens
                drafted += step.drafted
            counts[tokens[0] * 12 + tokens[1]] += 1
        return counts / samples, drafted

    samples = 1500
    got, drafted = sample_pairs(RejectionSamplingVerifier(), samples)
    assert drafted > samples // 3, "drafts must be accepted for the test to mean anything"
    bound = tv_bound(exact, samples)
    assert tv(got, exact) < bound
    broken, _ = sample_pairs(ResampleFromTarget(), samples)
    assert tv(broken, exact) > bound


# ---- typical acceptance -----------------------------------------------------------------------


def test_typical_acceptance_hand_crafted():
    # Row 0 (root) is confident in token 1 and gives token 2 a 5% chance; row 1 (after node 0) is flat.
    root = torch.log(torch.tensor([0.01, 0.90, 0.05, 0.04]))
    flat = torch.zeros(4)
    logits = torch.stack([root, flat, flat, flat])
    sampling = SamplingConfig(temperature=1.0, seed=0)
    verifier = TypicalAcceptanceVerifier(epsilon=0.3, delta=0.07)
    entropy = -float((root.exp() * root).sum())
    threshold = min(0.3, 0.07 * math.exp(-entropy))
    assert 0.05 > threshold > 0.04  # so token 2 passes and token 3 does not
    # nodes: 0 = token 3 (rejected), 1 = token 2 (accepted), 2 = child of 1 with token 0 (flat row: p 0.25)
    tree = DraftTree.from_parents(torch.tensor([3, 2, 0]), torch.tensor([-1, -1, 1]))
    result = verifier.accept(tree, logits, torch.Generator().manual_seed(0), sampling)
    assert result.accepted == [1, 2]
    assert verifier.lossless is False
    greedy = verifier.accept(tree, logits, None, SamplingConfig(temperature=0.0))
    assert greedy.accepted == [] and greedy.bonus == 1


# ---- sampled model drafts (SpecInfer): drafters draw their tokens and hand over their distributions --------


@pytest.fixture(scope="module")
def small_vocab_draft(small_vocab_target):
    """A different random model over the same 12 tokens: its drafts are often, not always, accepted."""
    torch.manual_seed(1)
    config = LlamaConfig(**{**small_vocab_target.model.config.to_dict(), "num_hidden_layers": 1})
    return LlamaForCausalLM(config).eval()


class TopTokensClaimedSampled(Eagle2TreeBuilder):
    """Broken on purpose: takes the draft's most likely tokens but claims they were sampled."""

    @staticmethod
    def _draw(probs, count, rng):
        tokens = probs.topk(count).indices.tolist()
        rows = []
        remaining = probs.clone()
        for token in tokens:
            rows.append(remaining / remaining.sum())
            remaining[token] = 0.0
        return tokens, torch.stack(rows)


class ReducedVocabDrafts(StepDrafter):
    """A drafter handing out log-probs over part of the vocabulary only (StepDrafter.draft_vocab), as
    EAGLE heads over their frequent tokens do: the tree builder must map its columns to token ids
    and give the verifier each node's distribution over the whole vocabulary."""

    def __init__(self, drafter, draft_vocab: torch.Tensor) -> None:
        self.drafter = drafter
        self.draft_vocab = draft_vocab  # [k] target ids, not in order
        self.name = drafter.name

    def reset(self, state):
        self.drafter.reset(state)

    def on_commit(self, state, result):
        self.drafter.on_commit(state, result)

    def start(self, state):
        return torch.log_softmax(self.drafter.start(state)[self.draft_vocab], dim=-1)  # [k]

    def step(self, state, tokens, parents, frontier):
        return torch.log_softmax(self.drafter.step(state, tokens, parents, frontier)[:, self.draft_vocab], dim=-1)


@torch.inference_mode()
def exact_second_and_third(target, prompt, sampling):
    """P(t2, t3) of plain sampling (t1 summed out): [vocab * vocab]."""
    model = target.model

    def next_probs(tokens):
        return target_probs(model(torch.tensor([tokens])).logits[0, -1:], sampling)[0]

    first = next_probs(prompt)
    joint = torch.zeros(12, 12)
    for t1 in range(12):
        second = next_probs(prompt + [t1])
        joint += first[t1] * second[:, None] * torch.stack([next_probs(prompt + [t1, t2]) for t2 in range(12)])
    return joint.flatten()


@pytest.mark.parametrize("layout", ["eagle2", "eagle2_and_deterministic", "eagle2_reduced_vocab", "sps_chain"])
def test_sampled_model_drafts_reproduce_the_target(small_vocab_target, small_vocab_draft, layout):
    """t2 and t3 are decided by the first speculative step: the draft model's sampled tree (alone, or
    beside deterministic drafts), or its sampled chain under the trie builder. Their joint must be
    plain sampling's; the same tree with the draft's top tokens passed off as samples must fail."""
    target = small_vocab_target
    prompt = [3, 7, 1, 3, 7, 1, 3, 7, 1, 3, 7]
    sampling = SamplingConfig(temperature=0.9)
    exact = exact_second_and_third(target, prompt, sampling)

    def decoder(tree_class=Eagle2TreeBuilder):
        drafter = DraftModelDrafter(target, None, small_vocab_draft, chain_length=3, min_score=0.0)
        if layout == "sps_chain":
            return SpeculativeDecoder(target, [drafter], TrieTreeBuilder(CostCurve.flat(), max_nodes=8),
                                      RejectionSamplingVerifier(), KVCompactCommit())
        proposers = [ModelGreedyDrafter(target.model, length=2)] if layout == "eagle2_and_deterministic" else []
        if layout == "eagle2_reduced_vocab":
            drafter = ReducedVocabDrafts(drafter, torch.tensor([9, 3, 7, 1, 0, 5, 11, 2]))
        tree = tree_class(CostCurve.flat(), depth=2, top_k=2, children=3, max_nodes=12, min_score=0.0)
        return SpeculativeDecoder(target, proposers, tree, RejectionSamplingVerifier(), KVCompactCommit(),
                                  drafters=[drafter])

    def sample_pairs(speculative, samples):
        counts = torch.zeros_like(exact)
        drafted = sampled_nodes = 0
        for i in range(samples):
            run = SamplingConfig(sampling.temperature, seed=SEED * 100000 + i)
            tokens = []
            for step in speculative.decode(prompt, StopCondition(3), run):
                tokens += step.tokens
                drafted += step.drafted
                sampled_nodes += step.stats.drafted_by_source.get("draft_model", 0)
            counts[tokens[1] * 12 + tokens[2]] += 1
        return counts / samples, drafted, sampled_nodes

    samples = 1500
    got, drafted, sampled_nodes = sample_pairs(decoder(), samples)
    assert sampled_nodes > samples // 4, "sampled drafts must be accepted for the test to mean anything"
    bound = tv_bound(exact, samples)
    assert tv(got, exact) < bound
    if layout == "eagle2":
        broken, _, _ = sample_pairs(decoder(TopTokensClaimedSampled), samples)
        assert tv(broken, exact) > bound


def test_sampled_trees_keep_sampled_nodes_whole_and_first():
    """A sampled proposal is never merged or cut; deterministic nodes follow it as one-hot drafts."""
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.0, 0.6, 0.4, 0.0]])
    sampled = Proposal(torch.tensor([0, 1]), torch.tensor([-1, -1]), torch.tensor([0.5, 0.01]), "model",
                       draft_probs=probs)
    deterministic = Proposal(torch.tensor([0, 3]), torch.tensor([-1, 0]), torch.tensor([0.9, 0.8]), "ngram")
    tree = TrieTreeBuilder(CostCurve.flat(), max_nodes=3).build(DecodeState(tokens=[0], prompt_length=1),
                                                                [deterministic, sampled])
    assert tree.tokens.tolist() == [0, 1, 0]  # both sampled nodes (one unlikely), then the best deterministic
    assert tree.parents.tolist() == [-1, -1, -1]  # token 0 twice under the root: never merged
    torch.testing.assert_close(tree.draft_probs[:2], probs)
    assert tree.draft_probs[2].tolist() == [1.0, 0.0, 0.0, 0.0]
