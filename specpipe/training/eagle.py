"""Training an EAGLE-1 head: row p reads [embedding(s_{p+1}), f_p] and predicts the target's next feature
f_{p+1}; the loss is EAGLE-1's, SmoothL1 to that feature plus `class_weight` times the cross-entropy from the
target's next-token distribution, both over the reduced vocabulary the head drafts with. With rollouts > 1
the same loss is also taken on rollouts that read the head's own predicted features (EAGLE-3's training-time
test, as HASS applies it to EAGLE heads). A head starts random, from a target layer's weights, or from a
trained head (`head_from`, to fine-tune it)."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from specpipe.errors import ConfigError
from specpipe.paths import local_path
from specpipe.stages.draft.eagle_checkpoint import read_eagle_net, save_eagle
from specpipe.stages.draft.eagle_net import EagleNet
from specpipe.training.eagle3 import labelled_positions, rollout_outputs
from specpipe.training.examples import Example
from specpipe.training.heads import (HeadBatch, HeadInputs, HeadKind, HeadSettings, LossFn, evaluate,
                                     target_log_probs)


def run_net(net: EagleNet, embed: torch.nn.Module, tokens: torch.Tensor, features: torch.Tensor,
            mask: torch.Tensor) -> torch.Tensor:
    """Batched rows without a cache: tokens [b, T], features [b, T, H], mask [b, 1, T, T] -> [b, T, H]."""
    positions = torch.arange(tokens.shape[1])[None].expand(tokens.shape[0], -1)
    return net.rows(embed(tokens), features, positions, mask)


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


def eagle_loss_of(net: EagleNet, inputs: HeadInputs, settings: HeadSettings) -> LossFn:
    class_weight, noise = float(settings.class_weight), float(settings.feature_noise)

    def loss_of(examples: list[Example]) -> tuple[torch.Tensor, dict]:
        batch = HeadBatch(examples, inputs.features, inputs.pad_id)
        features = batch.features
        if noise:  # EAGLE's augmentation: the head drafts from its own, imperfect features
            features = features + (torch.rand_like(features) * 2 - 1) * noise
        if settings.rollouts > 1:
            return eagle_rollout_loss(net, inputs.embed, batch, features, inputs.reduced_head, class_weight,
                                      inputs.to_reduced, settings.rollouts, float(settings.rollout_decay))
        predicted = run_net(net, inputs.embed, batch.tokens, features, batch.attention_mask())
        return head_loss(predicted, batch, inputs.reduced_head, class_weight, inputs.to_reduced)
    return loss_of


def evaluate_eagle(net: EagleNet, inputs: HeadInputs, examples: list[Example], settings: HeadSettings) -> dict:
    """The eval (`heads.evaluate`): depth 1 is the loss on the target's own features, without rollouts."""
    def depth_one(batch_examples: list[Example]) -> tuple[torch.Tensor, dict]:
        batch = HeadBatch(batch_examples, inputs.features, inputs.pad_id)
        predicted = run_net(net, inputs.embed, batch.tokens, batch.features, batch.attention_mask())
        return head_loss(predicted, batch, inputs.reduced_head, float(settings.class_weight), inputs.to_reduced)
    return evaluate(net, inputs.embed, inputs.reduced_head, inputs.reduced_ids, depth_one, examples, inputs.features,
                    settings, settings.progress)


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


def new_head(target, init_state: dict[str, torch.Tensor] | None, layers: int = 1) -> EagleNet:
    """An EAGLE-1 head of `layers` decoder layers shaped like the target's; with `init_state`
    (init_layer_state, one-layer heads only), its decoder layer starts from those weights."""
    config = copy.deepcopy(target.config)
    fields = {k: v for k, v in config.to_dict().items() if k not in ("architectures", "model_type")}
    net = EagleNet(LlamaConfig(**{**fields, "num_hidden_layers": layers}), fc_bias=True)
    if init_state is not None:
        net.layers[0].load_state_dict(init_state)
    return net.float()


def loss_text(settings: HeadSettings) -> str:
    rollouts = (f", summed over {settings.rollouts} rollouts weighted {settings.rollout_decay}^k"
                if settings.rollouts > 1 else "")
    return f"SmoothL1(features) + {settings.class_weight} x CE over the top {settings.top_k} tokens" + rollouts


EAGLE = HeadKind(new_net=lambda target, inputs, settings, init_state: new_head(target, init_state,
                                                                               settings.eagle_layers),
                 loss_of=eagle_loss_of, evaluate=evaluate_eagle, save=save_eagle, loss_text=loss_text)
