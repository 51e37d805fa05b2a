"""Reading and writing EAGLE-1 heads, and where the shipped one lives: `build_eagle_net` / `read_eagle_net`
check a checkpoint against the target and build its EagleNet (specpipe.stages.draft.eagle_net), `save_eagle`
writes one, `default_eagle_dir` picks the shipped head for the target's dtype; the directory handling they
share with the other heads is specpipe.stages.draft.head_checkpoint's. A checkpoint is a directory with
`config.json` (Llama fields of the draft layer) and `model.safetensors` (or `pytorch_model.bin` / `.pt`, read
with `torch.load(weights_only=True)`) in the layout of the released EAGLE-1 heads: `fc.weight`
[hidden, 2 * hidden] (and `fc.bias`), `layers.N.*` Llama decoder layers whose first has no input norm;
`embed_tokens.weight` and `lm_head.weight`, where present, are the base model's and are not used (the
target's own are).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor
from transformers import LlamaConfig
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from specpipe.errors import ConfigError
from specpipe.paths import PACKAGE_ROOT
from specpipe.stages.draft.draft_vocab import TokenRanking
from specpipe.stages.draft.eagle_net import EagleNet
from specpipe.stages.draft.head_checkpoint import check_tokenizer, load_fitting, read_checkpoint, write_head_folder

DEFAULT_EAGLE_DIR = "data/eagle/smollm2_135m"  # the head trained for the embedded model (task=train_heads)
# Where a head trained on the target's features in another dtype ships beside it (DEFAULT_EAGLE_DIR +
# suffix): features, and so what the head learns, differ with the target's rounding.
DTYPE_HEAD_SUFFIX = {torch.bfloat16: "_bf16"}
# Keys of released EAGLE-1 checkpoints that belong to the base model, not the head.
BASE_MODEL_KEYS = ("embed_tokens.weight", "lm_head.weight")


def build_eagle_net(config: dict, tensors: dict[str, Tensor], hidden: int, vocab_size: int, name: str) -> EagleNet:
    """An EagleNet from an EAGLE-1 checkpoint, checked against the target's hidden size and vocabulary."""
    keys = set(tensors)
    if any(key.startswith("midlayer.") for key in keys) or "d2t" in keys:
        raise ConfigError(f"{name}: this is an EAGLE-3 checkpoint (midlayer.*, d2t); drafter=eagle reads the "
                          f"EAGLE-1 layout (fc.weight, layers.N.*): load it with pipeline=eagle3")
    if any("medusa" in key or key.split(".")[0].isdigit() for key in keys):
        raise ConfigError(f"{name}: this looks like a Medusa checkpoint; drafter=eagle reads the EAGLE-1 layout "
                          f"(fc.weight, layers.N.*): load it with pipeline=medusa")
    if "fc.weight" not in keys:
        raise ConfigError(f"{name}: no fc.weight in the checkpoint: not an EAGLE head (keys: "
                          f"{', '.join(sorted(keys)[:6])}...)")
    if tuple(tensors["fc.weight"].shape) != (hidden, 2 * hidden):
        raise ConfigError(f"{name}: the head's fc.weight is {tuple(tensors['fc.weight'].shape)}, the target's hidden "
                          f"size {hidden} needs ({hidden}, {2 * hidden}): this head is for another model")
    if int(config.get("hidden_size", hidden)) != hidden:
        raise ConfigError(f"{name}: the head's hidden_size is {config['hidden_size']}, the target's {hidden}")
    vocab = config.get("vocab_size")
    if vocab is not None and int(vocab) != vocab_size:
        raise ConfigError(f"{name}: the head was trained for a vocabulary of {vocab} tokens, the target has "
                          f"{vocab_size}: it is for another model")
    layer_ids = {int(key.split(".")[1]) for key in keys if key.startswith("layers.")}
    declared = int(config.get("num_hidden_layers", len(layer_ids)))
    if layer_ids != set(range(declared)):
        raise ConfigError(f"{name}: config.json declares {declared} layer(s), the weights hold layers "
                          f"{sorted(layer_ids)}")
    fields = {key: value for key, value in config.items() if key not in ("architectures", "model_type", "specpipe")}
    llama_config = LlamaConfig(**{**fields, "num_hidden_layers": declared, "vocab_size": vocab_size})
    net = EagleNet(llama_config, fc_bias="fc.bias" in keys)
    state = {key: value for key, value in tensors.items() if key not in BASE_MODEL_KEYS}
    load_fitting(net, state, name, f"an EAGLE-1 head of {declared} layer(s)")
    return net


def read_eagle_net(folder: Path, tokenizer: PreTrainedTokenizerBase, hidden: int, vocab_size: int,
                   name: str) -> EagleNet:
    """The EAGLE-1 head in directory `folder`, checked against the tokenizer it was trained for and the
    target's hidden size and vocabulary."""
    config, tensors = read_checkpoint(folder, name, "EAGLE head", layout="eagle")
    check_tokenizer(config, tokenizer, folder, name)
    return build_eagle_net(config, tensors, hidden, vocab_size, name)


def save_eagle(net: EagleNet, folder: Path, extra: dict | None = None, dtype: torch.dtype = torch.bfloat16,
               ranking: TokenRanking | None = None) -> None:
    """Writes the head in the released EAGLE-1 layout (config.json + model.safetensors), with the
    ranking of draft tokens it was trained over (`draft_vocab.npz`) where given."""
    config = net.config.to_dict()
    for key in ("_attn_implementation_autoset", "transformers_version", "torch_dtype", "dtype"):
        config.pop(key, None)
    config.update(architectures=["LlamaForCausalLM"], model_type="llama", bias=net.fc.bias is not None,
                  specpipe=extra or {})
    write_head_folder(folder, config, {key: value.detach().to(dtype) for key, value in net.state_dict().items()},
                      ranking)


def default_eagle_dir(dtype: torch.dtype) -> str:
    """The shipped head for a target in `dtype`: DEFAULT_EAGLE_DIR, or its sibling trained on features in
    that dtype where the package ships one."""
    suffix = DTYPE_HEAD_SUFFIX.get(dtype)
    if suffix and (PACKAGE_ROOT / (DEFAULT_EAGLE_DIR + suffix)).is_dir():
        return DEFAULT_EAGLE_DIR + suffix
    return DEFAULT_EAGLE_DIR
