"""EAGLE: a one-layer draft network on the target's own features (EAGLE-1, Li et al. 2024).

Notation: x_p is the token at position p and f_p the target's feature there (its last hidden
state, the input of its output layer, which chose x_{p+1}). The draft's row for position p reads
[embedding(x_{p+1}), f_p] through `fc` and its decoder layer(s), and predicts f_{p+1}; the target's
own (frozen) output layer turns that prediction into the draft's distribution of x_{p+2}.

Per request the draft keeps its own KV cache with one row per committed position. The target's
features arrive with the prompt's prefill (`DecodeState.prompt_hidden`) and with every verify
forward (`VerifyResult.hidden`: the root's and the accepted nodes' rows); they are fed in one
causal forward at the start of the next step. Tree nodes have no target feature yet: a node's
row reads the feature the draft predicted at its parent, attends to the committed rows, its
ancestors and itself, and is dropped when the next step cuts the cache back to the committed
rows.

Checkpoints: a directory with `config.json` (Llama fields of the draft layer) and
`model.safetensors` (or `pytorch_model.bin` / `.pt`, read with `torch.load(weights_only=True)`)
in the layout of the released EAGLE-1 heads: `fc.weight` [hidden, 2 * hidden] (and `fc.bias`),
`layers.N.*` Llama decoder layers whose first has no input norm; `embed_tokens.weight` and
`lm_head.weight`, where present, are the base model's and are not used (the target's own are).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor, nn
from transformers import LlamaConfig, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from specpipe.cost import CostCurve
from specpipe.engine.blocks import FusedQKVAttention
from specpipe.engine.lean_model import (BlockLayers, KernelDraftLevel, LeanLlamaModel, lean_decoder_layers,
                                         norm_function)
from specpipe.engine.quantize import checked_quantization
from specpipe.errors import ConfigError
from specpipe.kv_cache import PositionIndexedCache
from specpipe.paths import REPO_ROOT
from specpipe.stages.base import StageResources, StepDrafter, draft_token_ids
from specpipe.stages.draft.draft_model import (ReducedVocabHead, causal_rows, head_logprobs, output_weight, reduced_ids,
                                               root_and_tree_rows, tree_rows, unfed_ancestors_first)
from specpipe.stages.draft.draft_vocab import TokenRanking, pinned_vocab_path
from specpipe.stages.draft.head_checkpoint import (check_tokenizer, head_folder, load_fitting, read_checkpoint,
                                                   write_head_folder)
from specpipe.target import SDPA_ATTENTION, RaggedBatch, TargetModel
from specpipe.types import DecodeState, DraftTree, Proposal, VerifyResult

log = logging.getLogger(__name__)
ROOT = -1
DEFAULT_EAGLE_DIR = "data/eagle/smollm2_135m"  # the head trained for the embedded model (task=train_heads)
# Where a head trained on the target's features in another dtype ships beside it (DEFAULT_EAGLE_DIR +
# suffix): features, and so what the head learns, differ with the target's rounding.
DTYPE_HEAD_SUFFIX = {torch.bfloat16: "_bf16"}
# Keys of released EAGLE-1 checkpoints that belong to the base model, not the head.
BASE_MODEL_KEYS = ("embed_tokens.weight", "lm_head.weight")


class EagleNet(nn.Module):
    """fc over [token embedding, feature] then Llama decoder layers (the first without its input
    norm, as released EAGLE-1 heads have it); returns the predicted next features.

    Under engine=fast the engine hands it its RMSNorm and attention kernels (`norm_kernel`,
    `attention_kernel`, as to the target's lean forward) and inference runs the layers inline
    (specpipe.engine.lean_model.lean_decoder_layers), without the module calls between the ops, paid
    at every draft level, of which a step runs several. Where the kernel's build multiplies
    weights in column blocks it also hands `layer_kernel`, and a bf16 head's layers run one kernel call
    each (specpipe.engine.lean_model.BlockLayers)."""

    accepts_lean_kernels = True  # specpipe.engine.lean_model.swap_lean_model sets the six below
    norm_kernel = None
    attention_kernel = None
    ragged_attention_kernel = None  # its attention over several requests' rows (a batch's draft level)
    attention_max_rows = LeanLlamaModel.attention_max_rows
    # the kernel's whole decoder layer over column blocks (bf16 on AVX512_BF16 CPUs), run through BlockLayers
    layer_kernel = None
    rotary_lookup = None  # RotaryTables over rotary_emb (specpipe.engine.rotary)
    # the kernel's whole draft level (fc, the layers, the output layer's log-probs), which EagleDrafter runs through
    # specpipe.engine.lean_model.KernelDraftLevel where every part is served
    level_kernel = None

    def __init__(self, config: LlamaConfig, fc_bias: bool = True) -> None:
        super().__init__()
        config._attn_implementation = SDPA_ATTENTION  # tree masks go through SDPA, kept off cuDNN's per-shape plans
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, layer_idx=index)
                                    for index in range(config.num_hidden_layers))
        self.layers[0].input_layernorm = nn.Identity()
        self.rotary_emb = LlamaRotaryEmbedding(config)

    def rows(self, embeds: Tensor, features: Tensor, position_ids: Tensor, mask: Tensor | None, cache=None,
             ragged_batch: RaggedBatch | None = None) -> Tensor:
        """Batched rows (training, its rollouts): embeds, features [b, q, hidden]; position_ids [b, q];
        mask [b, 1, q, kv] bool over the cached rows then these, or None for causal rows without a
        cache. Appends q rows to `cache`; returns the predicted features [b, q, hidden]. With `ragged_batch`
        (b = 1, no mask, no cache) the rows are several requests', each attending its own cache."""
        hidden = self.fc(torch.cat([embeds, features], dim=-1))  # [b, q, hidden]
        rotary = (self.rotary_lookup or self.rotary_emb)(hidden, position_ids)
        if self.lean:
            block_layers = self._block_layers()
            if ragged_batch is None and block_layers is not None and block_layers.serves(hidden, mask, cache):
                return block_layers(hidden, mask, rotary, cache)
            normalize = norm_function(self.norm_kernel, self.layers[0].post_attention_layernorm.weight, hidden)
            return lean_decoder_layers(self, self.layers, hidden, normalize, mask, position_ids, cache,
                                       cache is not None, rotary, ragged_batch=ragged_batch)
        extra = {"ragged_batch": ragged_batch} if ragged_batch is not None else {}
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_ids=position_ids,
                           past_key_values=cache, use_cache=cache is not None, position_embeddings=rotary, **extra)
        return hidden

    def _block_layers(self) -> BlockLayers | None:
        """The layers as BlockLayers where the engine gave the layer kernel and it serves them (made once: the
        engine packs the weights once)."""
        made = self.__dict__.get("_made_block_layers")
        if made is None or made[0] is not self.layer_kernel:
            made = (self.layer_kernel, BlockLayers.of(self.layer_kernel, self.layers))
            self.__dict__["_made_block_layers"] = made
        return made[1]

    @property
    def lean(self) -> bool:
        """Whether inference runs the layers inline: the engine made every attention block lean (and so
        checked that each computes LlamaAttention's forward) and every layer is transformers' own."""
        return (not self.training and all(type(layer).forward is LlamaDecoderLayer.forward
                                          and type(layer.self_attn) is FusedQKVAttention for layer in self.layers))

    def forward(self, embeds: Tensor, features: Tensor, positions: Tensor, mask: Tensor | None,
                cache: PositionIndexedCache | None) -> Tensor:
        """One request's rows: embeds, features [q, hidden]; positions [q]; mask [q, kv] bool (True =
        attend) over the cached rows then these, or None for plain causal attention without a cache.
        Appends q rows to `cache`; returns the predicted features [q, hidden]."""
        attention_mask = mask[None, None] if mask is not None else None  # [1, 1, q, kv]
        return self.rows(embeds[None], features[None], positions[None], attention_mask, cache)[0]


@dataclass
class EagleSession:
    """One request's draft cache: rows for positions 0..synced-1 (committed), then this step's
    tree nodes. `pending_*` are committed rows whose target features came in but were not fed."""

    cache: PositionIndexedCache
    synced: int = 0
    unfed: int = 0  # committed positions that never got a cache row (`context_rows`); the rest have one each
    rows: int = 0  # committed rows accounted for: synced + pending
    pending_features: list[Tensor] = field(default_factory=list)  # [k, hidden] each
    pending_tokens: list[int] = field(default_factory=list)
    root_feature: Tensor | None = None  # [hidden] the draft's predicted feature at the root
    root_logprobs: Tensor | None = None  # [vocab]
    slots: dict[int, int] = field(default_factory=dict)  # tree node id -> cache row, this step
    features: dict[int, Tensor] = field(default_factory=dict)  # node -> predicted feature at it [hidden]
    logprobs: dict[int, Tensor] = field(default_factory=dict)  # node -> [vocab] after it


class _Rows(NamedTuple):
    """One request's rows of a draft level, as `EagleDrafter._level` takes them."""

    features: Tensor  # [q, hidden]
    tokens: Tensor  # [q] int64
    positions: Tensor  # [q] int64
    mask: Tensor  # [q, kv] bool over the cache's rows then these
    cache: PositionIndexedCache
    logprob_rows: int  # log-probs of the last rows wanted


class EagleDrafter(StepDrafter):
    """EAGLE-1 as a StepDrafter (`pipeline.drafters`, grown by `tree=eagle2`), or one greedy chain
    per step as a Proposer (`pipeline.proposers`, `tree=trie`)."""

    def __init__(self, target: TargetModel, net: nn.Module, head: nn.Module, name: str = "eagle",
                 chain_length: int = 5, min_score: float = 0.05, aux_hidden: bool = False,
                 context_rows: int | None = None, weight_quantization: str | None = None) -> None:
        if chain_length < 1:
            raise ConfigError(f"{name}: chain_length must be >= 1, got {chain_length}")
        if context_rows is not None and context_rows < 1:
            raise ConfigError(f"{name}: context_rows must be >= 1 (or null: feed every committed row), got {context_rows}")
        self.name = name
        self.target = target
        self.net = net.to(device=target.device, dtype=target.dtype).eval()
        self.embed = target.model.get_input_embeddings()  # the target's own, frozen
        self.head = head  # the target's output layer, or a ReducedVocabHead over its weights
        # The pipeline builder runs the draft's own output layer under the target's engine (the
        # target's output layer already is).
        self.engine_modules = (head,) if isinstance(head, ReducedVocabHead) else ()
        # A head over a reduced vocabulary hands out log-probs over its own tokens only (StepDrafter's
        # `draft_vocab`): a top-k over 8192 columns instead of all 49152 saves ~0.5 ms per draft level.
        self.draft_vocab: Tensor | None = head.target_ids if hasattr(head, "reduced_logits") else None  # [k]
        self.chain_length = chain_length
        self.min_score = min_score
        # Committed rows read the target's last hidden states (EAGLE-1), or with `aux_hidden` the
        # layers the target runner captures for the head (EAGLE-3, specpipe.stages.draft.eagle3).
        self.aux_hidden = aux_hidden
        # At most this many committed rows are fed at once: a long prompt's last ones, or the last ones of
        # the steps a drafter gate skipped. The older ones never get a row and the head never attends to them.
        self.context_rows = context_rows
        # "int8", or "auto" where the engine's CPU kernel serves: the pipeline builder has the engine run the
        # head's products over int8 weights (specpipe.engine.quantize), half the bytes a draft level reads
        self.weight_quantization = checked_quantization(weight_quantization, name)
        self.runner = EagleRunner(self)  # what the pipeline builder measures a cost curve on
        self.cost_curve: CostCurve | None = None

    def resources(self) -> StageResources:
        return StageResources(draft_model=self.runner.model, engine_modules=self.engine_modules,
                              weight_quantization=self.weight_quantization, cost_runner=self.runner)

    # ---- Proposer ---------------------------------------------------------------------------
    def reset(self, state: DecodeState) -> None:
        features = state.prompt_aux_hidden if self.aux_hidden else state.prompt_hidden
        if features is None:
            field_name = "prompt_aux_hidden" if self.aux_hidden else "prompt_hidden"
            raise ConfigError(f"{self.name}: the decoder gave no prompt features (DecodeState.{field_name}); "
                              f"an EAGLE head drafts from the target's own hidden states")
        session = EagleSession(PositionIndexedCache())
        session.rows = min(state.prompt_length, len(state.tokens) - 1)  # the root has no feature yet
        session.pending_features.append(features[:session.rows])  # rows 0..rows-1
        session.pending_tokens.extend(state.tokens[1:session.rows + 1])
        state.stage_state[self] = session

    def propose(self, state: DecodeState) -> Proposal:
        logprobs = self.start(state)
        tokens: list[int] = []
        scores: list[float] = []
        cumulative = 1.0
        for depth in range(self.chain_length):
            column = logprobs.argmax()
            cumulative *= math.exp(float(logprobs[column]))
            if cumulative < self.min_score:
                break
            tokens.append(int(draft_token_ids(column, self.draft_vocab)))
            scores.append(cumulative)
            if depth + 1 < self.chain_length:
                logprobs = self.step(state, tokens, list(range(-1, depth)), [depth])[0]
        return Proposal.chain(tokens, scores, self.name)

    def on_commit(self, state: DecodeState, result: VerifyResult) -> None:
        session: EagleSession = state.stage_state[self]
        hidden = result.aux_hidden if self.aux_hidden else result.hidden
        if hidden is None:
            raise ConfigError(f"{self.name}: the verify step gave no hidden states; an EAGLE head needs them")
        new = len(state.tokens) - 1 - session.rows  # committed rows this step: the root, then each kept node
        kept = [0] + [node + 1 for node in result.accepted[: new - 1]]  # rows of the verify forward
        session.pending_features.append(hidden[kept])  # [new, hidden] ([new, 3 * hidden] with aux_hidden)
        session.pending_tokens.extend(state.tokens[-new:])
        session.rows += new

    def on_finish(self, state: DecodeState) -> None:
        state.stage_state.pop(self, None)

    # ---- StepDrafter ------------------------------------------------------------------------
    def start(self, state: DecodeState) -> Tensor:
        """Feeds the committed rows not fed yet; returns the draft's log-probs [vocab] after the root
        ([k] over `draft_vocab` where the head scores a reduced vocabulary, as `step`'s rows)."""
        return self.start_many([state])[0]

    def start_many(self, states: list[DecodeState]) -> list[Tensor]:
        """`start` for the sequences of a batch: their committed rows fed in one forward of the head."""
        sessions: list[EagleSession] = [state.stage_state[self] for state in states]
        feeds, fed = [], []
        for session in sessions:
            committed_rows = session.synced - session.unfed
            session.cache.crop(committed_rows)  # this step's tree rows go
            if session.pending_tokens:
                q = len(session.pending_tokens)
                unfed = q - min(q, self.context_rows or q)  # the oldest pending rows, beyond `context_rows`
                features = torch.cat(session.pending_features)[unfed:].to(self.target.dtype)  # [q - unfed, hidden]
                tokens = torch.tensor(session.pending_tokens[unfed:], dtype=torch.long)  # [q - unfed]
                feeds.append(_Rows(features, tokens, torch.arange(session.synced + unfed, session.synced + q),
                                   causal_rows(committed_rows, q - unfed), session.cache, 1))
                fed.append((session, q, unfed))
            session.slots, session.features, session.logprobs = {}, {}, {}
        for (session, q, unfed), (predicted, logprobs) in zip(fed, self._levels(feeds)):
            session.root_feature = predicted[-1]
            session.root_logprobs = logprobs[0]
            session.synced += q
            session.unfed += unfed
            session.pending_features, session.pending_tokens = [], []
        return [session.root_logprobs for session in sessions]

    def step(self, state: DecodeState, tokens: list[int], parents: list[int], frontier: list[int]) -> Tensor:
        """The draft's log-probs [m, vocab] after each frontier node (ROOT = the root). Nodes are fed
        once, when first expanded, with their unfed ancestors first."""
        session: EagleSession = state.stage_state[self]
        unfed = unfed_ancestors_first(frontier, parents, session.slots)
        while unfed:  # a node's input is its parent's predicted feature: feed level by level
            ready = [node for node in unfed if parents[node] == ROOT or parents[node] in session.features]
            fed = self._feed([(session, tokens, parents, ready)])[0]
            if ready == frontier:  # the usual level: the frontier is the nodes just fed, in their order
                return fed
            unfed = [node for node in unfed if node not in session.features]
        return torch.stack([session.root_logprobs if node == ROOT else session.logprobs[node]
                            for node in frontier])  # [m, vocab]

    def step_many(self, calls: list[tuple[DecodeState, list[int], list[int], list[int]]]) -> list[Tensor]:
        """`step` for the sequences of a batch: where each call's frontier is the nodes to feed next (the usual
        level), one forward of the head for all of them; any other call alone."""
        results: list[Tensor | None] = [None] * len(calls)
        together = []
        for index, (state, tokens, parents, frontier) in enumerate(calls):
            session: EagleSession = state.stage_state[self]
            unfed = unfed_ancestors_first(frontier, parents, session.slots)
            if unfed and unfed == frontier and all(parents[node] == ROOT or parents[node] in session.features
                                                   for node in frontier):
                together.append((index, (session, tokens, parents, frontier)))
            else:
                results[index] = self.step(state, tokens, parents, frontier)
        for (index, _), logprobs in zip(together, self._feed([call for _, call in together])):
            results[index] = logprobs
        return results

    def _feed(self, calls: list[tuple[EagleSession, list[int], list[int], list[int]]]) -> list[Tensor]:
        """Feeds each call's `nodes` (their parents fed) as one level of the head, all calls in one forward;
        returns their log-probs [len(nodes), vocab] per call."""
        feeds = []
        for session, tokens, parents, nodes in calls:
            cached = session.cache.get_seq_length()
            for row, node in enumerate(nodes):
                session.slots[node] = cached + row
            mask, positions = tree_rows(nodes, parents, session.slots, session.synced - session.unfed, cached,
                                        session.unfed)  # [q, kv], [q]
            features = torch.stack([session.root_feature if parents[node] == ROOT else session.features[parents[node]]
                                    for node in nodes])  # [q, hidden]
            ids = torch.tensor([tokens[node] for node in nodes], dtype=torch.long)  # [q]
            feeds.append(_Rows(features, ids, positions, mask, session.cache, len(nodes)))
        out = []
        for (session, _, _, nodes), (predicted, logprobs) in zip(calls, self._levels(feeds)):
            for row, node in enumerate(nodes):  # [q, hidden], [q, vocab]
                session.features[node] = predicted[row]
                session.logprobs[node] = logprobs[row]
            out.append(logprobs)
        return out

    @torch.inference_mode()
    def _levels(self, feeds: list["_Rows"]) -> list[tuple[Tensor, Tensor]]:
        """One draft level of each feed's rows (one request's, over its own cache): (predicted features [q, hidden],
        log-probs [logprob_rows, vocab] of its last rows) each. A lone feed runs as `_level`; several, in one
        forward of the head whose rows attend each its own cache (specpipe.target.RaggedBatch)."""
        if len(feeds) <= 1:
            return [self._level(*feed) for feed in feeds]
        device = self.target.device
        ragged = RaggedBatch([feed.cache for feed in feeds], [len(feed.tokens) for feed in feeds],
                             [feed.mask for feed in feeds])
        embeds = self.embed(torch.cat([feed.tokens for feed in feeds]).to(device))  # [R, hidden]
        features = torch.cat([feed.features for feed in feeds]).to(device)  # [R, hidden]
        positions = torch.cat([feed.positions for feed in feeds]).to(device)  # [R]
        predicted = self.net.rows(embeds[None], features[None], positions[None], None, None,
                                  ragged_batch=ragged)[0]  # [R, hidden]
        last = torch.cat([torch.arange(end - feed.logprob_rows, end)
                          for feed, end in zip(feeds, ragged.starts[1:])])  # each feed's last rows
        logprobs = self._logprobs(predicted[last.to(device)])
        out, row = [], 0
        for feed, start, end in zip(feeds, ragged.starts, ragged.starts[1:]):
            out.append((predicted[start:end], logprobs[row:row + feed.logprob_rows]))
            row += feed.logprob_rows
        return out

    @torch.inference_mode()
    def _level(self, features: Tensor, tokens: Tensor, positions: Tensor, mask: Tensor, cache: PositionIndexedCache,
               logprob_rows: int) -> tuple[Tensor, Tensor]:
        """One draft forward of q rows (features [q, hidden], tokens [q], positions [q], mask [q, kv] as `_forward`
        takes them) -> (predicted features [q, hidden], log-probs [logprob_rows, vocab] of the last rows): in one
        kernel call where the engine gave the head's level one (KernelDraftLevel), else op by op."""
        level = self._kernel_level()
        if level is not None and level.serves(tokens.shape[0], logprob_rows, cache) and features.dtype == torch.bfloat16:
            done = level(tokens, features, positions, mask, cache, logprob_rows)
            if done is not None:
                return done
        predicted = self._forward(features, tokens, positions, mask, cache)
        return predicted, self._logprobs(predicted[-logprob_rows:])

    def _kernel_level(self) -> KernelDraftLevel | None:
        """The head's level in one kernel call where the engine serves it (made once per kernel the engine gave)."""
        net = self.net
        kernel = getattr(net, "level_kernel", None)
        made = self.__dict__.get("_made_kernel_level")
        if made is None or made[0] is not kernel:
            level = None
            if kernel is not None and type(net) is EagleNet and net.lean and self.target.device.type == "cpu":
                reduced = self.draft_vocab is not None
                level = KernelDraftLevel.of(kernel, net.layers, net.fc,
                                            getattr(self.head, "linear", None) if reduced else self.head, self.embed,
                                            net.rotary_lookup)
            made = (kernel, level)
            self.__dict__["_made_kernel_level"] = made
        return made[1]

    @torch.inference_mode()
    def _forward(self, features: Tensor, tokens: Tensor, positions: Tensor, mask: Tensor,
                 cache: PositionIndexedCache) -> Tensor:
        device = self.target.device
        return self.net(self.embed(tokens.to(device)), features.to(device), positions.to(device), mask.to(device),
                        cache)

    @torch.inference_mode()
    def _logprobs(self, features: Tensor) -> Tensor:
        """features [q, hidden] -> log-probs [q, vocab], or [q, k] over `draft_vocab`."""
        return head_logprobs(self.head, features, reduced=self.draft_vocab is not None)


class EagleRunner:
    """The draft forward as the cost-curve measurement sees a model (`new_cache`, `prefill`,
    `forward_tree`): rows of the head plus its output layer, with zero features."""

    def __init__(self, drafter: EagleDrafter) -> None:
        self.drafter = drafter
        target = drafter.target
        layers = drafter.net.config.num_hidden_layers
        width = getattr(drafter.head, "width", target.vocab_size)  # the draft vocabulary the head scores
        kind = "eagle3" if drafter.aux_hidden else drafter.name
        self.name = f"{target.name}-{kind}-{layers}L{width}V"
        self.model = drafter.net
        self.engine = getattr(drafter.net, "specpipe_engine", "hf")
        self.attn_implementation = "sdpa"
        self.vocab_size = target.vocab_size
        self.dtype = target.dtype
        self.device = target.device

    def new_cache(self) -> PositionIndexedCache:
        return PositionIndexedCache()

    def prefill(self, prompt: list[int], cache: PositionIndexedCache) -> None:
        q = len(prompt)
        features = torch.zeros(q, self.drafter.net.config.hidden_size, dtype=self.dtype)
        self.drafter._level(features, torch.tensor(prompt), torch.arange(q), torch.ones(q, q, dtype=torch.bool).tril(),
                            cache, logprob_rows=1)

    def forward_tree(self, root_token: int, tree: DraftTree, cache: PositionIndexedCache) -> Tensor:
        tokens, positions, mask = root_and_tree_rows(root_token, tree, cache.get_seq_length())
        q = int(tokens.shape[0])
        features = torch.zeros(q, self.drafter.net.config.hidden_size, dtype=self.dtype)
        return self.drafter._level(features, tokens, positions, mask, cache, logprob_rows=q)[1]


# ---- checkpoints --------------------------------------------------------------------------------
def build_eagle_net(config: dict, tensors: dict[str, Tensor], hidden: int, vocab_size: int, name: str) -> EagleNet:
    """An EagleNet from an EAGLE-1 checkpoint, checked against the target's hidden size and vocabulary."""
    keys = set(tensors)
    if any(key.startswith("midlayer.") for key in keys) or "d2t" in keys:
        raise ConfigError(f"{name}: this is an EAGLE-3 checkpoint (midlayer.*, d2t); drafter=eagle reads the "
                          f"EAGLE-1 layout (fc.weight, layers.N.*): load it with pipeline=eagle3")
    if any("medusa" in key or key.split(".")[0].isdigit() for key in keys):
        raise ConfigError(f"{name}: this looks like a Medusa checkpoint; drafter=eagle reads the EAGLE-1 layout "
                          f"(fc.weight, layers.N.*): load it with pipeline=medusa")
    if "fc.weight" not in keys:
        raise ConfigError(f"{name}: no fc.weight in the checkpoint: not an EAGLE head (keys: "
                          f"{', '.join(sorted(keys)[:6])}...)")
    if tuple(tensors["fc.weight"].shape) != (hidden, 2 * hidden):
        raise ConfigError(f"{name}: the head's fc.weight is {tuple(tensors['fc.weight'].shape)}, the target's hidden "
                          f"size {hidden} needs ({hidden}, {2 * hidden}): this head is for another model")
    if int(config.get("hidden_size", hidden)) != hidden:
        raise ConfigError(f"{name}: the head's hidden_size is {config['hidden_size']}, the target's {hidden}")
    vocab = config.get("vocab_size")
    if vocab is not None and int(vocab) != vocab_size:
        raise ConfigError(f"{name}: the head was trained for a vocabulary of {vocab} tokens, the target has "
                          f"{vocab_size}: it is for another model")
    layer_ids = {int(key.split(".")[1]) for key in keys if key.startswith("layers.")}
    declared = int(config.get("num_hidden_layers", len(layer_ids)))
    if layer_ids != set(range(declared)):
        raise ConfigError(f"{name}: config.json declares {declared} layer(s), the weights hold layers "
                          f"{sorted(layer_ids)}")
    fields = {key: value for key, value in config.items() if key not in ("architectures", "model_type", "specpipe")}
    llama_config = LlamaConfig(**{**fields, "num_hidden_layers": declared, "vocab_size": vocab_size})
    net = EagleNet(llama_config, fc_bias="fc.bias" in keys)
    state = {key: value for key, value in tensors.items() if key not in BASE_MODEL_KEYS}
    load_fitting(net, state, name, f"an EAGLE-1 head of {declared} layer(s)")
    return net


def read_eagle_net(folder: Path, tokenizer: PreTrainedTokenizerBase, hidden: int, vocab_size: int,
                   name: str) -> EagleNet:
    """The EAGLE-1 head in directory `folder`, checked against the tokenizer it was trained for and the
    target's hidden size and vocabulary."""
    config, tensors = read_checkpoint(folder, name, "EAGLE head", layout="eagle")
    check_tokenizer(config, tokenizer, folder, name)
    return build_eagle_net(config, tensors, hidden, vocab_size, name)


def save_eagle(net: EagleNet, folder: Path, extra: dict | None = None, dtype: torch.dtype = torch.bfloat16,
               ranking: TokenRanking | None = None) -> None:
    """Writes the head in the released EAGLE-1 layout (config.json + model.safetensors), with the
    ranking of draft tokens it was trained over (`draft_vocab.npz`) where given."""
    config = net.config.to_dict()
    for key in ("_attn_implementation_autoset", "transformers_version", "torch_dtype", "dtype"):
        config.pop(key, None)
    config.update(architectures=["LlamaForCausalLM"], model_type="llama", bias=net.fc.bias is not None,
                  specpipe=extra or {})
    write_head_folder(folder, config, {key: value.detach().to(dtype) for key, value in net.state_dict().items()},
                      ranking)


def frequent_ids(tokenizer: PreTrainedTokenizerBase, vocab_size: int, vocab_top_k: int, vocab_counts: str | None,
                 name: str, pinned: Path | None = None) -> Tensor | None:
    """The `vocab_top_k` most frequent token ids (`reduced_ids`: counted in `vocab_counts`; None = the
    ranking `pinned` beside the head where it exists, else the shipped chat corpus where it is this
    tokenizer's, else None with a warning: the full vocabulary); None for 0."""
    if not vocab_top_k:
        return None
    found = reduced_ids(tokenizer, vocab_size, vocab_top_k, vocab_counts, pinned, name)
    if found is None:
        return None
    ids, coverage, source = found
    log.info("%s: drafting over the %d most frequent tokens of %s (%.1f%% of its tokens)", name, vocab_top_k,
             source, 100 * coverage)
    return ids


def output_head(target: TargetModel, tokenizer: PreTrainedTokenizerBase, vocab_top_k: int, vocab_counts: str | None,
                name: str, pinned: Path | None = None) -> nn.Module:
    """The target's output layer, or with `vocab_top_k` > 0 a ReducedVocabHead over its most frequent tokens."""
    model: PreTrainedModel = target.model
    ids = frequent_ids(tokenizer, target.vocab_size, vocab_top_k, vocab_counts, name, pinned)
    if ids is None:
        return model.get_output_embeddings()
    return ReducedVocabHead(output_weight(model, name), ids, target.vocab_size)


def default_eagle_dir(dtype: torch.dtype) -> str:
    """The shipped head for a target in `dtype`: DEFAULT_EAGLE_DIR, or its sibling trained on features in
    that dtype where the repository has one."""
    suffix = DTYPE_HEAD_SUFFIX.get(dtype)
    if suffix and (REPO_ROOT / (DEFAULT_EAGLE_DIR + suffix)).is_dir():
        return DEFAULT_EAGLE_DIR + suffix
    return DEFAULT_EAGLE_DIR


def load_eagle(target: TargetModel, tokenizer: PreTrainedTokenizerBase, path: str | None = None,
               name: str = "eagle", chain_length: int = 5, min_score: float = 0.05, vocab_top_k: int = 8192,
               vocab_counts: str | None = None, context_rows: int | None = None,
               weight_quantization: str | None = None) -> EagleDrafter:
    """The drafter `drafter=eagle` configures: `path` = a local EAGLE-1 head directory, or None for
    the head trained for the embedded model (data/eagle/): the one trained on features in the
    target's dtype where one ships (`DTYPE_HEAD_SUFFIX`), else the fp32-trained one. Never downloads."""
    folder = head_folder(path, default_eagle_dir(target.dtype), name, "EAGLE head", "python run.py task=train_heads")
    net = read_eagle_net(folder, tokenizer, int(target.model.config.hidden_size), target.vocab_size, name)
    head = output_head(target, tokenizer, vocab_top_k, vocab_counts, name, pinned_vocab_path(folder))
    return EagleDrafter(target, net, head, name=name, chain_length=chain_length, min_score=min_score,
                        context_rows=context_rows, weight_quantization=weight_quantization)
