"""EAGLE-3: the draft layer reads the target's low, middle and high layers and has its own output
layer over a reduced draft vocabulary (Li et al. 2025).

What differs from EAGLE-1 (specpipe.stages.draft.eagle, whose drafter runs both):
- Features: for committed rows the target's hidden states entering three of its layers
  (transformers' `hidden_states[i]`; by default i = 2, L // 2, L - 3 of L layers), side by side
  [3 * hidden] and fused by `fc` (no bias) into one hidden-size vector. The target runner captures
  them (`TargetModel.capture_layers`) in the same prefill and verify forwards. Tree nodes read the
  draft's own output at their parent instead, which is already hidden-size (no `fc`).
- The decoder layer ("midlayer") attends over [input_norm(token embedding), hidden_norm(feature)],
  2 * hidden wide into q/k/v; its residual is the un-normed feature.
- Its output goes through its own `norm` and `lm_head` over `draft_vocab_size` tokens; `d2t` maps
  draft id d to target id d + d2t[d]. No feature regression: the head is trained on tokens, and
  with "training-time test" rollouts on its own outputs (task=train_heads kind=eagle3).

Checkpoints: the released EAGLE-3 layout, read from a local directory: config.json (Llama fields,
`draft_vocab_size`, optionally `eagle_aux_hidden_state_layer_ids` at the top level or under
`eagle_config`) and `fc.weight` [hidden, 3 * hidden], `midlayer.{self_attn,mlp}.*`,
`midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`, `norm.weight`,
`lm_head.weight` [draft_vocab, hidden], `d2t` [draft_vocab] int64; `t2d` and `embed_tokens.weight`
(the base model's) are not used.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import LlamaConfig, PretrainedConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from specpipe.errors import ConfigError
from specpipe.kv_cache import PositionIndexedCache
from specpipe.stages.base import to_full_vocab
from specpipe.stages.draft.eagle import EagleDrafter
from specpipe.stages.draft.head_checkpoint import (check_tokenizer, head_folder, load_fitting, read_checkpoint,
                                                   write_head_folder)
from specpipe.target import SDPA_ATTENTION, TargetModel

DEFAULT_EAGLE3_DIR = "data/eagle3/smollm2_135m"  # the head trained for the embedded model (task=train_heads)
AUX_LAYER_COUNT = 3
UNUSED_KEYS = ("t2d", "embed_tokens.weight")  # the target-vocabulary mask and the base model's embedding


def default_aux_layers(layer_count: int) -> tuple[int, ...]:
    """The layers EAGLE-3 reads when its config names none: low, middle and high (vLLM and SGLang's choice)."""
    return (2, layer_count // 2, layer_count - 3)


class Eagle3MidLayer(nn.Module):
    """EAGLE-3's decoder layer: q/k/v read [input_layernorm(embedding), hidden_norm(feature)]."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.self_attn = LlamaAttention(config, layer_idx=0)
        attention = self.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):  # the same outputs as a Llama layer's, from 2 * hidden inputs
            projection: nn.Linear = getattr(attention, name)
            setattr(attention, name, nn.Linear(2 * hidden, projection.out_features, bias=projection.bias is not None))
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)

    def forward(self, embeds: Tensor, features: Tensor, rotary: tuple[Tensor, Tensor], mask: Tensor | None,
                cache) -> Tensor:
        """embeds, features [b, q, hidden]; mask [b, 1, q, kv] bool or None (causal, no cache) -> [b, q, hidden]."""
        attended, _ = self.self_attn(torch.cat([self.input_layernorm(embeds), self.hidden_norm(features)], dim=-1),
                                     position_embeddings=rotary, attention_mask=mask, past_key_values=cache)
        hidden = features + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Net(nn.Module):
    """fc (3 target layers -> hidden), the midlayer, and the own output layer over the draft vocabulary.
    `forward` returns the pre-norm output: the next row's feature and, through `draft_logits`, the draft."""

    def __init__(self, config: LlamaConfig, aux_layers: tuple[int, ...], draft_vocab_size: int) -> None:
        super().__init__()
        config._attn_implementation = SDPA_ATTENTION  # tree masks go through SDPA, kept off cuDNN's per-shape plans
        self.config = config
        self.aux_layers = tuple(aux_layers)
        hidden = config.hidden_size
        self.fc = nn.Linear(len(self.aux_layers) * hidden, hidden, bias=False)
        self.midlayer = Eagle3MidLayer(config)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))  # draft id -> target id - draft id
        self.rotary_emb = LlamaRotaryEmbedding(config)

    def rows(self, embeds: Tensor, features: Tensor, position_ids: Tensor, mask: Tensor | None, cache=None) -> Tensor:
        """Batched rows: embeds [b, q, hidden]; features [b, q, 3 * hidden] (the target's layers) or
        [b, q, hidden] (the draft's own outputs); position_ids [b, q]; mask [b, 1, q, kv] bool or None
        for causal rows without a cache. Appends q rows to `cache`; returns [b, q, hidden]."""
        if features.shape[-1] != self.config.hidden_size:
            features = self.fc(features)
        rotary = self.rotary_emb(features, position_ids)
        return self.midlayer(embeds, features, rotary, mask, cache)

    def forward(self, embeds: Tensor, features: Tensor, positions: Tensor, mask: Tensor | None,
                cache: PositionIndexedCache | None) -> Tensor:
        """One request's rows (EagleNet's interface): embeds [q, hidden], features [q, 3 * hidden or
        hidden], positions [q], mask [q, kv] bool over the cached rows then these -> [q, hidden]."""
        attention_mask = mask[None, None] if mask is not None else None
        return self.rows(embeds[None], features[None], positions[None], attention_mask, cache)[0]

    def target_ids(self) -> Tensor:
        """[draft_vocab] the target token of each draft id."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def draft_logits(self, hidden: Tensor) -> Tensor:
        """hidden [..., hidden] (pre-norm outputs) -> [..., draft_vocab]."""
        return self.lm_head(self.norm(hidden))


class DraftVocabHead(nn.Module):
    """An Eagle3Net's own output layer as a target-vocabulary head: logits [..., vocab], -inf at
    target tokens outside the draft vocabulary (what EagleDrafter's tree expects of a head)."""

    def __init__(self, net: Eagle3Net, vocab_size: int) -> None:
        super().__init__()
        self.net = net
        self.vocab_size = vocab_size
        self.width = int(net.d2t.shape[0])

    @property
    def target_ids(self) -> Tensor:
        """[draft_vocab] the target token each column of `reduced_logits` scores."""
        return self.net.target_ids()

    def reduced_logits(self, hidden: Tensor) -> Tensor:
        """hidden [..., hidden] -> logits [..., draft_vocab] (draft ids)."""
        return self.net.draft_logits(hidden)

    def forward(self, hidden: Tensor) -> Tensor:
        # hidden [..., hidden] -> logits [..., vocab]: -inf but at the draft vocabulary's tokens
        return to_full_vocab(self.reduced_logits(hidden), self.target_ids, self.vocab_size)


# ---- checkpoints --------------------------------------------------------------------------------
def aux_layers_of(config: dict, layer_count: int, name: str) -> tuple[int, ...]:
    nested = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    layers = config.get("eagle_aux_hidden_state_layer_ids") or nested.get("eagle_aux_hidden_state_layer_ids")
    layers = tuple(int(layer) for layer in layers) if layers else default_aux_layers(layer_count)
    if len(layers) != AUX_LAYER_COUNT or any(not 0 <= layer < layer_count for layer in layers):
        raise ConfigError(f"{name}: the head reads the hidden states entering layers {list(layers)}; the target has "
                          f"{layer_count} layers, and EAGLE-3 fuses {AUX_LAYER_COUNT} of them")
    return layers


def build_eagle3_net(config: dict, tensors: dict[str, Tensor], target_config: PretrainedConfig,
                     name: str) -> Eagle3Net:
    """An Eagle3Net from an EAGLE-3 checkpoint, checked against the target's config (sizes, vocabulary, layers)."""
    keys = set(tensors)
    if "fc.weight" in keys and any(key.startswith("layers.") for key in keys) and "d2t" not in keys:
        raise ConfigError(f"{name}: this is an EAGLE-1 checkpoint (fc.weight, layers.N.*): load it with "
                          f"drafter=eagle (pipeline=eagle)")
    if any("medusa" in key or key.split(".")[0].isdigit() or key.startswith("blocks.") for key in keys):
        raise ConfigError(f"{name}: this looks like a Medusa checkpoint; drafter=eagle3 reads the EAGLE-3 layout: "
                          f"load it with pipeline=medusa")
    required = ("fc.weight", "lm_head.weight", "norm.weight", "d2t")
    missing = [key for key in required if key not in keys]
    if missing or not any(key.startswith("midlayer.") for key in keys):
        raise ConfigError(f"{name}: not an EAGLE-3 checkpoint: it lacks {missing or ['midlayer.*']} (keys: "
                          f"{', '.join(sorted(keys)[:6])}...)")
    hidden = int(target_config.hidden_size)
    vocab_size, layer_count = int(target_config.vocab_size), int(target_config.num_hidden_layers)
    if int(config.get("hidden_size", hidden)) != hidden or int(config.get("target_hidden_size", hidden)) != hidden:
        raise ConfigError(f"{name}: the head's hidden_size is {config.get('hidden_size')} (target_hidden_size "
                          f"{config.get('target_hidden_size')}), the target's {hidden}: this head is for another model")
    vocab = config.get("vocab_size")
    if vocab is not None and int(vocab) != vocab_size:
        raise ConfigError(f"{name}: the head was trained for a vocabulary of {vocab} tokens, the target has "
                          f"{vocab_size}: it is for another model")
    declared = int(config.get("num_hidden_layers", 1))
    if declared != 1:
        raise ConfigError(f"{name}: config.json declares {declared} draft layers; the EAGLE-3 layout holds one "
                          f"(midlayer)")
    layers = aux_layers_of(config, layer_count, name)
    if tuple(tensors["fc.weight"].shape) != (hidden, AUX_LAYER_COUNT * hidden):
        raise ConfigError(f"{name}: the head's fc.weight is {tuple(tensors['fc.weight'].shape)}, the target's hidden "
                          f"size {hidden} needs ({hidden}, {AUX_LAYER_COUNT * hidden}): this head is for another model")
    d2t = tensors["d2t"]
    draft_vocab = int(config.get("draft_vocab_size", d2t.shape[0]))
    if d2t.dtype not in (torch.int64, torch.int32) or tuple(d2t.shape) != (draft_vocab,):
        raise ConfigError(f"{name}: d2t is {d2t.dtype} {tuple(d2t.shape)}, the config's draft_vocab_size needs "
                          f"int64 ({draft_vocab},)")
    mapped = torch.arange(draft_vocab) + d2t.long()
    if int(mapped.min()) < 0 or int(mapped.max()) >= vocab_size or len(set(mapped.tolist())) != draft_vocab:
        raise ConfigError(f"{name}: d2t maps draft ids outside the target's {vocab_size} tokens or two onto "
                          f"one: it is for another vocabulary")
    fields = {key: value for key, value in config.items()
              if key not in ("architectures", "model_type", "specpipe", "eagle_config", "draft_vocab_size",
                             "eagle_aux_hidden_state_layer_ids", "target_hidden_size")}
    net = Eagle3Net(LlamaConfig(**{**fields, "num_hidden_layers": 1, "vocab_size": vocab_size}), layers,
                    draft_vocab)
    state = {key: value for key, value in tensors.items() if key not in UNUSED_KEYS}
    state["d2t"] = d2t.long()
    load_fitting(net, state, name, f"an EAGLE-3 head with a {draft_vocab}-token draft vocabulary")
    return net


def save_eagle3(net: Eagle3Net, folder, extra: dict | None = None, dtype: torch.dtype = torch.bfloat16) -> None:
    """Writes the head in the released EAGLE-3 layout (config.json + model.safetensors; d2t and the
    target-vocabulary mask t2d as integer/bool tensors)."""
    config = net.config.to_dict()
    for key in ("_attn_implementation_autoset", "transformers_version", "torch_dtype", "dtype"):
        config.pop(key, None)
    draft_vocab = int(net.d2t.shape[0])
    config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", draft_vocab_size=draft_vocab,
                  eagle_config={"eagle_aux_hidden_state_layer_ids": list(net.aux_layers)}, specpipe=extra or {})
    tensors = {key: value.detach().to(dtype) for key, value in net.state_dict().items() if key != "d2t"}
    tensors["d2t"] = net.d2t.detach().long()
    t2d = torch.zeros(int(config["vocab_size"]), dtype=torch.bool)
    t2d[net.target_ids()] = True
    tensors["t2d"] = t2d
    write_head_folder(folder, config, tensors)


def load_eagle3(target: TargetModel, tokenizer: PreTrainedTokenizerBase, path: str | None = None,
                name: str = "eagle3", chain_length: int = 5, min_score: float = 0.05,
                context_rows: int | None = None, weight_quantization: str | None = None) -> EagleDrafter:
    """The drafter `drafter=eagle3` configures: `path` = a local EAGLE-3 head directory, or None for
    the head trained for the embedded model (data/eagle3/). Never downloads. Asks the target runner
    to return the hidden states of the head's three layers with every forward."""
    folder = head_folder(path, DEFAULT_EAGLE3_DIR, name, "EAGLE-3 head",
                         "python run.py task=train_heads train_heads.kind=eagle3")
    config, tensors = read_checkpoint(folder, name, "EAGLE-3 head", layout="eagle3")
    check_tokenizer(config, tokenizer, folder, name)
    net = build_eagle3_net(config, tensors, target.model.config, name)
    target.capture_layers(net.aux_layers, name)
    return EagleDrafter(target, net, DraftVocabHead(net, target.vocab_size), name=name, chain_length=chain_length,
                        min_score=min_score, aux_hidden=True, context_rows=context_rows,
                        weight_quantization=weight_quantization)
