"""`task=train_heads`: an EAGLE(-3) head or Medusa / Hydra heads for the target, trained on the target's own answers.

Data: the self-distilled chat corpus (data/self_distill/: the target's greedy answers to chat
prompts assembled from subject lists, never the benchmark sets), split by a hash of the prompt id
exactly as `task=distill_draft` splits it. Stages, each resumable (kill the run at any time and
start it again):

a. features: the target, in `model.dtype` (the dtype the head will draft under) and through
   `engine` (the forward the pipeline verifies with), over prompt + answer; the last hidden state
   (the input of the output layer) of every position goes to .npy shards in
   `<checkpoint_dir>/features-<dtype>/` (fp32; a finished shard is skipped, an answer cached at
   another `max_seq_len` is extracted again, so a grown corpus extracts only its new answers). All
   head kinds train on the same features.
b. train (kind=eagle): the head's row p reads [embedding(s_{p+1}), f_p] and predicts f_{p+1}; the loss on the
   answer positions is EAGLE-1's: SmoothL1 to the target's next feature plus `class_weight` times
   the cross-entropy from the target's next-token distribution, both distributions taken over
   the `vocab_top_k` most frequent tokens (the reduced output layer the head drafts with). With
   `rollout_steps` > 1 the same loss is also taken on rollouts that read the head's own predicted
   features (EAGLE-3's training-time test), and `init_from` fine-tunes a trained head.
   kind=medusa: head k reads f_p and is scored on s_{p+k+2} (cross-entropy from the target's
   distribution there, weighted medusa_decay^k), through the target's shared output layer;
   kind=hydra: the same, head k also reading the embeddings of s_{p+1} .. s_{p+k+1} (teacher forcing).
   kind=eagle3: the row reads the hidden states entering three target layers (a second feature
   cache) and trains over `rollout_steps` training-time-test rollouts on its own outputs.
   AdamW, warmup + cosine decay, a checkpoint every `checkpoint_every` steps.
c. eval on the held-out answers: top-1 agreement with the target's greedy token from the true
   features (depth 1), and greedy chain acceptance per depth drafted the way the pipeline drafts
   (from the head's own predicted features after the first token), with the vocabulary miss rate.
d. export: the head(s) in the released EAGLE-1 / EAGLE-3 / Medusa layout (config.json +
   model.safetensors, bf16; Hydra in Medusa's with `hydra: true`) to `out`, the command and the
   eval in config.json's `specpipe` entry.
`eval_of=DIR` runs c. alone on the head(s) of `kind` in DIR (trained elsewhere, or on another corpus,
whose own sidecar eval used that corpus's split), over the vocabulary they draft with in the pipeline:
two heads compared on one held-out split.

The shipped heads' commands (each took minutes to an hour on 2 cores; run niced in the background):

    OMP_WAIT_POLICY=PASSIVE nice -n 19 nohup .venv/bin/python run.py task=train_heads train_heads.steps=600 \\
        train_heads.eval_every=200 >> ~/.cache/specpipe/train_heads/smollm2_135m/train.log 2>&1 &
    .venv/bin/python run.py task=train_heads train_heads.kind=medusa train_heads.steps=200 train_heads.batch=2048 \\
        train_heads.eval_every=100
    .venv/bin/python run.py task=train_heads train_heads.kind=hydra train_heads.steps=200 train_heads.batch=2048 \\
        train_heads.eval_every=100
    .venv/bin/python run.py task=train_heads train_heads.kind=eagle3 train_heads.steps=500 train_heads.eval_every=250
"""
from __future__ import annotations

import copy
import hashlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from transformers import LlamaConfig

from specpipe.errors import ConfigError
from specpipe.models import cache_root
from specpipe.pipelines.builder import build_engine, load_model
from specpipe.stages.draft.draft_model import corpus_ranking, output_weight
from specpipe.stages.draft.draft_vocab import VOCAB_FILE, pinned_vocab_path, read_ranking
from specpipe.stages.draft.eagle import frequent_ids
from specpipe.stages.draft.eagle_checkpoint import read_eagle_net, save_eagle
from specpipe.stages.draft.eagle_net import EagleNet
from specpipe.stages.draft.eagle3 import Eagle3Net, aux_layers_of, build_eagle3_net, save_eagle3
from specpipe.stages.draft.head_checkpoint import check_tokenizer, read_checkpoint
from specpipe.stages.draft.medusa import HydraHeads, MedusaHeads, build_medusa_heads, save_medusa
from specpipe.stores.manifest import sha256_file, tokenizer_fingerprint
from specpipe.tasks import task_command
from specpipe.distill.training import (AT_LEAST_ONE, ExampleShards, ResumableTrainer, check_folder, check_task_settings,
                                       finished_message, frozen_product, lock_folder, progress_bar, write_json)
from specpipe.paths import local_path, package_path
from specpipe.tasks.distill_draft import (Example, example_batches, fill_shards, lr_at,
                                          pad_examples, pad_id_of, read_task_corpus, split_held_out)

FEATURES_VERSION = 1
HEAD_KINDS = ("eagle", "medusa", "eagle3", "hydra")


def _log(message: str) -> None:
    print(f"train_heads: {message}", file=sys.stderr, flush=True)


# ---- a. features --------------------------------------------------------------------------------
class FeatureCache(ExampleShards):
    """The target's last hidden state at every input position (ExampleShards `features-NNNNNN.*`):
    `feat` [len(tokens), hidden] fp32 per example; with `layers`, the hidden states entering those
    layers side by side instead (`feat` [len(tokens), len(layers) * hidden]: EAGLE-3's inputs)."""

    def __init__(self, folder: Path, layers: tuple[int, ...] = ()) -> None:
        super().__init__(folder, "features", ("feat",), "train_heads")
        self.layers = tuple(layers)

    def features(self) -> dict[str, np.ndarray]:
        """prompt id -> features [len(tokens), width] (memory-mapped)."""
        return {pid: arrays[0] for pid, arrays in self.load(mmap=True).items()}


def extract_features(target, examples: list[Example], cache: FeatureCache, batch_tokens: int, pad_id: int,
                     progress: bool) -> None:
    def selected(hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:  # -> [b, T, width]
        if not cache.layers:
            return hidden_states[-1]
        return torch.cat([hidden_states[layer] for layer in cache.layers], dim=-1)

    def arrays(chunk: list[Example]) -> dict[str, np.ndarray]:
        ids, mask, _, _ = pad_examples(chunk, pad_id)  # [b, T] right-padded each
        # The decoder stack alone: the logits over every position are not needed (a fifth of the cost).
        hidden = selected(target.model(input_ids=ids, attention_mask=mask, use_cache=False,
                                       output_hidden_states=True).hidden_states)
        return {"feat": np.concatenate([hidden[row, :len(e.tokens)].float().numpy() for row, e in enumerate(chunk)])}

    what = f"hidden states entering layers {list(cache.layers)}" if cache.layers else "last hidden states"
    fill_shards(cache, examples, batch_tokens, lambda e: len(e.tokens), arrays, what, progress, _log)


def check_features(features: dict[str, np.ndarray], examples: list[Example], cache: FeatureCache) -> None:
    for e in examples:
        if e.prompt_id not in features or len(features[e.prompt_id]) != len(e.tokens):
            raise ConfigError(f"the features in {cache.folder} do not match the corpus (answer {e.prompt_id}); "
                              f"delete that folder and rerun")


# ---- b. train -----------------------------------------------------------------------------------
class HeadBatch:
    """Padded training rows of a batch of examples. Row p of example e reads [embedding(s_{p+1}), f_p]
    (s = prompt + answer, f = the target's features) and is scored on predicting f_{p+1} and
    s_{p+2} where s_{p+2} is an answer token."""

    def __init__(self, examples: list[Example], features: dict[str, np.ndarray], pad_id: int,
                 inputs: dict[str, np.ndarray] | None = None) -> None:
        # `inputs`: what row p reads instead of f_p (EAGLE-3: the layers it fuses, [len, 3 * H])
        rows = [len(e.tokens) - 1 for e in examples]  # rows p = 0 .. len - 2
        width = max(rows)
        hidden = features[examples[0].prompt_id].shape[1]
        inputs = features if inputs is None else inputs
        self.tokens = torch.full((len(examples), width), pad_id, dtype=torch.long)  # [b, T]: s_{p+1}
        self.features = torch.zeros(len(examples), width, inputs[examples[0].prompt_id].shape[1])  # [b, T, W]: f_p
        self.next_features = torch.zeros(len(examples), width, hidden)  # [b, T, H]: f_{p+1}
        self.labels = torch.full((len(examples), width), -1, dtype=torch.long)  # [b, T]: s_{p+2}, -1 = not scored
        self.valid = torch.zeros(len(examples), width, dtype=torch.bool)  # [b, T]: real rows (attention)
        for row, (example, n) in enumerate(zip(examples, rows)):
            sequence = np.concatenate([example.tokens, example.answer[example.n_pred - 1:example.n_pred]])
            f = torch.from_numpy(np.array(features[example.prompt_id], dtype=np.float32))  # [len, H] (a copy of the memory map)
            self.tokens[row, :n] = torch.from_numpy(sequence[1:n + 1])
            self.features[row, :n] = f[:n] if inputs is features else torch.from_numpy(
                np.array(inputs[example.prompt_id][:n], dtype=np.float32))
            self.next_features[row, :n] = f[1:n + 1]
            self.valid[row, :n] = True
            labels = torch.from_numpy(sequence[2:n + 2])
            scored = torch.arange(n) + 2 >= example.prompt_len  # s_{p+2} is an answer token
            self.labels[row, :n] = torch.where(scored, labels, torch.full_like(labels, -1))

    def attention_mask(self) -> torch.Tensor:
        """[b, 1, T, T] bool: causal within each example's real rows (a padded row sees itself only)."""
        width = self.tokens.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        mask = causal[None] & self.valid[:, None, :]
        mask |= torch.eye(width, dtype=torch.bool)[None]
        return mask[:, None]


def run_net(net: EagleNet, embed: torch.nn.Module, tokens: torch.Tensor, features: torch.Tensor,
            mask: torch.Tensor) -> torch.Tensor:
    """Batched rows without a cache: tokens [b, T], features [b, T, H], mask [b, 1, T, T] -> [b, T, H]."""
    positions = torch.arange(tokens.shape[1])[None].expand(tokens.shape[0], -1)
    return net.rows(embed(tokens), features, positions, mask)


def target_log_probs(batch: HeadBatch, reduced_head: torch.nn.Module) -> torch.Tensor:
    """[n, K] the target's next-token log-probs over the reduced vocabulary at the n labelled rows."""
    return F.log_softmax(reduced_head(batch.next_features[batch.labels >= 0]), dim=-1)


def head_loss(predicted: torch.Tensor, batch: HeadBatch, reduced_head: torch.nn.Module, class_weight: float,
              to_reduced: torch.Tensor, keep: torch.Tensor | None = None,
              target_log_p: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """EAGLE-1's loss over the scored rows: SmoothL1(predicted, f_{p+1}) + class_weight * CE(target's
    next-token distribution, the head's), both over the reduced vocabulary (reduced_head: [n, H] -> [n, K]).
    to_reduced [vocab]: reduced index of each token, -1 outside; a label outside counts as a miss.
    The scored rows are the labelled ones, or those of them `keep` [n] selects; `target_log_p` [n, K]
    is `target_log_probs(batch, reduced_head)` where the caller already has it."""
    scored = batch.labels >= 0  # [b, T]
    predicted, truth = predicted[scored], batch.next_features[scored]  # [n, H]
    if target_log_p is None:
        target_log_p = target_log_probs(batch, reduced_head)
    labels = to_reduced[batch.labels[scored]]  # [n]
    if keep is not None:
        predicted, truth, target_log_p, labels = predicted[keep], truth[keep], target_log_p[keep], labels[keep]
    regression = F.smooth_l1_loss(predicted, truth)  # mean over positions and feature dimensions, as EAGLE-1
    draft_log_q = F.log_softmax(reduced_head(predicted), dim=-1)  # [n, K]
    classification = -(target_log_p.exp() * draft_log_q).sum(-1).mean()
    inside = labels >= 0
    stats = {"positions": int(labels.shape[0]), "top1": int((draft_log_q.argmax(-1) == labels)[inside].sum()),
             "misses": int((~inside).sum()), "regression": float(regression.detach()),
             "classification": float(classification.detach())}
    return regression + class_weight * classification, stats


class HeadTrainer(ResumableTrainer):
    """`loss_of(examples)` -> (loss, stats with "positions" and "top1") is the head kind's own."""

    def __init__(self, net: torch.nn.Module, loss_of: Callable[[list[Example]], tuple[torch.Tensor, dict]],
                 examples: list[Example], cfg: DictConfig, folder: Path) -> None:
        super().__init__(net, examples, lambda e: len(e.tokens), cfg, folder)
        self.net, self.loss_of = net, loss_of

    def train_step(self) -> dict:
        cfg = self.cfg
        examples = self.batch_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step, float(cfg.lr), int(cfg.warmup), int(cfg.steps), float(cfg.min_lr_ratio))
        self.net.train()
        loss, stats = self.loss_of(examples)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, float(cfg.grad_clip))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.net.eval()
        self.step += 1
        self.positions += stats["positions"]
        stats["loss"] = float(loss.detach())
        return stats


def eagle_loss_of(net: EagleNet, embed, reduced_head: torch.nn.Module, to_reduced: torch.Tensor, features: dict,
                  cfg: DictConfig, pad_id: int) -> Callable[[list[Example]], tuple[torch.Tensor, dict]]:
    rollouts = rollout_steps(cfg)

    def loss_of(examples: list[Example]) -> tuple[torch.Tensor, dict]:
        batch = HeadBatch(examples, features, pad_id)
        inputs = batch.features
        if float(cfg.feature_noise):  # EAGLE's augmentation: the head drafts from its own, imperfect features
            inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * float(cfg.feature_noise)
        if rollouts > 1:
            return eagle_rollout_loss(net, embed, batch, inputs, reduced_head, float(cfg.class_weight), to_reduced,
                                      rollouts, float(cfg.rollout_decay))
        predicted = run_net(net, embed, batch.tokens, inputs, batch.attention_mask())
        return head_loss(predicted, batch, reduced_head, float(cfg.class_weight), to_reduced)
    return loss_of


def rollout_steps(cfg: DictConfig) -> int:
    """train_heads.rollout_steps, null meaning the kind's default: 3 for EAGLE-3 (its recipe), 1 (no
    rollouts) for EAGLE-1, whose released recipe trains on the target's features only."""
    steps = cfg.get("rollout_steps")
    steps = (3 if cfg.kind == "eagle3" else 1) if steps is None else int(steps)
    if steps < 1:
        raise ConfigError(f"train_heads.rollout_steps must be >= 1 (1 = no rollouts), got {steps}")
    return steps


def eagle_rollout_loss(net: EagleNet, embed, batch: HeadBatch, inputs: torch.Tensor, reduced_head: torch.nn.Module,
                       class_weight: float, to_reduced: torch.Tensor, steps: int,
                       decay: float) -> tuple[torch.Tensor, dict]:
    """EAGLE-1's loss with EAGLE-3's training-time test (as HASS applies it to EAGLE heads): rollout 0
    reads the target's features `inputs` [b, T, H]; rollout k's row p reads the feature the head
    predicted at rollout k - 1 for position p (its row p - 1) and is the depth-(k+1) tree node at p,
    under `rollout_mask`. Every rollout is scored by `head_loss` on the same labels (the true next
    feature and token; a node is only worth drafting where its ancestors were right), on the rows
    with a committed row under their chain, weighted decay^k. Stats are rollout 0's."""
    target_log_p = target_log_probs(batch, reduced_head)  # [n, K], the same labels for every rollout
    where = labelled_positions(batch)  # [n]
    total = torch.zeros(())
    stats: dict = {}
    for step, out in enumerate(rollout_outputs(net, embed(batch.tokens), inputs, batch.valid, steps)):
        loss, step_stats = head_loss(out, batch, reduced_head, class_weight, to_reduced, where >= step, target_log_p)
        total = total + decay ** step * loss
        if step == 0:
            stats = step_stats
        stats.setdefault("top1_per_step", []).append(step_stats["top1"] / max(1, step_stats["positions"]))
    return total, stats


# ---- EAGLE-3 ------------------------------------------------------------------------------------
def rollout_mask(valid: torch.Tensor, step: int) -> torch.Tensor:
    """valid [b, T] real rows -> [b, 1, T, (step + 1) * T] bool: what row p of rollout `step` sees over
    the rows of steps 0..step (EAGLE-3's training-time test). Row p of step k is the depth-(k+1) tree
    node at position p: it sees the committed rows 0..p-k (step 0), its ancestors (step j's row at
    p-k+j) and itself. A row with no committed row under it (p < k) is never scored, nor seen by a
    scored row; a padded row sees the rows before it and is not scored either."""
    batch, width = valid.shape
    p = torch.arange(width)
    blocks = [((p[None, :] <= p[:, None] - step)[None] & valid[:, None, :])]  # step 0: the committed rows
    for j in range(1, step + 1):
        blocks.append((p[None, :] == p[:, None] - step + j)[None].expand(batch, -1, -1))  # ancestors, then itself
    mask = torch.cat(blocks, dim=-1)
    return mask[:, None]


def rollout_outputs(net, embeds: torch.Tensor, inputs: torch.Tensor, valid: torch.Tensor,
                    steps: int) -> Iterator[torch.Tensor]:
    """The head's rows [b, T, H] of rollouts 0..steps-1 over one cache: rollout 0 reads `inputs` [b, T, W]
    (the target's features), rollout k the head's own outputs of rollout k - 1 one position earlier
    (row p reads row p - 1's prediction: its feature at p), under `rollout_mask`. embeds [b, T, H];
    valid [b, T]."""
    from transformers.cache_utils import DynamicCache

    positions = torch.arange(embeds.shape[1])[None].expand(embeds.shape[0], -1)  # [b, T]
    cache = DynamicCache(config=net.config)
    for step in range(steps):
        out = net.rows(embeds, inputs, positions, rollout_mask(valid, step), cache)  # [b, T, H]
        yield out
        inputs = torch.cat([out.new_zeros(out.shape[0], 1, out.shape[2]), out[:, :-1]], dim=1)


def labelled_positions(batch: HeadBatch) -> torch.Tensor:
    """[n] the position p of each labelled row (rollout k scores those with p >= k: a committed row under their chain)."""
    labelled = batch.labels >= 0  # [b, T]
    return torch.arange(labelled.shape[1])[None].expand_as(labelled)[labelled]


def eagle3_loss(net, embed, batch: HeadBatch, reduced_head: torch.nn.Module, to_reduced: torch.Tensor, steps: int,
                decay: float) -> tuple[torch.Tensor, dict]:
    """EAGLE-3's loss: `steps` rollouts over the batch, rollout k reading the features the draft itself
    produced at rollout k - 1 (one position earlier), each scored by the cross-entropy from the
    target's next-token distribution (over the draft vocabulary, reduced_head [n, H] -> [n, K]) at its answer
    positions, weighted decay^k. The head's lm_head starts as these K rows of the target's."""
    scored = batch.labels >= 0  # [b, T]
    target_log_p = target_log_probs(batch, reduced_head)  # [n, K]
    where = labelled_positions(batch)  # [n] each scored row's p
    labels = to_reduced[batch.labels[scored]]  # [n]
    inside = labels >= 0
    total = torch.zeros(())
    stats = {"positions": int(scored.sum()), "misses": int((~inside).sum()), "top1_per_step": []}
    # rollout 0 reads the target's layers [b, T, 3H], later ones the draft's own outputs [b, T, H]
    for step, out in enumerate(rollout_outputs(net, embed(batch.tokens), batch.features, batch.valid, steps)):
        keep = where >= step  # rows with a committed row under their chain
        log_q = F.log_softmax(net.draft_logits(out[scored][keep]), dim=-1)  # [m, K]
        loss = -(target_log_p[keep].exp() * log_q).sum(-1).mean()
        total = total + decay ** step * loss
        agree = int((log_q.argmax(-1) == labels[keep])[inside[keep]].sum())
        stats["top1_per_step"].append(agree / max(1, int(keep.sum())))
        if step == 0:
            stats.update(top1=agree, classification=float(loss.detach()))
    return total, stats


def eagle3_loss_of(net, embed, reduced_head: torch.nn.Module, to_reduced: torch.Tensor, features: dict,
                   aux_features: dict, cfg: DictConfig, pad_id: int) -> Callable[[list[Example]], tuple[torch.Tensor, dict]]:
    def loss_of(examples: list[Example]) -> tuple[torch.Tensor, dict]:
        batch = HeadBatch(examples, features, pad_id, inputs=aux_features)
        return eagle3_loss(net, embed, batch, reduced_head, to_reduced, rollout_steps(cfg), float(cfg.rollout_decay))
    return loss_of


def new_eagle3_head(target, layers: tuple[int, ...], reduced_ids: torch.Tensor) -> Eagle3Net:
    """A 1-layer EAGLE-3 head shaped like the target's layers over the draft vocabulary `reduced_ids`;
    its output layer and norm start as the target's own (their rows for those tokens)."""
    config = copy.deepcopy(target.config)
    fields = {k: v for k, v in config.to_dict().items() if k not in ("architectures", "model_type")}
    net = Eagle3Net(LlamaConfig(**{**fields, "num_hidden_layers": 1}), layers, len(reduced_ids))
    with torch.no_grad():
        net.d2t.copy_(reduced_ids - torch.arange(len(reduced_ids)))
        net.lm_head.weight.copy_(output_weight(target, "train_heads").detach()[reduced_ids])
        net.norm.weight.copy_(target.model.norm.weight.detach())
    return net.float()


# ---- Medusa -------------------------------------------------------------------------------------
def medusa_rows(examples: list[Example], features: dict, heads: int) -> list[tuple[torch.Tensor, ...]]:
    """Per head k: (inputs f_p [n, H], the target's features f_{p+k+1} [n, H] whose distribution is the
    soft label, the target's token s_{p+k+2} [n], the tokens before it s_{p+1} .. s_{p+k+1} [n, k + 1]
    (the root and the drafts a Hydra head reads)) over the positions p where s_{p+k+2} is an answer token."""
    parts: list[list[tuple[torch.Tensor, ...]]] = [[] for _ in range(heads)]
    for example in examples:
        f = torch.from_numpy(np.array(features[example.prompt_id], dtype=np.float32))  # [N, H]
        sequence = torch.from_numpy(np.concatenate([example.tokens, example.answer[example.n_pred - 1:example.n_pred]]))
        for k in range(heads):
            n = len(example.tokens) - 1 - k  # p = 0 .. N-2-k
            if n <= 0:
                continue
            scored = torch.arange(n) + k + 2 >= example.prompt_len
            before = torch.stack([sequence[j + 1:j + 1 + n] for j in range(k + 1)], dim=1)  # [n, k + 1]
            parts[k].append((f[:n][scored], f[k + 1:k + 1 + n][scored], sequence[k + 2:k + 2 + n][scored],
                             before[scored]))
    hidden = features[examples[0].prompt_id].shape[1]
    empty = (torch.zeros(0, hidden), torch.zeros(0, hidden), torch.zeros(0, dtype=torch.long),
             torch.zeros(0, 1, dtype=torch.long))
    return [tuple(torch.cat(column) for column in zip(*part)) if part else empty for part in parts]


def medusa_loss(module: MedusaHeads | HydraHeads, rows, reduced_head: torch.nn.Module, to_reduced: torch.Tensor,
                decay: float, embed) -> tuple[torch.Tensor, dict]:
    """Sum over heads of decay^k x the cross-entropy from the target's distribution at the guessed
    position (over the reduced vocabulary) to head k's, through the target's frozen output layer
    (Hydra heads also read the embeddings of the true tokens before their guess: teacher forcing)."""
    total = torch.zeros(())
    stats = {"positions": 0, "top1": 0, "misses": 0, "top1_per_head": [],
             # per head, so that an eval over many batches can pool them: rows, top-1 hits, summed cross-entropy
             "rows_per_head": [], "top1_hits_per_head": [], "cross_entropy_sum_per_head": []}
    for k, (inputs, targets, labels, before) in enumerate(rows):
        stats["rows_per_head"].append(len(labels))
        if not len(inputs):
            stats["top1_per_head"].append(0.0)
            stats["top1_hits_per_head"].append(0)
            stats["cross_entropy_sum_per_head"].append(0.0)
            continue
        prefix = embed(before) if module.hydra else None  # [n, k + 1, H]
        log_q = F.log_softmax(reduced_head(module.run(k, inputs, prefix)), dim=-1)  # [n, K]
        log_p = F.log_softmax(reduced_head(targets), dim=-1)  # [n, K]
        cross_entropy = -(log_p.exp() * log_q).sum(-1)  # [n]
        total = total + decay ** k * cross_entropy.mean()
        reduced = to_reduced[labels]
        top1 = int((log_q.argmax(-1) == reduced)[reduced >= 0].sum())
        stats["top1_per_head"].append(top1 / len(labels))
        stats["top1_hits_per_head"].append(top1)
        stats["cross_entropy_sum_per_head"].append(float(cross_entropy.detach().sum()))
        if k == 0:
            stats.update(positions=len(labels), top1=top1, misses=int((reduced < 0).sum()))
    return total, stats


def medusa_loss_of(module: MedusaHeads | HydraHeads, reduced_head: torch.nn.Module, to_reduced: torch.Tensor,
                   features: dict, cfg: DictConfig, embed) -> Callable[[list[Example]], tuple[torch.Tensor, dict]]:
    def loss_of(examples: list[Example]) -> tuple[torch.Tensor, dict]:
        rows = medusa_rows(examples, features, len(module))
        return medusa_loss(module, rows, reduced_head, to_reduced, float(cfg.medusa_decay), embed)
    return loss_of


@torch.inference_mode()
def evaluate_medusa(module: MedusaHeads | HydraHeads, reduced_head: torch.nn.Module, reduced_ids: torch.Tensor,
                    to_reduced: torch.Tensor, examples: list[Example], features: dict, cfg: DictConfig, embed) -> dict:
    """Head k's top-1 agreement with the target's token k + 2 places on, and the chain acceptance per
    depth of the heads' argmax chain (what `propose` drafts) at every held-out answer position that
    has all of its answer tokens. (A Hydra head reads the true tokens before its guess: up to the
    first wrong draft those are the drafts, and the chain counts no further.) The loss and top-1 run
    over batches of `cfg.batch` tokens: over all held-out rows at once, the [rows, K] log-probabilities
    of a 775-answer split (159K positions, 5.2 GB each) ran a 24 GB machine out of memory."""
    heads = len(module)
    decay = float(cfg.medusa_decay)
    rows_per_head = np.zeros(heads, np.int64)
    hits_per_head = np.zeros(heads, np.int64)
    cross_entropy_per_head = np.zeros(heads)
    scored = top1 = misses = 0  # head 0's scored rows, its top-1 hits, its labels outside the reduced vocabulary
    for batch_ids in example_batches(examples, int(cfg.batch)):
        rows = medusa_rows([examples[i] for i in batch_ids], features, heads)
        _, stats = medusa_loss(module, rows, reduced_head, to_reduced, decay, embed)
        rows_per_head += stats["rows_per_head"]
        hits_per_head += stats["top1_hits_per_head"]
        cross_entropy_per_head += stats["cross_entropy_sum_per_head"]
        scored, top1, misses = scored + stats["positions"], top1 + stats["top1"], misses + stats["misses"]
    loss = sum(decay ** k * cross_entropy_per_head[k] / rows_per_head[k] for k in range(heads) if rows_per_head[k])
    top1_per_head = [float(hits / max(1, n)) for hits, n in zip(hits_per_head, rows_per_head)]
    accepted = np.zeros(heads + 1, np.int64)
    chains = 0
    for example in examples:
        f = torch.from_numpy(np.array(features[example.prompt_id], dtype=np.float32))
        sequence = np.concatenate([example.tokens, example.answer[example.n_pred - 1:]])
        positions = np.arange(max(0, example.prompt_len - 2), min(len(example.tokens) - 1, len(sequence) - heads - 1))
        if not len(positions):
            continue
        ids = torch.from_numpy(sequence)
        prefixes = [embed(torch.stack([ids[positions + 1 + j] for j in range(k + 1)], dim=1)) if module.hydra else None
                    for k in range(heads)]  # [n, k + 1, H]: the root and the tokens before head k's guess
        drafted = np.stack([reduced_ids[reduced_head(module.run(k, f[positions], prefixes[k])).argmax(-1)].numpy()
                            for k in range(heads)], axis=1)  # [n, heads]: the chain each position drafts
        truth = np.stack([sequence[positions + 2 + k] for k in range(heads)], axis=1)  # [n, heads]
        matched = np.cumprod(drafted == truth, axis=1).sum(axis=1)  # [n]
        for count in matched:
            accepted[: count + 1] += 1
        chains += len(positions)
    per_depth = {str(d): float(accepted[d] / max(1, chains)) for d in range(1, heads + 1)}
    return {"positions": scored, "held_out_answers": len(examples), "chains": chains,
            "top1": top1 / max(1, scored), "top1_per_head": top1_per_head,
            "vocab_miss_rate": misses / max(1, scored), "loss": float(loss),
            "acceptance_per_depth": per_depth, "mean_accepted_per_chain": float(sum(per_depth.values())),
            "chain_depth": heads}


# ---- c. eval ------------------------------------------------------------------------------------
@torch.inference_mode()
def evaluate(net: torch.nn.Module, embed, scores: Callable[[torch.Tensor], torch.Tensor], reduced_ids: torch.Tensor,
             depth_one: Callable[[list[Example]], tuple[torch.Tensor, dict]], examples: list[Example],
             committed: dict, cfg: DictConfig, progress: bool) -> dict:
    """Depth-1 top-1 agreement with the target's greedy token over every held-out answer position
    (true features: `depth_one`, the head kind's loss), and greedy chain acceptance per depth on
    `eval_chains` sampled positions: the head reads the target's features of the context
    (`committed`: prompt id -> [len, W]) and drafts `chain_depth` tokens from its own predicted
    features, as the pipeline does (`scores`: feature [H] -> reduced-vocabulary scores [K]); depth d
    counts when its first d tokens all equal the target's answer."""
    from specpipe.kv_cache import PositionIndexedCache

    net.eval()
    positions = top1 = misses = 0
    loss_sum = 0.0
    for batch_ids in example_batches(examples, int(cfg.batch)):
        loss, stats = depth_one([examples[i] for i in batch_ids])
        positions += stats["positions"]
        top1 += stats["top1"]
        misses += stats["misses"]
        loss_sum += float(loss) * stats["positions"]
    depth = int(cfg.chain_depth)
    rng = np.random.default_rng(int(cfg.seed) + 1)
    # context = prompt + answer[:t] (t >= 1: the root is an answer token); the chain drafts answer[t:t + depth]
    candidates = [(e, t) for e in examples for t in range(1, e.n_pred) if t + depth <= len(e.answer)]
    picks = [candidates[i] for i in sorted(rng.choice(len(candidates), size=min(int(cfg.eval_chains), len(candidates)),
                                                      replace=False))]
    accepted = np.zeros(depth + 1, np.int64)
    bar = progress_bar(progress, total=len(picks), unit="chain", desc="eval")
    for example, t in picks:
        context_len = example.prompt_len + t  # tokens s_0 .. s_{L-1}; the root is s_{L-1}
        sequence = np.concatenate([example.tokens, example.answer[example.n_pred - 1:]])
        f = torch.from_numpy(np.array(committed[example.prompt_id][:context_len - 1], dtype=np.float32))
        cache = PositionIndexedCache()
        rows = context_len - 1
        ids = torch.from_numpy(sequence[1:context_len])  # [rows]: s_{p+1}
        mask = torch.ones(rows, rows, dtype=torch.bool).tril()
        out = net(embed(ids), f, torch.arange(rows), mask, cache)
        feature = out[-1]
        chain = []
        for step in range(depth):
            token = int(reduced_ids[scores(feature).argmax()])
            chain.append(token)
            if step + 1 < depth:
                position = rows + step
                mask = torch.ones(1, position + 1, dtype=torch.bool)
                feature = net(embed(torch.tensor([token])), feature[None], torch.tensor([position]), mask, cache)[0]
        matched = int(np.cumprod(np.asarray(chain) == example.answer[t:t + depth]).sum())
        accepted[: matched + 1] += 1
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    chains = max(1, len(picks))
    per_depth = {str(d): float(accepted[d] / chains) for d in range(1, depth + 1)}
    return {"positions": positions, "held_out_answers": len(examples), "chains": len(picks),
            "top1": top1 / max(1, positions), "vocab_miss_rate": misses / max(1, positions),
            "loss": loss_sum / max(1, positions), "acceptance_per_depth": per_depth,
            "mean_accepted_per_chain": float(sum(per_depth.values())), "chain_depth": depth}


def format_eval(result: dict, title: str) -> str:
    lines = [f"{title}: {result['positions']} held-out answer positions, {result['chains']} chains",
             f"  top-1 agreement with the target (true features) {result['top1']:.3f}; tokens outside the reduced "
             f"vocabulary {result['vocab_miss_rate']:.3f}; loss {result['loss']:.3f}",
             "  depth  chain acceptance"]
    if "top1_per_head" in result:
        lines.insert(2, "  top-1 per head: " + " ".join(f"{value:.3f}" for value in result["top1_per_head"]))
    lines += [f"  {d:>5}  {value:.3f}" for d, value in result["acceptance_per_depth"].items()]
    lines.append(f"  mean accepted tokens per chain of {result['chain_depth']}: {result['mean_accepted_per_chain']:.3f}")
    return "\n".join(lines)


# ---- the task -----------------------------------------------------------------------------------
def init_layer_state(target, init_layer: int | None) -> dict[str, torch.Tensor] | None:
    """The weights of target layer `init_layer` in transformers' layout (the input norm excepted: the
    head's first layer has none), copied before an engine rewrites the layers into its own modules."""
    if init_layer is None:
        return None
    layers = target.model.layers
    if not 0 <= init_layer < len(layers):
        raise ConfigError(f"train_heads.init_layer={init_layer}: the target has layers 0..{len(layers) - 1}")
    return {k: v.detach().clone() for k, v in layers[init_layer].state_dict().items()
            if not k.startswith("input_layernorm")}


def head_from(folder: str, target, tokenizer) -> EagleNet:
    """The EAGLE-1 head in directory `folder` (the released layout, e.g. the shipped head), in fp32, to
    fine-tune: on features of another dtype, a grown corpus, or with rollouts."""
    path = local_path(folder)
    if not path.is_dir():
        raise ConfigError(f"train_heads.init_from={folder} is not a directory: give an EAGLE-1 head's folder "
                          f"(e.g. data/eagle/smollm2_135m)")
    return read_eagle_net(path, tokenizer, int(target.config.hidden_size), int(target.config.vocab_size),
                          "train_heads.init_from").float()


def trained_head(kind: str, path: Path, target, tokenizer, top_k: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """train_heads.eval_of: the trained head(s) of `kind` in directory `path`, in fp32, and the token
    ids [K] they draft over in the pipeline: EAGLE-3's own draft vocabulary, else the `top_k` most
    frequent tokens of the ranking pinned beside the head (the shipped chat corpus's where none is),
    as drafter.vocab_top_k=top_k drafts."""
    option = "train_heads.eval_of"
    if not path.is_dir():
        raise ConfigError(f"{option}={path} is not a directory: give the folder of a head that "
                          f"`task=train_heads train_heads.kind={kind}` exported (e.g. data/{kind}/smollm2_135m)")
    config = target.config
    vocab = int(config.vocab_size)
    if kind == "eagle":
        net = read_eagle_net(path, tokenizer, int(config.hidden_size), vocab, option).float()
    else:
        what = "EAGLE-3 head" if kind == "eagle3" else "Medusa checkpoint"
        checkpoint, tensors = read_checkpoint(path, option, what, layout=kind)
        check_tokenizer(checkpoint, tokenizer, path, option)
        if kind == "eagle3":
            net = build_eagle3_net(checkpoint, tensors, config, option).float()
            return net, net.target_ids()
        net = build_medusa_heads(checkpoint, tensors, config, option).float()
        if net.own_outputs():
            raise ConfigError(f"{option}={path}: these Medusa heads carry their own output layers; the eval "
                              f"scores heads that share the target's (as train_heads trains them)")
    ids = frequent_ids(tokenizer, vocab, 0 if top_k == vocab else top_k, None, option, pinned_vocab_path(path))
    return net, torch.arange(vocab) if ids is None else ids


def new_head(target, init_state: dict[str, torch.Tensor] | None, layers: int = 1) -> EagleNet:
    """An EAGLE-1 head of `layers` decoder layers shaped like the target's; with `init_state`
    (init_layer_state, one-layer heads only), its decoder layer starts from those weights."""
    config = copy.deepcopy(target.config)
    fields = {k: v for k, v in config.to_dict().items() if k not in ("architectures", "model_type")}
    net = EagleNet(LlamaConfig(**{**fields, "num_hidden_layers": layers}), fc_bias=True)
    if init_state is not None:
        net.layers[0].load_state_dict(init_state)
    return net.float()


def run_train_heads(cfg: DictConfig) -> dict:
    h = cfg.train_heads
    if h.kind not in HEAD_KINDS:
        raise ConfigError(f"train_heads.kind={h.kind!r}: choose one of {', '.join(HEAD_KINDS)}")
    check_task_settings(h, "train_heads", {**{key: AT_LEAST_ONE
                                              for key in ("feature_batch", "medusa_heads", "medusa_layers", "eagle_layers")},
                                           "vocab_top_k": (lambda v: v >= 0 and v == int(v),
                                                           "a whole number >= 0 (0: the full vocabulary)")})
    if h.get("eval_of") and (h.get("init_from") or h.get("init_layer") is not None):
        raise ConfigError("train_heads.eval_of evaluates a trained head and trains nothing: drop train_heads.init_from "
                          "and train_heads.init_layer")
    if h.get("init_from") and (h.kind != "eagle" or h.get("init_layer") is not None):
        raise ConfigError("train_heads.init_from starts an EAGLE-1 head (kind=eagle) from a trained one; it does not "
                          f"combine with kind={h.kind}" + (" or init_layer" if h.kind == "eagle" else ""))
    eagle_layers = int(h.get("eagle_layers") or 1)
    if eagle_layers != 1 and h.kind != "eagle":
        raise ConfigError(f"train_heads.eagle_layers={eagle_layers} sizes an EAGLE-1 head (kind=eagle); kind={h.kind} "
                          f"has its own layout")
    if eagle_layers != 1 and h.get("init_layer") is not None:
        raise ConfigError(f"train_heads.init_layer starts a one-layer head from a target layer; it does not combine with "
                          f"train_heads.eagle_layers={eagle_layers}")
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    torch.manual_seed(int(h.seed))
    loaded = load_model(cfg.model)
    init_state = init_layer_state(loaded.model, None if h.get("init_layer") is None else int(h.init_layer))
    # The features come from the forward the pipeline's target runs (cfg.engine; engines change only
    # the float rounding, like the batch, so the feature cache does not pin it): 1.8x transformers'
    # own forward on SmolLM2 in fp32 with engine=fast.
    build_engine(cfg).apply(loaded.model)
    target, tokenizer = loaded.model.eval(), loaded.tokenizer
    aux_layers = None
    # checked before any feature pass (an out-of-range layer failed mid-extraction); eval_of: the head's own, below
    if h.kind == "eagle3" and (h.get("aux_layers") or not h.get("eval_of")):
        given = {"eagle_aux_hidden_state_layer_ids": list(h.aux_layers)} if h.get("aux_layers") else {}
        aux_layers = aux_layers_of(given, int(target.config.num_hidden_layers), "train_heads.aux_layers")
    corpus = local_path(h.corpus)
    fingerprint = tokenizer_fingerprint(tokenizer)
    examples, system_prompt = read_task_corpus(corpus, "train_heads.corpus", tokenizer, fingerprint["vocab_sha256"],
                                               loaded.name, int(h.max_seq_len), cfg.get("system_prompt"))
    examples = [e for e in examples if e.n_pred >= 2]
    if h.get("limit"):
        examples = examples[: int(h.limit)]
    train, held_out = split_held_out(examples, float(h.eval_fraction))
    if not train or not held_out:
        raise ConfigError(f"the corpus {corpus} gives {len(train)} training and {len(held_out)} held-out answers "
                          f"(eval_fraction={h.eval_fraction}): both must be non-empty")
    folder = package_path(h.checkpoint_dir) if h.get("checkpoint_dir") else cache_root() / "train_heads" / loaded.name
    check_folder(folder, "train_heads.checkpoint_dir")
    out = package_path(h.out) if h.get("out") else package_path(f"data/{h.kind}/{loaded.name}")
    check_folder(out, "train_heads.out")
    vocab = int(target.config.vocab_size)
    top_k = int(h.vocab_top_k) or vocab  # 0: the full vocabulary, as drafter.vocab_top_k=0 means (>= 0: the rules above)
    if top_k > vocab:
        raise ConfigError(f"train_heads.vocab_top_k must be between 0 (the full vocabulary) and {vocab}, "
                          f"got {h.vocab_top_k}")
    # train_heads.eval_of: read (and refused) before any feature pass; an EAGLE-3 head reads its own layers
    evaluated_path = local_path(str(h.eval_of)) if h.get("eval_of") else None
    evaluated = trained_head(h.kind, evaluated_path, target, tokenizer, top_k) if evaluated_path else None
    if evaluated is not None and h.kind == "eagle3" and aux_layers != evaluated[0].aux_layers:
        if h.get("aux_layers"):
            raise ConfigError(f"train_heads.aux_layers={list(h.aux_layers)}: the head in train_heads.eval_of fuses "
                              f"layers {list(evaluated[0].aux_layers)}; drop train_heads.aux_layers")
        aux_layers = evaluated[0].aux_layers
    # train_heads.init_from: read (and refused) before any feature pass too
    initial = head_from(h.init_from, target, tokenizer) if h.get("init_from") else None
    if initial is not None and len(initial.layers) != eagle_layers:
        raise ConfigError(f"train_heads.init_from={h.init_from}: that head has {len(initial.layers)} decoder layer(s), "
                          f"train_heads.eagle_layers={eagle_layers}: set it to {len(initial.layers)} to fine-tune it")
    pad_id = pad_id_of(tokenizer)
    dtype = str(cfg.model.dtype)
    _log(f"{len(train)} training / {len(held_out)} held-out answers "
         f"({sum(e.n_pred for e in train)} / {sum(e.n_pred for e in held_out)} answer positions); "
         f"features in {dtype}; checkpoints in {folder}")
    lock = lock_folder(folder, "train_heads")  # noqa: F841 (held until the run ends)

    # a. features
    cache = FeatureCache(folder / f"features-{dtype}")
    cache_pin = {"version": FEATURES_VERSION, "model": loaded.name, "tokenizer": fingerprint["vocab_sha256"],
                 "dtype": dtype, "system_prompt": system_prompt}
    cache.pin(cache_pin)
    extract_features(target, examples, cache, int(h.feature_batch), pad_id, bool(h.progress))
    features = cache.features()
    check_features(features, examples, cache)
    aux_features = None
    if h.kind == "eagle3":  # its inputs: the hidden states entering three layers (the last ones stay the labels)
        layers = aux_layers
        aux_cache = FeatureCache(folder / f"features-{dtype}-layers-{'-'.join(map(str, layers))}", layers)
        aux_cache.pin({**cache_pin, "layers": list(layers)})
        extract_features(target, examples, aux_cache, int(h.feature_batch), pad_id, bool(h.progress))
        aux_features = aux_cache.features()
        check_features(aux_features, examples, aux_cache)

    # b. train (c. and d. along the way)
    embed = target.get_input_embeddings()
    embed.requires_grad_(False)
    if evaluated is not None:  # c. alone, on a head trained elsewhere: over the vocabulary it drafts with
        net, reduced_ids = evaluated
    else:
        # exported beside the head: the tokens it drafts over. A fine-tune keeps its start's: it drafts what its
        # start did, and a small fine-tuning corpus would rank the vocabulary on too few answers.
        start_ranking = local_path(h.init_from) / VOCAB_FILE if h.get("init_from") else None
        ranking = (read_ranking(start_ranking, tokenizer, vocab, "train_heads.init_from")
                   if start_ranking is not None and start_ranking.is_file() else corpus_ranking(str(corpus), tokenizer))
        reduced_ids = torch.arange(vocab) if top_k == vocab else ranking.top(top_k, "train_heads")[0]
    to_reduced = torch.full((vocab,), -1, dtype=torch.long)
    to_reduced[reduced_ids] = torch.arange(len(reduced_ids))
    # rows [n, H] -> [n, K]: the target's frozen output layer over the reduced vocabulary
    reduced_head = frozen_product(output_weight(target, "train_heads").detach().float()[reduced_ids])

    def evaluate_head() -> dict:
        started = time.perf_counter()
        if h.kind == "eagle":
            def depth_one(examples: list[Example]) -> tuple[torch.Tensor, dict]:
                batch = HeadBatch(examples, features, pad_id)
                predicted = run_net(net, embed, batch.tokens, batch.features, batch.attention_mask())
                return head_loss(predicted, batch, reduced_head, float(h.class_weight), to_reduced)
            result = evaluate(net, embed, reduced_head, reduced_ids, depth_one, held_out,
                              features, h, bool(h.progress))
        elif h.kind == "eagle3":
            def depth_one(examples: list[Example]) -> tuple[torch.Tensor, dict]:
                batch = HeadBatch(examples, features, pad_id, inputs=aux_features)
                return eagle3_loss(net, embed, batch, reduced_head, to_reduced, 1, 1.0)
            result = evaluate(net, embed, net.draft_logits, reduced_ids, depth_one, held_out, aux_features, h,
                              bool(h.progress))
        else:
            result = evaluate_medusa(net, reduced_head, reduced_ids, to_reduced, held_out, features, h, embed)
        result["eval_seconds"] = round(time.perf_counter() - started, 1)
        return result

    if evaluated is not None:
        result = {"head": str(evaluated_path), **evaluate_head()}
        _log(format_eval(result, f"eval of {result['head']}"))
        report_path = folder / f"eval-of-{h.kind}-{dtype}-{hashlib.sha256(result['head'].encode()).hexdigest()[:8]}.json"
        write_json(report_path, {**result, "command": task_command("train_heads"),
                                 "settings": OmegaConf.to_container(h)})
        return {"eval": result, "report": str(report_path)}
    if h.kind == "eagle":
        net = new_head(target, init_state, eagle_layers) if initial is None else initial
        loss_of = eagle_loss_of(net, embed, reduced_head, to_reduced, features, h, pad_id)
    elif h.kind == "eagle3":
        net = new_eagle3_head(target, aux_cache.layers, reduced_ids)
        loss_of = eagle3_loss_of(net, embed, reduced_head, to_reduced, features, aux_features, h, pad_id)
    else:
        heads_class = HydraHeads if h.kind == "hydra" else MedusaHeads
        net = heads_class(int(target.config.hidden_size), int(h.medusa_heads), int(h.medusa_layers))
        net.start_as_medusa()
        loss_of = medusa_loss_of(net, reduced_head, to_reduced, features, h, embed)
    # heads of other depths train beside the one-layer head on the same features
    run_folder = folder / (f"{h.kind}-{dtype}" if eagle_layers == 1 else f"{h.kind}-{eagle_layers}L-{dtype}")
    run_folder.mkdir(parents=True, exist_ok=True)
    trainer = HeadTrainer(net, loss_of, train, h, run_folder)
    if trainer.resume(_log):
        _log(f"resumed from step {trainer.step}")
        if finished := finished_message("train_heads", trainer.step, int(h.steps)):
            _log(finished)
    report_path = run_folder / "report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {"evals": []}

    def run_eval(export: bool) -> dict:
        result = evaluate_head()
        result.update(step=trainer.step, epochs=round(trainer.epochs(), 3), positions_trained=trainer.positions,
                      train_seconds=round(trainer.seconds, 1))
        _log(format_eval(result, f"eval at step {trainer.step}"))
        report["evals"] = [r for r in report["evals"] if r["step"] != trainer.step] + [result]
        report.update(kind=h.kind, model=loaded.name, command=task_command("train_heads"),
                      settings=OmegaConf.to_container(h))
        write_json(report_path, report)
        if export:
            save = {"eagle": save_eagle, "eagle3": save_eagle3, "medusa": save_medusa, "hydra": save_medusa}[h.kind]
            rollouts = rollout_steps(h)
            loss = {"eagle": f"SmoothL1(features) + {h.class_weight} x CE over the top {top_k} tokens" + (
                        f", summed over {rollouts} rollouts weighted {h.rollout_decay}^k" if rollouts > 1 else ""),
                    "eagle3": f"sum over {rollouts} rollouts of {h.rollout_decay}^k x CE from the target's "
                              f"distribution over the {top_k}-token draft vocabulary",
                    "medusa": f"sum over heads of {h.medusa_decay}^k x CE from the target's distribution, top "
                              f"{top_k} tokens"}[h.kind if h.kind != "hydra" else "medusa"]
            pinned = {"ranking": ranking} if h.kind != "eagle3" else {}  # EAGLE-3 carries its own vocabulary
            save(net, out, {
                "target": loaded.name, "vocab_sha256": fingerprint["vocab_sha256"], "feature_dtype": dtype,
                "command": task_command("train_heads"),
                "corpus": {"file": str(h.corpus), "sha256": sha256_file(corpus), "answers": len(examples),
                           "held_out_answers": len(held_out), "eval_fraction": float(h.eval_fraction)},
                "training": {"steps": trainer.step, "epochs": round(trainer.epochs(), 3),
                             "answer_positions": trainer.positions, "seconds": round(trainer.seconds, 1),
                             "loss": loss,
                             "lr": float(h.lr), "batch_tokens": int(h.batch), "max_seq_len": int(h.max_seq_len),
                             "vocab_top_k": top_k, "seed": int(h.seed), "init_layer": h.get("init_layer"),
                             "init_from": h.get("init_from"), "rollout_steps": rollouts,
                             "feature_noise": float(h.feature_noise)},
                "eval": {k: result[k] for k in ("top1", "vocab_miss_rate", "loss", "acceptance_per_depth",
                                                "mean_accepted_per_chain", "chains", "positions")},
            }, **pinned)
            _log(f"exported the {h.kind} head(s) at step {trainer.step} to {out}")
        return result

    if h.eval_init and trainer.step == 0 and not any(r["step"] == 0 for r in report["evals"]):
        run_eval(export=False)
    steps, every, eval_every = int(h.steps), int(h.checkpoint_every), int(h.eval_every)
    bar = progress_bar(bool(h.progress), total=steps, initial=min(trainer.step, steps), unit="step", desc="train")
    window: list[dict] = []
    window_start = time.perf_counter()
    try:
        while trainer.step < steps:
            started = time.perf_counter()
            stats = trainer.train_step()
            trainer.seconds += time.perf_counter() - started
            window.append(stats)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{np.mean([s['loss'] for s in window[-20:]]):.3f}", refresh=False)
            if trainer.step % every == 0 or trainer.step == steps:
                trainer.save()
                positions = sum(s["positions"] for s in window)
                entry = {"step": trainer.step, "loss": float(np.mean([s["loss"] for s in window])),
                         "top1": sum(s["top1"] for s in window) / max(1, positions),
                         "positions_s": round(positions / max(1e-9, time.perf_counter() - window_start), 1)}
                _log(f"step {trainer.step}: loss {entry['loss']:.4f}, train top-1 {entry['top1']:.3f}, "
                     f"{entry['positions_s']:.0f} positions/s, checkpoint saved")
                report.setdefault("train_log", []).append(entry)
                write_json(report_path, report)
                window, window_start = [], time.perf_counter()
            if eval_every and trainer.step % eval_every == 0 and trainer.step < steps:
                run_eval(export=True)
                window_start = time.perf_counter()
    finally:
        if bar is not None:
            bar.close()
    final = next((r for r in report["evals"] if r["step"] == trainer.step), None)
    exported = {}
    if (out / "config.json").is_file():
        exported = (json.loads((out / "config.json").read_text()).get("specpipe") or {}).get("training", {})
    if final is None or exported.get("steps") != trainer.step:
        final = run_eval(export=True)
    return {"step": trainer.step, "out": str(out), "report": str(report_path), "eval": final,
            "train_log": report.get("train_log", [])}
