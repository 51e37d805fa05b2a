"""EAGLE-1's draft network (Li et al. 2024): `EagleNet`, the nn.Module that the drafter stage
(specpipe.stages.draft.eagle) runs, task=train_heads trains and the checkpoint reader
(specpipe.stages.draft.eagle_checkpoint) builds, kept in a module of its own so that each of them can use it
without the others. Notation: x_p is the token at position p and f_p the target's feature there (its last
hidden state, the input of its output layer, which chose x_{p+1}). The draft's row for position p reads
[embedding(x_{p+1}), f_p] through `fc` and its decoder layer(s), and predicts f_{p+1}; the target's own
(frozen) output layer turns that prediction into the draft's distribution of x_{p+2}.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from specpipe.engine.blocks import FusedQKVAttention
from specpipe.engine.draft_level import BlockLayers
from specpipe.engine.lean_model import LeanLlamaModel, lean_decoder_layers, norm_function
from specpipe.kv_cache import PositionIndexedCache
from specpipe.target import SDPA_ATTENTION, RaggedBatch


class EagleNet(nn.Module):
    """fc over [token embedding, feature] then Llama decoder layers (the first without its input
    norm, as released EAGLE-1 heads have it); returns the predicted next features.

    Under engine=fast the engine hands it its RMSNorm and attention kernels (`norm_kernel`,
    `attention_kernel`, as to the target's lean forward) and inference runs the layers inline
    (specpipe.engine.lean_model.lean_decoder_layers), without the module calls between the ops, paid
    at every draft level, of which a step runs several. Where the kernel's build multiplies
    weights in column blocks it also hands `layer_kernel`, and a bf16 head's layers run one kernel call
    each (specpipe.engine.draft_level.BlockLayers)."""

    accepts_lean_kernels = True  # specpipe.engine.lean_model.swap_lean_model sets the six below
    norm_kernel = None
    attention_kernel = None
    ragged_attention_kernel = None  # its attention over several requests' rows (a batch's draft level)
    attention_max_rows = LeanLlamaModel.attention_max_rows
    # the kernel's whole decoder layer over column blocks (bf16 on AVX512_BF16 CPUs), run through BlockLayers
    layer_kernel = None
    rotary_lookup = None  # RotaryTables over rotary_emb (specpipe.engine.rotary)
    # the kernel's whole draft level (fc, the layers, the output layer's log-probs), which EagleDrafter runs through
    # specpipe.engine.draft_level.KernelDraftLevel where every part is served
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
