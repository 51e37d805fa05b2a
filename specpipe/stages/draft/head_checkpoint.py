"""Reading a draft head's checkpoint directory (EAGLE, Medusa) without ever unpickling code.

What can be checked at load is: every floating-point tensor finite, and where specpipe wrote the head
(`write_head_folder`), the weights' SHA-256 its config.json records (`specpipe.weights_sha256`). Weights
overwritten in place, the file's size unchanged, otherwise load as a head that drafts nothing. Released
heads of other projects record no checksum: for them the finiteness check is what is left."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import Tensor

from specpipe.errors import ConfigError
from specpipe.paths import PACKAGE_ROOT, local_path
from specpipe.stages.draft.draft_vocab import TokenRanking, pinned_vocab_path, write_ranking

# Weight files of the released layouts, first found wins (Medusa's own repository names its file
# medusa_lm_head.*).
WEIGHT_FILES = ("model.safetensors", "medusa_lm_head.safetensors", "pytorch_model.bin", "medusa_lm_head.pt",
                "model.pt", "pytorch_model.pt")


# Where config.json records the SHA-256 of the weight file specpipe wrote: {file name: hex}.
CHECKSUM_KEY = "weights_sha256"

# The layouts a draft folder can hold, in messages, and where each pipeline keeps its drafter: a hint must
# work as typed (`drafter=eagle` alone does not compose beside another pipeline's drafter).
LAYOUT_NAMES = {"eagle": "an EAGLE-1 head", "eagle3": "an EAGLE-3 head", "medusa": "Medusa heads",
                "hydra": "Hydra heads", "draft_model": "a draft model"}
PIPELINE_DRAFTER_KEYS = {"eagle": "eagle", "eagle3": "eagle3", "medusa": "medusa", "hydra": "hydra",
                         "draft_model": "model"}
# Tensor names of Medusa's own layout (HEAD.BLOCK.linear.*, HEAD.LAYERS.weight for its output layer, under
# an optional medusa_head(s). prefix), vLLM's converted one, and specpipe's Hydra heads.
MEDUSA_PREFIX = re.compile(r"^medusa_heads?\.")
MEDUSA_ORIGINAL_KEY = re.compile(r"^(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")
MEDUSA_CONVERTED_KEY = re.compile(r"^(?:blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)|lm_heads\.(\d+)\.weight)$")
HYDRA_KEY = re.compile(r"^\d+\.(?:input|blocks\.\d+\.linear)\.(?:weight|bias)$")


def head_layout(keys: set[str], config: dict) -> str | None:
    """Which released head layout a checkpoint's tensor names and config.json are (a LAYOUT_NAMES key),
    or None for none of them (a full model, or something else)."""
    if "d2t" in keys or any(key.startswith("midlayer.") for key in keys):
        return "eagle3"
    if "fc.weight" in keys and any(key.startswith("layers.") for key in keys):
        return "eagle"
    if config.get("hydra") or any(HYDRA_KEY.match(key) for key in keys):
        return "hydra"
    medusa_keys = (MEDUSA_PREFIX.sub("", key) for key in keys)
    if "medusa_num_heads" in config or any(MEDUSA_ORIGINAL_KEY.match(key) or MEDUSA_CONVERTED_KEY.match(key)
                                           for key in medusa_keys):
        return "medusa"
    return None


def wrong_layout(name: str, folder: Path | str, found: str, wanted: str) -> ConfigError:
    """The error for a folder that holds `found` where the drafter reads `wanted` (LAYOUT_NAMES keys)."""
    return ConfigError(f"{name}: {folder} holds {LAYOUT_NAMES[found]}, not {LAYOUT_NAMES[wanted]}: load it with "
                       f"drafter={found}, e.g. `pipeline={found} pipeline.drafters.{PIPELINE_DRAFTER_KEYS[found]}"
                       f".path={folder}`")


def folder_layout(folder: Path) -> str | None:
    """head_layout of a folder's config.json and safetensors names, read without loading any tensor;
    None where they are not there or not readable (the loader's own checks speak then)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    weights = next((folder / file for file in WEIGHT_FILES if (folder / file).is_file()), None)
    keys: set[str] = set()
    if weights is not None and weights.suffix == ".safetensors":
        try:
            from safetensors import safe_open

            with safe_open(str(weights), framework="pt") as handle:
                keys = set(handle.keys())
        except Exception:  # a foreign or truncated file: the loader's own checks report it
            return None
    return head_layout(keys, config if isinstance(config, dict) else {})


def read_checkpoint(folder: Path, name: str, what: str, layout: str | None = None) -> tuple[dict, dict[str, Tensor]]:
    """(config.json as a dict, tensors) of the head directory `folder`; `what` names the head kind
    in messages. `.bin`/`.pt` files go through torch.load(weights_only=True) only. With `layout` (a
    LAYOUT_NAMES key), a folder that holds another released layout is refused, naming the drafter that
    reads it."""
    if not folder.is_dir():
        raise ConfigError(f"{name}: drafter.path={folder} is not a directory: give the local directory of "
                          f"{with_article(what)} (config.json and model.safetensors or pytorch_model.bin)")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"{name}: {folder} has no config.json: {with_article(what)} directory holds its "
                          f"config.json beside its weights")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ConfigError(f"{name}: cannot read {config_path}: {error}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{name}: {config_path} is not a JSON object")
    weights = next((folder / file for file in WEIGHT_FILES if (folder / file).is_file()), None)
    if weights is None:
        raise ConfigError(f"{name}: {folder} holds no weights (looked for {', '.join(WEIGHT_FILES)})")
    _check_recorded_checksum(config, weights, name)
    try:
        if weights.suffix == ".safetensors":
            from safetensors.torch import load_file

            tensors = load_file(weights)
        else:
            tensors = torch.load(weights, map_location="cpu", weights_only=True)
    except Exception as error:  # truncated files, pickles with code in them, foreign formats
        raise ConfigError(f"{name}: cannot read the weights {weights}: {str(error).splitlines()[0]}") from None
    if not isinstance(tensors, dict) or not all(isinstance(t, Tensor) for t in tensors.values()):
        raise ConfigError(f"{name}: {weights} is not a flat dictionary of tensors")
    _check_finite(tensors, weights, name)
    found = head_layout(set(tensors), config)
    if layout is not None and found is not None and found != layout:
        raise wrong_layout(name, folder, found, layout)
    return config, tensors


def _check_recorded_checksum(config: dict, weights: Path, name: str) -> None:
    """Refuses weights whose SHA-256 is not the one config.json recorded for that file (where it records one)."""
    recorded = config.get("specpipe")
    recorded = recorded.get(CHECKSUM_KEY) if isinstance(recorded, dict) else None
    if not isinstance(recorded, dict) or not isinstance(recorded.get(weights.name), str):
        return  # a released head, or one written before checksums were recorded
    from specpipe.stores.manifest import sha256_file

    actual = sha256_file(weights)
    if actual != recorded[weights.name]:
        raise ConfigError(f"{name}: {weights} does not match the SHA-256 its config.json recorded when the head was "
                          f"written ({recorded[weights.name][:16]}..., the file's is {actual[:16]}...): it was damaged "
                          f"or replaced. Restore it (a shipped head: `git checkout -- {weights}`) or train the head again")


def _check_finite(tensors: dict[str, Tensor], weights: Path, name: str) -> None:
    """Refuses weights with a NaN or an infinity: a head with one drafts nothing useful, silently."""
    for key, tensor in tensors.items():
        if tensor.is_floating_point():
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                raise ConfigError(f"{name}: {weights} is damaged: its tensor {key} holds {bad} NaN or infinite "
                                  f"value(s). Restore the file or train the head again")


def with_article(noun: str) -> str:
    """'an EAGLE head', 'a Medusa checkpoint'."""
    return f"{'an' if noun[:1].upper() in 'AEIOU' else 'a'} {noun}"


def head_folder(path: str | None, default: str, name: str, what: str, train: str) -> Path:
    """`path` as a directory, or the shipped `default` (relative to the package folder) when None; a
    missing default says how to train it or where to point `drafter.path`."""
    folder = local_path(path) if path else PACKAGE_ROOT / default
    if path is None and not folder.is_dir():
        raise ConfigError(f"{name}: no {what} ships for this model at {folder}: train one with `{train}`, or set "
                          f"drafter.path=DIR to a released checkpoint's local directory")
    return folder


def check_tokenizer(config: dict, tokenizer, folder: Path, name: str) -> None:
    """Heads specpipe trained record their tokenizer (config.json `specpipe.vocab_sha256`): another
    tokenizer's ids would mean other text."""
    recorded = (config.get("specpipe") or {}).get("vocab_sha256")
    if recorded is None:
        return
    from specpipe.stores.manifest import tokenizer_fingerprint

    if recorded != tokenizer_fingerprint(tokenizer)["vocab_sha256"]:
        raise ConfigError(f"{name}: the head(s) at {folder} were trained for another tokenizer "
                          f"({(config.get('specpipe') or {}).get('target')}): they would draft other text")


def write_head_folder(folder: Path, config: dict, tensors: dict[str, Tensor], ranking: TokenRanking | None = None) -> None:
    """config.json + model.safetensors (+ the `ranking` of draft tokens, `draft_vocab.npz`) into `folder`,
    replacing what was there as a whole: the files are written to a staging folder first, so a reader
    never sees new weights with an old config. config.json records the weights' SHA-256
    (`specpipe.weights_sha256`), which every load compares."""
    import os
    import shutil

    from safetensors.torch import save_file

    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    save_file({key: value.contiguous() for key, value in tensors.items()}, str(staging / "model.safetensors"))
    config = with_weights_checksum(config, staging / "model.safetensors")
    (staging / "config.json").write_text(json.dumps(config, indent=1, default=str))
    if ranking is not None:
        write_ranking(pinned_vocab_path(staging), ranking)
    previous = folder.with_name(f".{folder.name}.old-{os.getpid()}")
    if folder.exists():
        folder.rename(previous)
    staging.rename(folder)
    shutil.rmtree(previous, ignore_errors=True)


def with_weights_checksum(config: dict, weights: Path) -> dict:
    """`config` with the SHA-256 of the weight file `weights` recorded under specpipe.weights_sha256."""
    from specpipe.stores.manifest import sha256_file

    extra = config.get("specpipe")
    extra = dict(extra) if isinstance(extra, dict) else {}
    extra[CHECKSUM_KEY] = {weights.name: sha256_file(weights)}
    return {**config, "specpipe": extra}


def load_fitting(module: torch.nn.Module, state: dict[str, Tensor], name: str, what: str) -> None:
    """Loads `state` into `module` after checking it has exactly the module's keys and shapes; `what`
    names the module the config describes (e.g. "an EAGLE-1 head of 1 layer(s)")."""
    expected = module.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ConfigError(f"{name}: the checkpoint does not fit {what}: missing {missing[:5]}, "
                          f"unexpected {unexpected[:5]}")
    for key, value in state.items():
        if value.shape != expected[key].shape:
            raise ConfigError(f"{name}: {key} is {tuple(value.shape)}, the config makes it {tuple(expected[key].shape)}")
    module.load_state_dict(state)
