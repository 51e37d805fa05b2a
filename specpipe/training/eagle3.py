"""Training an EAGLE-3 head: its rows read the hidden states entering three target layers (fused by its fc)
and it is trained with EAGLE-3's training-time test, rollouts that read the head's own outputs of the rollout
before, each scored by the cross-entropy from the target's next-token distribution over its draft vocabulary.
The rollout machinery (`rollout_mask`, `rollout_outputs`) is also what EAGLE-1 heads train with when
`rollout_steps` > 1."""
from __future__ import annotations

import copy
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from specpipe.stages.draft.eagle3 import Eagle3Net, save_eagle3
from specpipe.stages.draft.reduced_vocab import output_weight
from specpipe.training.examples import Example
from specpipe.training.heads import (HeadBatch, HeadInputs, HeadKind, HeadSettings, LossFn, evaluate,
                                     target_log_probs)


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


def eagle3_loss_of(net, inputs: HeadInputs, settings: HeadSettings) -> LossFn:
    def loss_of(examples: list[Example]) -> tuple[torch.Tensor, dict]:
        batch = HeadBatch(examples, inputs.features, inputs.pad_id, inputs=inputs.aux_features)
        return eagle3_loss(net, inputs.embed, batch, inputs.reduced_head, inputs.to_reduced, settings.rollouts,
                           float(settings.rollout_decay))
    return loss_of


def evaluate_eagle3(net, inputs: HeadInputs, examples: list[Example], settings: HeadSettings) -> dict:
    """The eval (`heads.evaluate`): depth 1 is rollout 0 of the loss; the chains draft over its own vocabulary."""
    def depth_one(batch_examples: list[Example]) -> tuple[torch.Tensor, dict]:
        batch = HeadBatch(batch_examples, inputs.features, inputs.pad_id, inputs=inputs.aux_features)
        return eagle3_loss(net, inputs.embed, batch, inputs.reduced_head, inputs.to_reduced, 1, 1.0)
    return evaluate(net, inputs.embed, net.draft_logits, inputs.reduced_ids, depth_one, examples, inputs.aux_features,
                    settings, settings.progress)


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


def loss_text(settings: HeadSettings) -> str:
    return (f"sum over {settings.rollouts} rollouts of {settings.rollout_decay}^k x CE from the target's "
            f"distribution over the {settings.top_k}-token draft vocabulary")


EAGLE3 = HeadKind(new_net=lambda target, inputs, settings, init_state: new_eagle3_head(target, inputs.aux_layers,
                                                                                     inputs.reduced_ids),
                  loss_of=eagle3_loss_of, evaluate=evaluate_eagle3, save=save_eagle3, loss_text=loss_text,
                  pins_ranking=False)  # EAGLE-3 carries its own vocabulary
