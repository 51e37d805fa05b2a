"""The target's features the heads train on, cached once per corpus answer: the last hidden state (the input
of the output layer) at every position, which every head kind reads and EAGLE-1 predicts, and for EAGLE-3 the
hidden states entering the layers it fuses. They come from the target in the dtype the head will draft
under and through the engine the pipeline verifies with, into resumable shards pinned to the model,
tokenizer, dtype and system prompt (a grown corpus extracts only its new answers)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from specpipe.training.resumable import ExampleShards
from specpipe.errors import ConfigError
from specpipe.training.examples import Example, fill_shards, pad_examples
from specpipe.training.scaffold import task_log

FEATURES_VERSION = 1


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
                     progress: bool, log: Callable[[str], None] = task_log("train_heads")) -> None:
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
    fill_shards(cache, examples, batch_tokens, lambda e: len(e.tokens), arrays, what, progress, log)


def check_features(features: dict[str, np.ndarray], examples: list[Example], cache: FeatureCache) -> None:
    for e in examples:
        if e.prompt_id not in features or len(features[e.prompt_id]) != len(e.tokens):
            raise ConfigError(f"the features in {cache.folder} do not match the corpus (answer {e.prompt_id}); "
                              f"delete that folder and rerun")


def head_features(target, examples: list[Example], folder: Path, dtype: str, pin: dict, aux_layers: tuple[int, ...],
                  batch_tokens: int, pad_id: int, progress: bool,
                  log: Callable[[str], None]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]:
    """prompt id -> the last hidden states [len, H] of every example, extracted where not cached yet in
    `folder/features-<dtype>` (pinned to `pin`: the model, tokenizer and system prompt), and with `aux_layers`
    (EAGLE-3) the hidden states entering those layers [len, 3H] in a second cache beside it (None without)."""
    cache = FeatureCache(folder / f"features-{dtype}")
    cache_pin = {"version": FEATURES_VERSION, **pin, "dtype": dtype}
    cache.pin(cache_pin)
    extract_features(target, examples, cache, batch_tokens, pad_id, progress, log)
    features = cache.features()
    check_features(features, examples, cache)
    if not aux_layers:
        return features, None
    aux_cache = FeatureCache(folder / f"features-{dtype}-layers-{'-'.join(map(str, aux_layers))}", aux_layers)
    aux_cache.pin({**cache_pin, "layers": list(aux_layers)})
    extract_features(target, examples, aux_cache, batch_tokens, pad_id, progress, log)
    aux_features = aux_cache.features()
    check_features(aux_features, examples, aux_cache)
    return features, aux_features
