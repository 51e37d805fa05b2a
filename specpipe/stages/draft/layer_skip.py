"""Self-speculative drafting (Draft & Verify, LayerSkip): the target drafts for itself with a
subset of its own layers, then its own final norm and output layer.

The draft shares the target's modules (no copy of any weight, and whatever the forward engine
did to them), and keeps its own KV cache: the kept layers see other inputs than in the full
model, so their keys and values differ from the target's. That cache stores the kept layers
under the target's layer indices, which the shared attention modules write with.
"""
from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path

from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from specpipe.errors import ConfigError
from specpipe.kv_cache import PositionIndexedCache
from specpipe.stages.draft.draft_model import DraftModelDrafter
from specpipe.stages.draft.reduced_vocab import reduce_vocabulary
from specpipe.target import TargetModel


class LayerSubsetCache(PositionIndexedCache):
    """A position-indexed cache for the kept layers only, addressed by their index in the target."""

    def __init__(self, layers: Sequence[int]) -> None:
        super().__init__()
        self.local = {layer: index for index, layer in enumerate(layers)}

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        return super().update(key_states, value_states, self.local[layer_idx], *args, **kwargs)


def share_modules(module: nn.Module) -> nn.Module:
    """A copy of `module` that shares every parameter, buffer and child, with its own child table."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    return clone


def layer_subset_model(target: PreTrainedModel, layers: Sequence[int]) -> PreTrainedModel:
    """The target's causal LM running only `layers` (ascending target indices) between its own
    embedding and its own final norm and output layer. Shares every module with the target."""
    decoder = getattr(target, "model", None)
    blocks = getattr(decoder, "layers", None)
    if not isinstance(blocks, nn.ModuleList):
        raise ConfigError(f"drafter=layer_skip needs a decoder-only model with `model.layers` (Llama, Qwen, "
                          f"Mistral, ...), not {type(target).__name__}")
    count = len(blocks)
    layers = [int(layer) for layer in layers]
    if not layers or layers != sorted(set(layers)) or not all(0 <= layer < count for layer in layers):
        raise ConfigError(f"drafter.layers must be distinct ascending indices of the target's {count} layers "
                          f"(0..{count - 1}), got {layers}")
    if len(layers) == count:
        raise ConfigError(f"drafter.layers keeps all {count} layers: the draft would cost what the target costs")
    draft = share_modules(target)
    draft.model = share_modules(decoder)
    draft.model.layers = nn.ModuleList([blocks[layer] for layer in layers])
    draft.kept_layers = layers
    return draft


def load_layer_skip(target: TargetModel, tokenizer: PreTrainedTokenizerBase, layers: Sequence[int] | str,
                    name: str = "layer_skip", chain_length: int = 5, min_score: float = 0.05,
                    vocab_top_k: int = 0, vocab_counts: str | None = None, keep: int | None = None,
                    search: str | None = None) -> DraftModelDrafter:
    """The drafter `drafter=layer_skip` configures (see DraftModelDrafter for chain/tree drafting).

    `layers`: target layer indices, or "searched": the set of `keep` layers that `task=search_layers`
    found for this model (read from `search`, default data/layer_skip/<model>_layers.json). With
    `vocab_top_k`, the draft scores the tokens of the ranking pinned beside that search file
    (`<model>_layers.vocab.npz`, which the task writes) where there is one, so what it drafts does not
    move with the shipped chat corpus; `vocab_counts` still wins."""
    from specpipe.stages.draft.draft_vocab import pinned_vocab_path
    from specpipe.stages.draft.layer_search_file import searched_layers_path

    search_file = Path(search) if search else searched_layers_path(target.name)
    if isinstance(layers, str):
        if layers != "searched":
            raise ConfigError(f"drafter.layers must be a list of layer indices or 'searched', got {layers!r}")
        if keep is None:
            raise ConfigError("drafter.layers=searched needs drafter.keep: how many layers the draft keeps")
        from specpipe.stages.draft.layer_search_file import read_searched_layers
        from specpipe.stores.manifest import tokenizer_fingerprint

        layers = read_searched_layers(search_file, target.name, tokenizer_fingerprint(tokenizer)["vocab_sha256"],
                                      int(keep))
    draft = layer_subset_model(target.model, layers)
    reduce_vocabulary(draft, tokenizer, vocab_top_k, vocab_counts, name, pinned_vocab_path(search_file))
    kept = list(draft.kept_layers)
    return DraftModelDrafter(target, tokenizer, draft, name=name, chain_length=chain_length,
                             min_score=min_score, new_cache=lambda: LayerSubsetCache(kept))
