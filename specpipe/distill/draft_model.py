"""A small draft LM for a Llama target: a few of the target's own decoder layers, fine-tuned.

The draft is a `LlamaForCausalLM` with the target's config but `len(layers)` decoder layers, each
initialised from a copy of one target layer. The token embedding, the final norm and the LM head
are the target's very modules (the same Parameter objects, frozen): only the decoder layers are the
draft's own, so a draft file holds a few MB (bf16) and is only ever loaded around its target.

On disk (`save_draft` / `load_draft`): a safetensors file with the decoder layers only, stored in
bf16, and a JSON sidecar (`path.with_suffix('.json')`) naming the target it belongs to (hidden
size, vocab size, tokenizer fingerprint), the target layers it started from, the command that built
it and its measured acceptance. No pickle anywhere. Built by `python run.py task=distill_draft`.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from specpipe.distill.corpus import write_atomically
from specpipe.errors import ConfigError
from specpipe.paths import DATA_DIR
from specpipe.stores.manifest import tokenizer_fingerprint

DEFAULT_DRAFT_PATH = DATA_DIR / "draft" / "smollm2_135m_draft.safetensors"
FORMAT = "specpipe.draft_model"
FORMAT_VERSION = 1
BUILD_COMMAND = "python run.py task=distill_draft"
STORED_DTYPE = torch.bfloat16
LAYER_PREFIX = "model.layers."


def _check_llama(target: PreTrainedModel) -> None:
    model_type = getattr(getattr(target, "config", None), "model_type", None)
    if not isinstance(target, LlamaForCausalLM) or model_type != "llama":
        raise ConfigError(f"a distilled draft is built from a Llama target (LlamaForCausalLM), not "
                          f"{type(target).__name__} (model_type {model_type!r})")


def _skeleton(target: PreTrainedModel, num_layers: int) -> LlamaForCausalLM:
    """A draft with `num_layers` fresh (uninitialised) decoder layers around the target's shared,
    frozen embedding, final norm and LM head."""
    _check_llama(target)
    if num_layers < 1:
        raise ConfigError(f"a draft needs at least one decoder layer, got {num_layers}")
    config: LlamaConfig = target.config.__class__.from_dict(target.config.to_dict())
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types[:1]) * num_layers
    config._attn_implementation = target.config._attn_implementation
    with torch.device("meta"):  # no memory for an embedding and LM head that are replaced below
        draft = LlamaForCausalLM(config)
    dtype = target.model.embed_tokens.weight.dtype
    device = target.model.embed_tokens.weight.device
    # Fresh layers and rotary tables on the target's device (their layer_idx is their draft index,
    # which the KV cache keys on); the shared modules are the target's own objects.
    draft.model.layers = torch.nn.ModuleList(
        type(target.model.layers[0])(config, i).to(device=device, dtype=dtype) for i in range(num_layers))
    draft.model.rotary_emb = type(target.model.rotary_emb)(config=config).to(device)
    draft.model.embed_tokens = target.model.embed_tokens
    draft.model.norm = target.model.norm
    draft.lm_head = target.lm_head
    for module in (draft.model.embed_tokens, draft.model.norm, draft.lm_head):
        module.requires_grad_(False)
    draft.generation_config = target.generation_config
    return draft


def build_draft(target: PreTrainedModel, layers: Sequence[int]) -> PreTrainedModel:
    """A draft LM whose layer i is a copy of the target's layer `layers[i]`; embedding, final norm and
    LM head are the target's (shared, frozen). The draft's layers are trainable; it is in eval mode."""
    _check_llama(target)
    layers = [int(layer) for layer in layers]
    count = target.config.num_hidden_layers
    if not layers:
        raise ConfigError("distill_draft.layers is empty: name at least one target layer to start from")
    bad = [layer for layer in layers if not 0 <= layer < count]
    if bad:
        raise ConfigError(f"target layer(s) {bad} out of range: the target has {count} layers (0..{count - 1})")
    draft = _skeleton(target, len(layers))
    with torch.no_grad():
        for i, layer in enumerate(layers):
            source = {key: value.detach().clone() for key, value in target.model.layers[layer].state_dict().items()}
            try:
                draft.model.layers[i].load_state_dict(source, strict=True)
            except RuntimeError as error:
                raise ConfigError(f"target layer {layer} does not have a plain Llama layer's weights (was the "
                                  f"target rewritten by a forward engine?): {str(error).splitlines()[0]}") from None
    draft.target_layers = list(layers)
    return draft.eval()


def grow_draft(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path,
               layers: Sequence[int]) -> PreTrainedModel:
    """A deeper draft that starts out computing exactly what the trained draft at `path` computes.

    `layers` names target layers as in `build_draft`; the trained draft's own `target_layers` must be a
    subsequence of them (matched in order, each to the first free one). Those positions take the trained
    weights; the others are copies of their target layers with their two residual outputs (attention
    `o_proj`, MLP `down_proj`) zeroed, so each adds nothing to the residual stream until training moves
    them. Training from here can only start from the trained draft's acceptance, not from scratch."""
    trained = load_draft(target, tokenizer, path)
    layers = [int(layer) for layer in layers]
    source = [int(layer) for layer in trained.target_layers]
    matched, start = [], 0
    for layer in source:
        position = next((i for i in range(start, len(layers)) if layers[i] == layer), None)
        if position is None:
            raise ConfigError(f"distill_draft.init_from={path} was trained from target layers {source}, which are "
                              f"not a subsequence of distill_draft.layers={layers}: keep its layers, in order, and "
                              f"add new ones between or around them (e.g. {sorted(set(source) | {layers[0]})})")
        matched.append(position)
        start = position + 1
    draft = build_draft(target, layers)
    with torch.no_grad():
        for i, layer in enumerate(draft.model.layers):
            if i in matched:
                layer.load_state_dict(trained.model.layers[matched.index(i)].state_dict(), strict=True)
            else:
                for output in (layer.self_attn.o_proj, layer.mlp.down_proj):
                    output.weight.zero_()
                    if output.bias is not None:
                        output.bias.zero_()
    draft.grown_from = {"file": str(path), "target_layers": source, "positions": matched}
    return draft


def layer_state(draft: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The draft's own tensors: its decoder layers, under `model.layers.I.*` keys."""
    return {f"{LAYER_PREFIX}{key}": value for key, value in draft.model.layers.state_dict().items()}


def save_draft(draft: PreTrainedModel, path: str | Path, metadata: dict) -> dict:
    """Writes the draft's decoder layers (bf16 safetensors) to `path` and a JSON sidecar beside it,
    both atomically. `metadata` must hold `base_model` (the target's name) and `tokenizer` (its
    `tokenizer_fingerprint`); `target_layers`, `command`, `training` and `eval` are recorded as given.
    Returns the sidecar dict."""
    path = Path(path)
    missing = [key for key in ("base_model", "tokenizer") if key not in metadata]
    if missing:
        raise ConfigError(f"save_draft needs {missing} in its metadata: a draft file must name its target")
    path.parent.mkdir(parents=True, exist_ok=True)
    from specpipe.stores.manifest import sha256_file

    tensors = {key: value.detach().to("cpu", STORED_DTYPE).contiguous() for key, value in layer_state(draft).items()}
    config = draft.config
    target_layers = list(metadata.get("target_layers", getattr(draft, "target_layers", [])))
    write_atomically(path, lambda tmp: save_file(tensors, str(tmp), metadata={"format": FORMAT,
                                                                               "format_version": str(FORMAT_VERSION)}))
    sidecar = {
        **metadata,
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "base_model": metadata["base_model"],
        "hidden_size": int(config.hidden_size),
        "intermediate_size": int(config.intermediate_size),
        "vocab_size": int(config.vocab_size),
        "num_layers": len(draft.model.layers),
        "target_layers": target_layers,
        "tokenizer": metadata["tokenizer"],
        "stored_dtype": "bf16",
        "shared_with_target": ["model.embed_tokens", "model.norm", "lm_head"],
        "file": path.name,
        "bytes": path.stat().st_size,
        "sha256": sha256_file(path),
    }
    write_atomically(path.with_suffix(".json"),
                      lambda tmp: Path(tmp).write_text(json.dumps(sidecar, indent=1, sort_keys=True) + "\n"))
    return sidecar


def read_draft_metadata(path: str | Path) -> dict:
    """The JSON sidecar of a draft file (ConfigError when the file or its sidecar is missing)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no draft model at {path}: build it with `{BUILD_COMMAND}` (distills a small draft "
                          f"LM from the target; see conf/task/distill_draft.yaml)")
    sidecar = path.with_suffix(".json")
    if not sidecar.is_file():
        raise ConfigError(f"draft file {path} has no sidecar {sidecar.name} (which target it belongs to): "
                          f"rebuild it with `{BUILD_COMMAND}`")
    try:
        info = json.loads(sidecar.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"draft sidecar {sidecar} cannot be read ({error}); rebuild it with "
                          f"`{BUILD_COMMAND}`") from None
    if info.get("format") != FORMAT or info.get("format_version") != FORMAT_VERSION:
        raise ConfigError(f"{sidecar} is not a {FORMAT} v{FORMAT_VERSION} sidecar (format {info.get('format')!r}, "
                          f"version {info.get('format_version')!r}); rebuild it with `{BUILD_COMMAND}`")
    return info


def load_draft(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path) -> PreTrainedModel:
    """The draft saved at `path`, rebuilt around `target`'s shared embedding, final norm and LM head,
    its layers upcast to the target's dtype, in eval mode. Refuses (ConfigError) a draft made for
    another hidden size, vocabulary or tokenizer, or whose file does not hold the layers it claims."""
    _check_llama(target)
    path = Path(path)
    info = read_draft_metadata(path)
    differences = []
    for key, ours in (("hidden_size", target.config.hidden_size), ("vocab_size", target.config.vocab_size)):
        if info.get(key) != ours:
            differences.append(f"{key} {info.get(key)} (draft) vs {ours} (target)")
    theirs, ours = info.get("tokenizer") or {}, tokenizer_fingerprint(tokenizer)
    if (theirs.get("vocab_size"), theirs.get("vocab_sha256")) != (ours["vocab_size"], ours["vocab_sha256"]):
        differences.append(f"tokenizer {theirs.get('vocab_size')} tokens / vocab {theirs.get('vocab_sha256')} (draft) "
                           f"vs {ours['vocab_size']} tokens / vocab {ours['vocab_sha256']} (target)")
    if differences:
        raise ConfigError(f"draft {path} was built for another target ({info.get('base_model')!r}): "
                          f"{'; '.join(differences)}. Build one for this model with `{BUILD_COMMAND} model=...`")
    num_layers = int(info.get("num_layers") or 0)
    try:
        with safe_open(str(path), framework="pt") as handle:
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    except Exception as error:  # safetensors raises its own error types for corrupt headers
        raise ConfigError(f"draft file {path} cannot be read ({str(error).splitlines()[0]}); rebuild it with "
                          f"`{BUILD_COMMAND}`") from None
    stray = sorted(key for key in tensors if not key.startswith(LAYER_PREFIX))
    in_file = sorted({int(key[len(LAYER_PREFIX):].split(".")[0]) for key in tensors if key.startswith(LAYER_PREFIX)})
    if stray or in_file != list(range(num_layers)):
        raise ConfigError(f"draft file {path} holds layers {in_file}{' and ' + str(stray[:3]) if stray else ''} but "
                          f"its sidecar says {num_layers} layer(s): the two files do not belong together; rebuild "
                          f"with `{BUILD_COMMAND}`")
    draft = _skeleton(target, num_layers)
    expected = layer_state(draft)
    if set(expected) != set(tensors):
        missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
        raise ConfigError(f"draft file {path} does not fit this target's layers (missing {missing[:3]}, "
                          f"unexpected {extra[:3]})")
    for key, value in tensors.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise ConfigError(f"draft file {path}: {key} has shape {tuple(value.shape)}, the target's layers need "
                              f"{tuple(expected[key].shape)}")
    dtype = target.model.embed_tokens.weight.dtype
    with torch.no_grad():
        draft.model.layers.load_state_dict(
            {key[len(LAYER_PREFIX):]: value.to(dtype) for key, value in tensors.items()}, strict=True)
    draft.target_layers = list(info.get("target_layers") or [])
    draft.draft_metadata = info
    return draft.eval()
