"""Which of the target's own layers `drafter=layer_skip` keeps, chosen on data.

Draft & Verify picks the skipped layers with Bayesian optimisation, SWIFT with a random search
on the fly; both score a candidate set by how often the subset's next-token choice matches the
full model's. This search scores the same thing, teacher-forced: over the target's own greedy
answers (the self-distilled corpus, so the reference token IS the target's choice), the share of
answer positions where the subset's top-1 equals that token. It is a greedy backward elimination:
from the full model it drops, one at a time, the layer whose removal keeps that share highest,
down to `min_layers`. Deterministic, and every size's best-found set is kept, so one run shows
the whole trade-off between layers kept (draft cost) and agreement (acceptance).

Why not evaluate each candidate from scratch: removing layer i leaves every layer before it
unchanged, so each round runs the current set once, records the input of every kept layer, and
runs each candidate only from the removed layer onward (about half the layer forwards).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from specpipe.errors import ConfigError
from specpipe.stages.draft.layer_skip import share_modules


@dataclass(frozen=True)
class ProbeSequence:
    """One teacher-forced sequence: input ids [T], and the answer positions it scores."""

    ids: Tensor        # [T] int64: prompt + answer[:-1]
    positions: Tensor  # [n] int64: input positions whose next token is an answer token
    targets: Tensor    # [n] int64: those answer tokens (the target's own greedy choices)


@dataclass(frozen=True)
class SearchRow:
    layers: tuple[int, ...]   # target layer indices kept, ascending
    agreement: float          # share of scored positions where the subset's top-1 equals the target's token
    dropped: int | None       # the layer removed from the previous row's set (None: the full model)


class AgreementProbe:
    """Teacher-forced top-1 agreement of a subset of the target's layers with the target's greedy tokens.

    `vocab_ids` [k] restricts the argmax to those tokens, as the drafter's reduced output layer does
    (None: the whole vocabulary)."""

    def __init__(self, model: PreTrainedModel, sequences: Sequence[ProbeSequence],
                 vocab_ids: Tensor | None = None) -> None:
        decoder = getattr(model, "model", None)
        if not isinstance(getattr(decoder, "layers", None), nn.ModuleList):
            raise ConfigError(f"the layer search needs a decoder-only model with `model.layers` (Llama, Qwen, "
                              f"Mistral, ...), not {type(model).__name__}")
        if not sequences or not any(len(s.targets) for s in sequences):
            raise ConfigError("the layer search got no answer positions to score")
        self.model, self.decoder, self.sequences = model, decoder, list(sequences)
        self.layer_count = len(decoder.layers)
        weight = model.get_output_embeddings().weight.detach()  # [vocab, hidden]
        self.vocab_ids = vocab_ids
        self.head = weight if vocab_ids is None else weight[vocab_ids]  # [k, hidden]
        self.positions = sum(len(s.targets) for s in self.sequences)

    def _decoder(self, layers: Sequence[int]) -> nn.Module:
        decoder = share_modules(self.decoder)
        decoder.layers = nn.ModuleList([self.decoder.layers[layer] for layer in layers])
        return decoder

    def _matches(self, hidden: Tensor, sequence: ProbeSequence) -> int:
        # hidden [1, T, hidden] after the final norm -> count of positions whose top-1 is the target's
        chosen = (hidden[0, sequence.positions] @ self.head.T).argmax(-1)  # [n]
        if self.vocab_ids is not None:
            chosen = self.vocab_ids[chosen]
        return int((chosen == sequence.targets).sum())

    @torch.inference_mode()
    def agreement(self, layers: Sequence[int]) -> float:
        """The share for `layers`, each sequence run from its token ids."""
        decoder = self._decoder(layers)
        matches = sum(self._matches(decoder(input_ids=s.ids[None], use_cache=False).last_hidden_state, s)
                      for s in self.sequences)
        return matches / self.positions

    @torch.inference_mode()
    def _layer_inputs(self, layers: Sequence[int], sequence: ProbeSequence) -> list[Tensor]:
        """The hidden state entering each of `layers` when the subset runs `sequence`: [len(layers)] x [1, T, hidden]."""
        inputs: list[Tensor] = []

        def record(module, args, kwargs):
            inputs.append((args[0] if args else kwargs["hidden_states"]).detach())

        decoder = self._decoder(layers)
        hooks = [layer.register_forward_pre_hook(record, with_kwargs=True) for layer in decoder.layers]
        try:
            decoder(input_ids=sequence.ids[None], use_cache=False)
        finally:
            for hook in hooks:
                hook.remove()
        return inputs

    @torch.inference_mode()
    def check_resumable(self) -> None:
        """Running the model from the embedding output passed as `inputs_embeds` must equal running it
        from token ids: the search relies on it (models that rescale `inputs_embeds` would break it)."""
        sequence = self.sequences[0]
        layers = list(range(self.layer_count))
        decoder = self._decoder(layers)
        direct = decoder(input_ids=sequence.ids[None], use_cache=False).last_hidden_state
        resumed = decoder(inputs_embeds=self._layer_inputs(layers, sequence)[0], use_cache=False).last_hidden_state
        if not torch.allclose(direct, resumed, atol=1e-4, rtol=1e-4):
            raise ConfigError(f"the layer search resumes a forward from a hidden state through `inputs_embeds`, "
                              f"and {type(self.model).__name__} does not treat `inputs_embeds` as the first layer's "
                              f"input (max difference {float((direct - resumed).abs().max()):.3g})")

    @torch.inference_mode()
    def agreement_without_each(self, layers: Sequence[int],
                               progress: Callable[[], None] | None = None) -> list[float]:
        """The share for `layers` minus each one of them in turn: [len(layers)]."""
        matches = [0] * len(layers)
        for sequence in self.sequences:
            inputs = self._layer_inputs(layers, sequence)
            for index in range(len(layers)):
                # Without layers[index], the layers after it see what it saw.
                rest = self._decoder(layers[index + 1:])
                hidden = rest(inputs_embeds=inputs[index], use_cache=False).last_hidden_state
                matches[index] += self._matches(hidden, sequence)
                if progress is not None:
                    progress()
        return [count / self.positions for count in matches]


def backward_elimination(probe: AgreementProbe, min_layers: int,
                         progress: Callable[[], None] | None = None) -> list[SearchRow]:
    """Rows from the full model down to `min_layers` kept layers, one layer dropped per row."""
    count = probe.layer_count
    if not 1 <= min_layers < count:
        raise ConfigError(f"min_layers must be between 1 and {count - 1} (the model has {count} layers), "
                          f"got {min_layers}")
    probe.check_resumable()
    layers = list(range(count))
    rows = [SearchRow(tuple(layers), probe.agreement(layers), None)]
    while len(layers) > min_layers:
        scores = probe.agreement_without_each(layers, progress)
        # The best share; among equals the deepest layer (cheapest to lose for an early-exit-like draft).
        best = max(range(len(layers)), key=lambda i: (scores[i], i))
        dropped = layers.pop(best)
        rows.append(SearchRow(tuple(layers), scores[best], dropped))
    return rows


def elimination_forwards(layer_count: int, min_layers: int, sequences: int) -> int:
    """How many candidate forwards `backward_elimination` runs (for a progress bar)."""
    return sequences * sum(range(min_layers + 1, layer_count + 1))


def agreement_interval(agreement: float, positions: int) -> float:
    """Half-width of a 95% normal interval on a share measured over `positions` positions."""
    return 1.96 * math.sqrt(max(agreement * (1 - agreement), 1e-12) / max(positions, 1))

