"""Medusa (Cai et al. 2024): K heads on the target's last hidden state, head k guessing the token
k + 1 places after the root.

Each head is `layers` residual blocks (x + SiLU(W x + b)) then an output layer: its own (the
released Medusa-1 heads) or the target's frozen one (`shared output`, what `task=train_heads`
trains: only the blocks are new weights). A head reads the hidden state the last verify forward
already computed for the token before the root (`DecodeState.hidden`), so drafting costs no
target pass and keeps no cache. As a StepDrafter its distribution for a node depends only on the
node's depth; `tree=static` instantiates Medusa's sparse tree of top-k choices over it, `tree=eagle2`
grows a dynamic one.

Hydra (`drafter=hydra`, the same drafter over HydraHeads): head k also reads the embeddings of the
root and of the k tokens on the node's path, so two nodes of one depth get different children; the
drafter asks each head once per node and step, a depth's nodes in one batch. Hydra heads always
score through the target's output layer; specpipe writes them in Medusa's layout with `hydra: true`
and `{head}.input.*`, `{head}.blocks.{block}.linear.*` keys (Hydra's own repository layout is not read).

Checkpoints: a directory with `config.json` and the heads' weights in the layout of Medusa's
repository (`medusa_num_heads`, `medusa_num_layers`; keys `{head}.{block}.linear.weight|bias` and
`{head}.{layers}.weight`, optionally under `medusa_head.`) or of vLLM's converted heads
(`num_heads`, `num_hidden_layers`; keys `blocks.{head}.layers.{block}.weight|bias`, `lm_heads.{head}.weight`).
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from specpipe.engine.quantize import checked_quantization
from specpipe.errors import ConfigError
from specpipe.stages.base import StageResources, StepDrafter, draft_token_ids
from specpipe.stages.draft.draft_model import path_to
from specpipe.stages.draft.draft_vocab import TokenRanking, pinned_vocab_path
from specpipe.stages.draft.eagle import frequent_ids, output_head
from specpipe.stages.draft.head_checkpoint import (HYDRA_KEY, MEDUSA_CONVERTED_KEY, MEDUSA_ORIGINAL_KEY, MEDUSA_PREFIX,
                                                   check_tokenizer, head_folder, load_fitting, read_checkpoint,
                                                   write_head_folder)
from specpipe.stages.draft.reduced_vocab import ReducedVocabHead, head_logprobs
from specpipe.target import TargetModel
from specpipe.types import DecodeState, Proposal, VerifyResult

log = logging.getLogger(__name__)
ROOT = -1
DEFAULT_MEDUSA_DIR = "data/medusa/smollm2_135m"  # the heads trained for the embedded model (task=train_heads)
DEFAULT_HYDRA_DIR = "data/hydra/smollm2_135m"


class ResBlock(nn.Module):
    def __init__(self, hidden: int, bias: bool = True) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.ModuleList):
    """K heads of `layers` ResBlocks each, with their own output layers (`vocab` > 0) or none (the
    target's is applied after). State-dict keys are the released layout's: `{head}.{block}.linear.*`,
    `{head}.{layers}.weight`."""

    hydra = False

    def __init__(self, hidden: int, heads: int, layers: int, vocab: int = 0, bias: bool = True) -> None:
        super().__init__(nn.Sequential(*[ResBlock(hidden, bias) for _ in range(layers)],
                                       *([nn.Linear(hidden, vocab, bias=False)] if vocab else []))
                         for _ in range(heads))
        self.hidden, self.layers, self.vocab = hidden, layers, vocab

    def own_outputs(self) -> bool:
        return self.vocab > 0

    def run(self, head: int, hidden: Tensor, prefix: Tensor) -> Tensor:
        """Head `head` on hidden [n, hidden]; prefix [n, head + 1, hidden] (the embeddings of the root and
        the tokens drafted before it) is Hydra's input, unused by Medusa heads."""
        return self[head](hidden)

    def start_as_medusa(self) -> None:
        """Medusa's initialisation: zero blocks, so every head starts as the target's next-token head."""
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.zero_()


class HydraHead(nn.Module):
    """One Hydra head: [hidden, embeddings of the `index + 1` tokens before its guess] -> hidden
    (`input`), then ResBlocks (`blocks`); the target's output layer is applied after."""

    def __init__(self, hidden: int, index: int, layers: int, bias: bool = True) -> None:
        super().__init__()
        self.input = nn.Linear((index + 2) * hidden, hidden, bias=bias)
        self.blocks = nn.Sequential(*[ResBlock(hidden, bias) for _ in range(layers)])

    def forward(self, hidden: Tensor, prefix: Tensor) -> Tensor:
        # hidden [n, hidden], prefix [n, index + 1, hidden] -> [n, hidden]
        return self.blocks(self.input(torch.cat([hidden, prefix.flatten(1)], dim=-1)))


class HydraHeads(nn.ModuleList):
    """Hydra (Ankner et al. 2024): Medusa heads that also read the tokens drafted before them. Head k
    reads [hidden, embedding(root), embedding(d_0), ..., embedding(d_{k-1})], projects it to hidden and
    runs its ResBlocks; the target's (frozen, shared) output layer scores the result. State-dict
    keys: `{head}.input.weight|bias`, `{head}.blocks.{block}.linear.weight|bias`."""

    hydra = True
    vocab = 0

    def __init__(self, hidden: int, heads: int, layers: int, bias: bool = True) -> None:
        super().__init__(HydraHead(hidden, index, layers, bias) for index in range(heads))
        self.hidden, self.layers = hidden, layers

    def own_outputs(self) -> bool:
        return False

    def run(self, head: int, hidden: Tensor, prefix: Tensor) -> Tensor:
        return self[head](hidden, prefix)

    def start_as_medusa(self) -> None:
        """Zero blocks and input projections that pass the hidden state through, ignoring the tokens:
        every head starts as the target's own next-token head (Medusa's initialisation)."""
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.zero_()
            for head in self:
                head.input.weight[:, : self.hidden] = torch.eye(self.hidden)


class MedusaDrafter(StepDrafter):
    """Medusa heads as a StepDrafter (`tree=static` or `tree=eagle2`), or one greedy chain per step
    as a Proposer (`tree=trie`)."""

    def __init__(self, target: TargetModel, heads: MedusaHeads | HydraHeads, outputs: list[nn.Module],
                 name: str = "medusa", folder: Path | None = None, weight_quantization: str | None = None) -> None:
        if len(outputs) != len(heads):
            raise ConfigError(f"{name}: {len(heads)} heads need as many output layers, got {len(outputs)}")
        self.name = name
        self.folder = folder  # where the checkpoint was read (task=calibrate_tree writes its tree there)
        self.target = target
        self.heads = heads.to(device=target.device, dtype=target.dtype).eval()
        self.outputs = outputs  # [K] modules hidden -> logits [vocab] (the head's own, reduced, or the target's)
        self.runner = None  # drafting reads hidden states the target already computed: no draft forward to cost
        # The pipeline builder runs the heads and their reduced output layers under the target's engine.
        target_head = target.model.get_output_embeddings()
        own = {id(output): output for output in outputs if output is not target_head}
        self.engine_modules = (self.heads, *own.values())
        self.weight_quantization = checked_quantization(weight_quantization, name)  # of engine_modules (engine.quantize)
        # Heads whose output layers all score the same reduced vocabulary hand out log-probs over it
        # only (StepDrafter's `draft_vocab`): the trees' top-k then runs over 8192 columns, not 49152.
        reduced = [output for output in outputs if isinstance(output, ReducedVocabHead)]
        same_ids = len(reduced) == len(outputs) and all(torch.equal(o.target_ids, reduced[0].target_ids) for o in reduced)
        self.draft_vocab: Tensor | None = reduced[0].target_ids if same_ids else None  # [k]

    def resources(self) -> StageResources:  # no draft forward of its own: no cost runner
        return StageResources(engine_modules=self.engine_modules, weight_quantization=self.weight_quantization)

    def reset(self, state: DecodeState) -> None:
        state.stage_state[self] = None

    def propose(self, state: DecodeState) -> Proposal:
        logprobs = self.start(state)
        tokens, scores, cumulative = [], [], 1.0
        for depth in range(len(self.heads)):
            column = logprobs.argmax()
            cumulative *= math.exp(float(logprobs[column]))
            tokens.append(int(draft_token_ids(column, self.draft_vocab)))
            scores.append(cumulative)
            if depth + 1 < len(self.heads):
                logprobs = self.step(state, tokens, list(range(-1, depth)), [depth])[0]
        return Proposal.chain(tokens, scores, self.name)

    def on_commit(self, state: DecodeState, result: VerifyResult) -> None:
        pass  # the next step reads the new DecodeState.hidden

    def on_finish(self, state: DecodeState) -> None:
        state.stage_state.pop(self, None)

    def start(self, state: DecodeState) -> Tensor:
        """Every head's log-probs from the hidden state before the root (Medusa), or head 0's (Hydra:
        the others depend on the path); returns head 0's [vocab] ([k] over `draft_vocab` where set)."""
        if state.hidden is None:
            raise ConfigError(f"{self.name}: the decoder gave no hidden state (DecodeState.hidden); Medusa heads "
                              f"draft from the target's own hidden states")
        if self.heads.hydra:
            state.stage_state[self] = {}  # node -> [vocab] this step (ROOT: head 0's)
            return self._hydra_logprobs(state, [], [], [ROOT])[0]
        with torch.inference_mode():
            hidden = state.hidden.to(self.target.dtype)[None]  # [1, hidden]
            state.stage_state[self] = torch.cat([head_logprobs(output, head(hidden), self.draft_vocab is not None)
                                                 for head, output in zip(self.heads, self.outputs)])  # [K, vocab]
        return state.stage_state[self][0]

    def step(self, state: DecodeState, tokens: list[int], parents: list[int], frontier: list[int]) -> Tensor:
        """[m, vocab] ([m, k] over `draft_vocab` where set): head d's log-probs for a frontier node at
        depth d (the root is depth 0); past the last head, nothing is drafted (all -inf)."""
        if self.heads.hydra:
            return self._hydra_logprobs(state, tokens, parents, frontier)
        all_logprobs: Tensor = state.stage_state[self]  # [K, vocab]
        rows = []
        for node in frontier:
            depth = len(path_to(node, parents))
            rows.append(all_logprobs[depth] if depth < len(self.heads) else torch.full_like(all_logprobs[0], -math.inf))
        return torch.stack(rows)

    @torch.inference_mode()
    def true_path_ranks(self, hidden: Tensor, following: Tensor) -> Tensor:
        """Where the target's own continuation ranks among each head's guesses (task=calibrate_tree).

        hidden [n, hidden]: the target's last hidden states at n positions; following [n, K + 1]: the
        tokens after each position, the root first. Returns [n, K] int64 on the CPU: head k's rank of
        following[:, k + 1] (0 = its top guess; ties count for the token), or -1 where that token is
        outside the heads' reduced vocabulary. A Hydra head reads the true tokens before its guess:
        what it reads whenever the path up to it was accepted."""
        hidden = hidden.to(device=self.target.device, dtype=self.target.dtype)
        following = following.to(self.target.device)
        to_column = None
        if self.draft_vocab is not None:  # target id -> column of the reduced vocabulary, -1 outside it
            to_column = torch.full((self.target.vocab_size,), -1, dtype=torch.long, device=following.device)
            to_column[self.draft_vocab] = torch.arange(len(self.draft_vocab), device=following.device)
        embed = self.target.model.get_input_embeddings()
        ranks = []
        for k in range(len(self.heads)):
            prefix = embed(following[:, : k + 1]) if self.heads.hydra else None  # [n, k + 1, hidden]
            logprobs = head_logprobs(self.outputs[k], self.heads.run(k, hidden, prefix),
                                     reduced=to_column is not None)  # [n, vocab] or [n, k]
            column = following[:, k + 1] if to_column is None else to_column[following[:, k + 1]]  # [n]
            truth = logprobs.gather(1, column.clamp_min(0)[:, None])  # [n, 1]
            rank = (logprobs > truth).sum(dim=1)  # [n]
            ranks.append(torch.where(column >= 0, rank, -1))
        return torch.stack(ranks, dim=1).cpu()

    @torch.inference_mode()
    def _hydra_logprobs(self, state: DecodeState, tokens: list[int], parents: list[int], frontier: list[int]) -> Tensor:
        """Hydra: head d reads the hidden state and the embeddings of the root and of the d tokens on
        the node's path; nodes of one depth run as one batch, each once per step."""
        known: dict[int, Tensor] = state.stage_state[self]
        paths = {node: path_to(node, parents) for node in frontier if node not in known}
        by_depth: dict[int, list[int]] = {}
        for node, path in paths.items():
            by_depth.setdefault(len(path), []).append(node)
        embed = self.target.model.get_input_embeddings()
        hidden = state.hidden.to(self.target.dtype)[None]  # [1, hidden]
        width = self.target.vocab_size if self.draft_vocab is None else len(self.draft_vocab)
        for depth, nodes in by_depth.items():
            if depth >= len(self.heads):
                for node in nodes:
                    known[node] = torch.full((width,), -math.inf, device=hidden.device)
                continue
            ids = torch.tensor([[state.tokens[-1]] + [tokens[n] for n in paths[node]] for node in nodes])
            prefix = embed(ids.to(self.target.device))  # [m, depth + 1, hidden]
            rows = head_logprobs(self.outputs[depth], self.heads.run(depth, hidden.expand(len(nodes), -1), prefix),
                                 reduced=self.draft_vocab is not None)
            for node, row in zip(nodes, rows):  # rows [m, vocab] or [m, k]
                known[node] = row
        return torch.stack([known[node] for node in frontier])


# ---- checkpoints --------------------------------------------------------------------------------
def medusa_state(config: dict, tensors: dict[str, Tensor], name: str) -> tuple[int, int, dict[str, Tensor]]:
    """(heads, layers, state dict in MedusaHeads' keys) from either released layout."""
    if any(key.startswith("midlayer.") or key == "fc.weight" for key in tensors):
        kind = "EAGLE-3" if any(key.startswith("midlayer.") for key in tensors) else "EAGLE-1"
        raise ConfigError(f"{name}: this is an {kind} checkpoint (fc.weight / midlayer.*): load it with "
                          f"pipeline={'eagle3' if kind == 'EAGLE-3' else 'eagle'}")
    heads = config.get("medusa_num_heads", config.get("num_heads"))
    layers = config.get("medusa_num_layers", config.get("num_hidden_layers"))
    if heads is None or layers is None:
        raise ConfigError(f"{name}: config.json names no head count (medusa_num_heads or num_heads) and block count "
                          f"(medusa_num_layers or num_hidden_layers): not a Medusa checkpoint")
    heads, layers = int(heads), int(layers)
    state: dict[str, Tensor] = {}
    if config.get("hydra"):
        for key, value in tensors.items():
            if not HYDRA_KEY.match(key):
                raise ConfigError(f"{name}: unexpected tensor {key!r} for Hydra heads (expected HEAD.input.weight or "
                                  f"HEAD.blocks.BLOCK.linear.weight)")
        return heads, layers, dict(tensors)
    for key, value in tensors.items():
        short = MEDUSA_PREFIX.sub("", key)
        original = MEDUSA_ORIGINAL_KEY.match(short)
        converted = MEDUSA_CONVERTED_KEY.match(short)
        if original:
            state[short] = value
        elif converted and converted.group(4) is not None:
            state[f"{converted.group(4)}.{layers}.weight"] = value
        elif converted:
            state[f"{converted.group(1)}.{converted.group(2)}.linear.{converted.group(3)}"] = value
        elif key != "token_map":
            raise ConfigError(f"{name}: unexpected tensor {key!r} for a Medusa checkpoint (expected "
                              f"HEAD.BLOCK.linear.weight or blocks.HEAD.layers.BLOCK.weight)")
    return heads, layers, state


def build_medusa_heads(config: dict, tensors: dict[str, Tensor], target_config: PretrainedConfig,
                       name: str) -> MedusaHeads | HydraHeads:
    """Medusa or Hydra heads from either released layout, checked against the target's config."""
    heads, layers, state = medusa_state(config, tensors, name)
    hidden, vocab_size = int(target_config.hidden_size), int(target_config.vocab_size)
    if config.get("hydra"):
        projection = state.get("0.input.weight")
        if projection is None or tuple(projection.shape) != (hidden, 2 * hidden):
            shape = None if projection is None else tuple(projection.shape)
            raise ConfigError(f"{name}: the Hydra heads' first input projection (0.input.weight) is {shape}, the "
                              f"target's hidden size {hidden} needs ({hidden}, {2 * hidden}): they are for another model")
        module = HydraHeads(hidden, heads, layers, bias="0.input.bias" in state)
        load_fitting(module, state, name, f"{heads} Hydra heads of {layers} block(s)")
        return module
    block = state.get("0.0.linear.weight")
    if block is None:
        raise ConfigError(f"{name}: the checkpoint has no first block (0.0.linear.weight)")
    if tuple(block.shape) != (hidden, hidden):
        raise ConfigError(f"{name}: the heads' blocks are {tuple(block.shape)}, the target's hidden size {hidden} "
                          f"needs ({hidden}, {hidden}): these heads are for another model")
    output = state.get(f"0.{layers}.weight")
    vocab = int(output.shape[0]) if output is not None else 0
    if vocab and vocab != vocab_size:
        raise ConfigError(f"{name}: the heads' output layers have {vocab} tokens, the target's vocabulary "
                          f"{vocab_size}: these heads are for another model")
    module = MedusaHeads(hidden, heads, layers, vocab, bias="0.0.linear.bias" in state)
    load_fitting(module, state, name, f"{heads} heads of {layers} block(s)")
    return module


def save_medusa(module: MedusaHeads, folder: Path, extra: dict | None = None, dtype: torch.dtype = torch.bfloat16,
                ranking: TokenRanking | None = None) -> None:
    """Writes the heads in Medusa's released layout (config.json + model.safetensors), with the ranking
    of draft tokens they were trained over (`draft_vocab.npz`) where given."""
    config = {"medusa_num_heads": len(module), "medusa_num_layers": module.layers, "hidden_size": module.hidden,
              "shared_output_layer": not module.own_outputs(), "hydra": module.hydra, "specpipe": extra or {}}
    write_head_folder(folder, config, {key: value.detach().to(dtype) for key, value in module.state_dict().items()},
                      ranking)


def load_medusa(target: TargetModel, tokenizer: PreTrainedTokenizerBase, path: str | None = None,
                name: str = "medusa", vocab_top_k: int = 8192, vocab_counts: str | None = None,
                heads: int | None = None, hydra: bool = False, weight_quantization: str | None = None) -> MedusaDrafter:
    """The drafter `drafter=medusa` (or with `hydra`, `drafter=hydra`) configures: `path` = a local
    checkpoint directory, or None for the heads trained for the embedded model (data/medusa/,
    data/hydra/). `heads` keeps only the first N."""
    kind = "hydra" if hydra else "medusa"
    folder = head_folder(path, DEFAULT_HYDRA_DIR if hydra else DEFAULT_MEDUSA_DIR, name,
                         "Hydra heads" if hydra else "Medusa heads", f"python run.py task=train_heads train_heads.kind={kind}")
    config, tensors = read_checkpoint(folder, name, "Medusa checkpoint", layout=kind)
    check_tokenizer(config, tokenizer, folder, name)
    module = build_medusa_heads(config, tensors, target.model.config, name)
    if heads is not None:
        if not 1 <= heads <= len(module):
            raise ConfigError(f"{name}: heads must be between 1 and the checkpoint's {len(module)}, got {heads}")
        del module[heads:]
    if module.own_outputs():
        layers = module.layers
        own = [head[layers] for head in module]
        for head in module:
            del head[layers]  # the output layers are applied by the drafter (reduced or not)
        module.vocab = 0
        ids = frequent_ids(tokenizer, target.vocab_size, vocab_top_k, vocab_counts, name, pinned_vocab_path(folder))
        if ids is not None:
            outputs = [ReducedVocabHead(linear.weight.to(target.dtype), ids, target.vocab_size) for linear in own]
        else:
            outputs = [nn.Sequential(linear.to(target.dtype)) for linear in own]  # a parent the engine can swap it in
    else:
        shared = output_head(target, tokenizer, vocab_top_k, vocab_counts, name, pinned_vocab_path(folder))
        outputs = [shared] * len(module)
    return MedusaDrafter(target, module, outputs, name=name, folder=folder, weight_quantization=weight_quantization)
