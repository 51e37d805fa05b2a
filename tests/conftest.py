"""Shared fixtures: models loaded once per session, pipelines built around them, and two
independent greedy references (HF `generate` and a plain full-recompute argmax loop).

Every model fixture holds two instances with identical weights: `loaded` is what the
pipelines run (TargetModel switches its attention to specpipe's tree attention), and
`reference` is a separate instance left on stock attention, so the oracles never share
code paths or state with the engine under test.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel module is imported
# Before torch loads OpenMP: spinning worker threads make every op ~100x slower whenever another
# process competes for this 2-core machine; sleeping ones cost next to nothing here.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import pytest
import torch

torch.set_num_threads(2)

from specpipe.models import LoadedModel  # noqa: E402
from specpipe.paths import CONFIG_DIR, PACKAGE_ROOT  # noqa: E402
from specpipe.pipelines.builder import build_pipeline, compose_config, load_model  # noqa: E402
from specpipe.pipelines.pipeline import Pipeline  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = CONFIG_DIR


def config_options(group: str) -> list[str]:
    """Option names of a config group, from the files in conf/GROUP/."""
    return sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))


def config_groups() -> list[str]:
    return sorted(path.name for path in CONF_DIR.iterdir() if path.is_dir() and any(path.glob("*.yaml")))


PIPELINES = config_options("pipeline")
# Pipelines that draft from the prompt and the output so far, so the random token-id prompts of the
# tests give them drafts to verify. `rest` drafts only from its datastore (a chat corpus that knows
# none of these prompts): it is in every losslessness test, and its drafting is tested with corpora
# that hold the text (tests/test_token_datastore.py, test_rest_drafts_a_stored_answer).
CORPUS_PIPELINES = ["rest"]
DRAFTING_PIPELINES = [name for name in PIPELINES if name != "vanilla" and name not in CORPUS_PIPELINES]
# Pipelines whose store of past outputs learns every answer by default (frozen where tests compare runs).
PAST_OUTPUT_PIPELINES = ("rag_lookahead", "chat_lookahead")
# Pipelines with a draft model: their default draft is the one distilled for the embedded model, so
# on the tiny models they run a tiny draft of the same vocabulary (`draft_overrides`).
DRAFT_MODEL_PIPELINES = ["draft_model", "specinfer_mix"]
# Pipelines with an EAGLE head: on the tiny models (and on the embedded one until its trained head
# ships) they run the identity head of `eagle_head_dir`.
EAGLE_PIPELINES = ["eagle", "eagle_mix"]
# Pipelines with Medusa heads: on the tiny models (and on the embedded one until its trained heads
# ship) they run the identity heads of `medusa_head_dir`.
MEDUSA_PIPELINES = ["medusa", "hydra"]
# Pipelines with an EAGLE-3 head: on the tiny models (and on the embedded one until its trained head
# ships) the identity head of `eagle3_head_dir`.
EAGLE3_PIPELINES = ["eagle3"]
HEAD_PIPELINES = EAGLE_PIPELINES + MEDUSA_PIPELINES + EAGLE3_PIPELINES
_TINY_DRAFT_DIRS: dict[str, Path] = {}
_EAGLE_HEAD_DIRS: dict[tuple, Path] = {}


def tiny_draft_dir(dtype: str = "fp32") -> Path:
    """A 1-layer random Llama with the tiny model's vocabulary and tokenizer, saved once per session
    as a local Hugging Face directory (what `drafter.path=DIR` loads)."""
    if dtype not in _TINY_DRAFT_DIRS:
        loaded = load_model(compose_config(["model=tiny_random", "model.num_hidden_layers=1", "model.seed=1",
                                            f"model.dtype={dtype}"]).model)
        _TINY_DRAFT_DIRS[dtype] = save_model_dir(loaded.model, loaded.tokenizer, f"tiny-draft-{dtype}")
    return _TINY_DRAFT_DIRS[dtype]


def scratch_dir(prefix: str) -> Path:
    """A fresh temporary folder for a model or head the session caches, removed when the session ends."""
    import atexit
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def save_model_dir(model, tokenizer, name: str) -> Path:
    """`model` and `tokenizer` saved as a local Hugging Face directory in a fresh temporary folder."""
    folder = scratch_dir(f"specpipe-{name}-")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def eagle_head_dir(config, kind: str = "identity", seed: int = 0, layers: int = 1) -> Path:
    """An EAGLE-1 head of `layers` decoder layers for a model of `config`, saved once per session in the
    released layout.

    kind "identity": fc passes the feature through and the layer's output projections are zero, so
    the head predicts the feature it reads: it drafts the root token again at every depth (the
    stock tiny model's greedy output repeats its last token, so there every draft is accepted).
    kind "random": a seeded random head (drafts that disagree; tree masks matter)."""
    from transformers import LlamaConfig

    from specpipe.stages.draft.eagle_checkpoint import save_eagle
    from specpipe.stages.draft.eagle_net import EagleNet

    key = (config.hidden_size, config.vocab_size, config.num_attention_heads, kind, seed, layers)
    if key not in _EAGLE_HEAD_DIRS:
        fields = {k: v for k, v in config.to_dict().items() if k not in ("architectures", "model_type")}
        torch.manual_seed(seed)
        net = EagleNet(LlamaConfig(**{**fields, "num_hidden_layers": layers}))
        if kind == "identity":
            with torch.no_grad():
                hidden = config.hidden_size
                net.fc.weight.zero_()
                net.fc.weight[:, hidden:] = torch.eye(hidden)  # [embedding | feature] -> feature
                net.fc.bias.zero_()
                net.layers[0].self_attn.o_proj.weight.zero_()
                net.layers[0].mlp.down_proj.weight.zero_()
        folder = scratch_dir(f"specpipe-eagle-{kind}-")
        save_eagle(net, folder, dtype=torch.float32)
        _EAGLE_HEAD_DIRS[key] = folder
    return _EAGLE_HEAD_DIRS[key]


def medusa_head_dir(config, kind: str = "identity", heads: int = 3, seed: int = 0, hydra: bool = False) -> Path:
    """Medusa (or Hydra) heads for a model of `config` sharing its output layer, saved once per
    session in the released layout. kind "identity": every head returns the hidden state it reads
    (zero blocks; Hydra's input projections ignore the tokens) and drafts the root token again
    (accepted on the stock tiny model, which repeats its last token); kind "random": seeded random
    weights."""
    from specpipe.stages.draft.medusa import HydraHeads, MedusaHeads, save_medusa

    key = ("hydra" if hydra else "medusa", config.hidden_size, kind, heads, seed)
    if key not in _EAGLE_HEAD_DIRS:
        torch.manual_seed(seed)
        module = (HydraHeads if hydra else MedusaHeads)(config.hidden_size, heads, layers=1)
        if kind == "identity":
            module.start_as_medusa()
        folder = scratch_dir(f"specpipe-medusa-{kind}-")
        save_medusa(module, folder, dtype=torch.float32)
        _EAGLE_HEAD_DIRS[key] = folder
    return _EAGLE_HEAD_DIRS[key]


def eagle3_head_dir(model, kind: str = "identity", seed: int = 0) -> Path:
    """An EAGLE-3 head for `model` (a transformers causal LM), saved once per session in the released
    layout, reading the hidden states entering layers 0 (the token embeddings), 1 and 1.

    kind "identity": fc passes the layer-0 block (the embedding of the row's own token) through, the
    midlayer adds nothing (zero output projections) and lm_head is the model's embedding matrix, so
    the head drafts the last committed token but one, then repeats its own draft: on the stock tiny
    model, whose greedy output repeats its last token, that is the root again and is accepted.
    kind "random": a seeded random head with a random 3/4 of the vocabulary as its draft vocabulary."""
    from transformers import LlamaConfig

    from specpipe.stages.draft.eagle3 import Eagle3Net, save_eagle3

    config = model.config
    weights = float(model.get_input_embeddings().weight.detach().double().sum())  # the tiny variants differ in weights
    key = ("eagle3", config.hidden_size, config.vocab_size, config.num_attention_heads, weights, kind, seed)
    if key not in _EAGLE_HEAD_DIRS:
        fields = {k: v for k, v in config.to_dict().items() if k not in ("architectures", "model_type")}
        torch.manual_seed(seed)
        vocab, hidden = config.vocab_size, config.hidden_size
        ids = torch.arange(vocab) if kind == "identity" else torch.randperm(vocab)[: 3 * vocab // 4].sort().values
        net = Eagle3Net(LlamaConfig(**{**fields, "num_hidden_layers": 1}), (0, 1, 1), len(ids))
        with torch.no_grad():
            net.d2t.copy_(ids - torch.arange(len(ids)))
            if kind == "identity":
                net.fc.weight.zero_()
                net.fc.weight[:, :hidden] = torch.eye(hidden)
                net.midlayer.self_attn.o_proj.weight.zero_()
                net.midlayer.mlp.down_proj.weight.zero_()
                net.lm_head.weight.copy_(model.get_input_embeddings().weight.detach().float())
                net.norm.weight.fill_(1.0)
        folder = scratch_dir(f"specpipe-eagle3-{kind}-")
        save_eagle3(net, folder, dtype=torch.float32)
        _EAGLE_HEAD_DIRS[key] = folder
    return _EAGLE_HEAD_DIRS[key]


def head_overrides(pipeline: str, model) -> list[str]:
    """Overrides giving an EAGLE, EAGLE-3 or Medusa pipeline identity heads for `model`."""
    config = model.config
    if pipeline in EAGLE3_PIPELINES:
        return [f"pipeline.drafters.eagle3.path={eagle3_head_dir(model)}", "pipeline.tree.min_score=0"]
    if pipeline in EAGLE_PIPELINES:
        return [f"pipeline.drafters.eagle.path={eagle_head_dir(config)}", "pipeline.drafters.eagle.vocab_top_k=0",
                "pipeline.tree.min_score=0"]
    if pipeline in MEDUSA_PIPELINES:
        return [f"pipeline.drafters.{pipeline}.path={medusa_head_dir(config, hydra=pipeline == 'hydra')}",
                f"pipeline.drafters.{pipeline}.vocab_top_k=0"]
    return []


def draft_overrides(pipeline: str, dtype: str = "fp32") -> list[str]:
    """Config overrides that give a draft-model pipeline the tiny draft, and an EAGLE pipeline a head
    for the tiny model (nothing for other pipelines)."""
    if pipeline in HEAD_PIPELINES:
        return head_overrides(pipeline, load_model(compose_config(["model=tiny_random"]).model).model)
    if pipeline not in DRAFT_MODEL_PIPELINES:
        return []
    return [f"pipeline.drafters.model.path={tiny_draft_dir(dtype)}", "pipeline.drafters.model.vocab_top_k=0"]


def shipped_heads(pipeline: str) -> Path:
    """Where the heads trained for the embedded model ship (data/eagle/..., data/medusa/...)."""
    from specpipe.stages.draft.eagle_checkpoint import DEFAULT_EAGLE_DIR
    from specpipe.stages.draft.eagle3 import DEFAULT_EAGLE3_DIR
    from specpipe.stages.draft.medusa import DEFAULT_HYDRA_DIR, DEFAULT_MEDUSA_DIR

    if pipeline in EAGLE3_PIPELINES:
        return PACKAGE_ROOT / DEFAULT_EAGLE3_DIR
    if pipeline == "hydra":
        return PACKAGE_ROOT / DEFAULT_HYDRA_DIR
    return PACKAGE_ROOT / (DEFAULT_EAGLE_DIR if pipeline in EAGLE_PIPELINES else DEFAULT_MEDUSA_DIR)


def seed_everything(seed: int = 0) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@pytest.fixture(autouse=True)
def _seeded():
    seed_everything(0)
    yield


@dataclass
class ModelUnderTest:
    """One model for the tests: the engine's instance, an identical reference instance, and helpers."""

    name: str
    overrides: tuple[str, ...]  # the `model=...` overrides it was composed with
    loaded: LoadedModel
    reference: torch.nn.Module
    _pipelines: dict = field(default_factory=dict)
    _greedy: dict = field(default_factory=dict)

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    def config(self, pipeline: str = "vanilla", *overrides: str, cost_curve: str = "flat"):
        # The store of past outputs makes a pipeline's later runs draft from its earlier answers, by
        # design; tests that compare the steps of repeated runs freeze it (test_rag.py tests it learning).
        frozen = ["pipeline.proposers.past.learn=false"] if pipeline in PAST_OUTPUT_PIPELINES else []
        drafts = [] if self.name == "embedded" or pipeline not in DRAFT_MODEL_PIPELINES \
            else [f"pipeline.drafters.model.path={self.self_draft()}", "pipeline.drafters.model.vocab_top_k=0",
                  "pipeline.tree.min_score=0"]  # a random tiny model's next-token probabilities are ~1e-5
        if pipeline in HEAD_PIPELINES and self.name != "embedded":
            drafts = head_overrides(pipeline, self.loaded.model)
        elif pipeline in HEAD_PIPELINES and not shipped_heads(pipeline).is_dir():  # never a test head in their place
            raise FileNotFoundError(f"{pipeline}: the heads shipped for the embedded model are missing: "
                                    f"{shipped_heads(pipeline)}")
        return compose_config([*self.overrides, f"pipeline={pipeline}", f"cost_curve={cost_curve}", *frozen,
                               *drafts, *overrides])

    def pipeline(self, name: str = "vanilla", *overrides: str, cost_curve: str = "flat", fresh: bool = False) -> Pipeline:
        """A pipeline by config name around the shared loaded model (cached unless `fresh`)."""
        key = (name, cost_curve, overrides)
        if fresh or key not in self._pipelines:
            pipe = build_pipeline(self.config(name, *overrides, cost_curve=cost_curve), loaded=self.loaded)
            if fresh:
                return pipe
            self._pipelines[key] = pipe
        return self._pipelines[key]

    def self_draft(self) -> Path:
        """This model saved once as a local model directory, to be its own draft in the generic
        tests: each tree's argmax path is accepted (multi-token steps on any prompt) and its other
        branches rejected. Drafts that disagree: test_draft_model.py."""
        if "self_draft" not in self._pipelines:
            self._pipelines["self_draft"] = save_model_dir(self.reference, self.tokenizer, f"{self.name}-self-draft")
        return self._pipelines["self_draft"]

    @property
    def eos_token_ids(self) -> list[int]:
        return sorted(self.pipeline("vanilla").eos_token_ids)

    def greedy_hf(self, prompt_ids: list[int], max_new_tokens: int, eos_token_ids=None) -> list[int]:
        """Plain greedy decoding with HF `generate(do_sample=False)` on the reference instance."""
        eos = list(self.eos_token_ids if eos_token_ids is None else eos_token_ids)
        key = (tuple(prompt_ids), max_new_tokens, tuple(eos))
        if key not in self._greedy:
            self._greedy[key] = hf_greedy(self.reference, prompt_ids, max_new_tokens, eos, self.tokenizer.pad_token_id)
        return list(self._greedy[key])

    def greedy_loop(self, prompt_ids: list[int], max_new_tokens: int, eos_token_ids=None) -> list[int]:
        """The simplest possible greedy reference: recompute the whole sequence, take the argmax."""
        eos = set(self.eos_token_ids if eos_token_ids is None else eos_token_ids)
        tokens = list(prompt_ids)
        with torch.inference_mode():
            for _ in range(max_new_tokens):
                logits = self.reference(input_ids=torch.tensor([tokens]), use_cache=False, logits_to_keep=1).logits[0, -1]
                tokens.append(int(logits.argmax()))
                if tokens[-1] in eos:
                    break
        return tokens[len(prompt_ids):]

    def causal_logits(self, tokens: list[int], engine: bool = False) -> torch.Tensor:
        """[len(tokens), vocab] fp32 logits of a plain causal forward (no cache) on the reference, or
        with `engine` on the instance the pipelines run (rewritten by their engine: same products,
        so a comparison with it isolates the attention mask and cache from the engine's rounding)."""
        model = self.loaded.model if engine else self.reference
        with torch.inference_mode():
            return model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_ids: list[int],
              pad_token_id: int | None) -> list[int]:
    """Plain greedy decoding of `model` with HF `generate(do_sample=False)`: the new tokens."""
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=0, do_sample=False, num_beams=1, eos_token_id=eos_token_ids,
                             pad_token_id=pad_token_id, temperature=None, top_p=None, top_k=None)
    return out[0, len(prompt_ids):].tolist()


def _rescale(model: torch.nn.Module, mix: float, sharpen: float) -> None:
    """Makes a random Llama's greedy output depend on its context.

    At init the residual stream is ~ the token's own (tied) embedding, so the stock tiny
    model just repeats the last token. Scaling the attention/MLP output projections lets
    the context dominate; scaling queries and keys sharpens attention.
    """
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                parameter.mul_(mix)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                parameter.mul_(sharpen)


def _make(name: str, overrides: tuple[str, ...], mix: float = 1.0, sharpen: float = 1.0) -> ModelUnderTest:
    cfg = compose_config(list(overrides))
    loaded = load_model(cfg.model)
    reference = load_model(cfg.model).model.eval()
    for model in (loaded.model, reference):
        if mix != 1.0 or sharpen != 1.0:
            _rescale(model, mix, sharpen)
    for (n1, p1), (n2, p2) in zip(loaded.model.state_dict().items(), reference.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), f"reference instance of {name} differs at {n1}"
    assert reference.config._attn_implementation in ("sdpa", "eager")
    return ModelUnderTest(name, overrides, loaded, reference)


@pytest.fixture(scope="session")
def tiny() -> ModelUnderTest:
    """The stock `model=tiny_random` (2-layer random Llama; its greedy output copies the last token)."""
    return _make("tiny", ("model=tiny_random",))


@pytest.fixture(scope="session")
def tiny_mixed() -> ModelUnderTest:
    """tiny_random with its residual branches scaled up: output depends on context, drafts are
    sometimes right and sometimes rejected."""
    return _make("tiny_mixed", ("model=tiny_random",), mix=100.0)


@pytest.fixture(scope="session")
def tiny_chaotic() -> ModelUnderTest:
    """tiny_random with sharp attention and strong residual branches: nearly random output,
    most drafts rejected (exercises the rejection paths)."""
    return _make("tiny_chaotic", ("model=tiny_random",), mix=20.0, sharpen=10.0)


@pytest.fixture(scope="session", params=["tiny", "tiny_mixed", "tiny_chaotic"])
def any_tiny(request) -> ModelUnderTest:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="session")
def embedded() -> ModelUnderTest:
    """The embedded SmolLM2-135M-Instruct in fp32 (converted once to the local cache)."""
    return _make("embedded", ("model=smollm2_135m", "model.dtype=fp32"))


def random_prompts(count: int, seed: int, low: int = 300, high: int = 1300) -> list[list[int]]:
    """Token-id prompts of several kinds, deterministic per seed.

    Kinds cycle: random ids; a random 5-token pattern repeated 10 times (long drafts);
    random prefix + repeated pattern; a repeated pattern with a few tokens changed;
    a single token; a random 3-token pattern repeated with a random tail.
    """
    generator = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(low, high, (n,), generator=generator).tolist()

    prompts = []
    for i in range(count):
        kind = i % 6
        if kind == 0:
            prompt = ids(int(torch.randint(5, 60, (1,), generator=generator)))
        elif kind == 1:
            prompt = ids(5) * 10
        elif kind == 2:
            prompt = ids(12) + ids(5) * 8
        elif kind == 3:
            prompt = ids(6) * 8
            for position in torch.randint(0, len(prompt), (4,), generator=generator).tolist():
                prompt[position] = ids(1)[0]
        elif kind == 4:
            prompt = ids(1)
        else:
            prompt = ids(3) * 6 + ids(7)
        prompts.append(prompt)
    return prompts


def is_repetitive(prompt: list[int]) -> bool:
    """A prompt made of one 5-token pattern repeated (kind 1 of random_prompts)."""
    return len(prompt) == 50 and prompt == prompt[:5] * 10


def run_steps(pipeline: Pipeline, prompt, max_new_tokens: int, **kwargs):
    """(tokens, steps) from Pipeline.steps: every step's committed tokens and stats."""
    steps = list(pipeline.steps(prompt, max_new_tokens, **kwargs))
    tokens = [token for step in steps for token in step.tokens]
    return tokens, steps


def near_tie_divergence(model: "ModelUnderTest", prompt_ids: list[int], tokens: list[int],
                        expected: list[int]) -> tuple[int, float] | None:
    """Where `tokens` first leave the reference greedy output `expected`, and the reference's top-2
    logit gap there; None when they agree. A faster engine may legitimately flip a near-tie (its float
    sums run in another order); anything else is a bug."""
    for i, (ours, theirs) in enumerate(zip(tokens, expected)):
        if ours != theirs:
            logits = model.causal_logits(prompt_ids + expected[:i])[-1]
            top = logits.topk(2)
            assert int(top.indices[0]) == theirs, "the reference's own token is not its argmax"
            assert ours in top.indices.tolist(), f"token {i}: {ours} is not even among the reference's top 2"
            return i, float(top.values[0] - top.values[1])
    assert len(tokens) == len(expected), f"same prefix but {len(tokens)} vs {len(expected)} tokens"
    return None


def run_cli(*args: str, timeout: float = 120.0, cwd=None) -> subprocess.CompletedProcess:
    """`python run.py ARGS...` in a subprocess (cwd: where Hydra writes its outputs/ folder)."""
    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    return subprocess.run([sys.executable, str(REPO / "run.py"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)
