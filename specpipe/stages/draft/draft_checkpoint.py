"""Loading the model `drafter=draft_model` drafts with, never downloading: a .safetensors draft written by
`task=distill_draft` (specpipe.distill.draft_model; the one distilled for the embedded model by default), read
with the target's tokenizer, or a local Hugging Face model directory (any causal LM), whose own tokenizer must be
the target's before anything counts tokens by the target's ids; a head folder given there is refused with the
pipeline it belongs to. Beside the weights lies the vocabulary ranking pinned for the draft
(specpipe.stages.draft.draft_vocab.pinned_vocab_path), which the reduced output layer reads first.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from specpipe.errors import ConfigError
from specpipe.paths import local_path
from specpipe.stages.draft.draft_vocab import pinned_vocab_path
from specpipe.stages.draft.head_checkpoint import folder_layout, wrong_layout

if TYPE_CHECKING:
    from specpipe.target import TargetModel


def load_draft_model(target: TargetModel, tokenizer: PreTrainedTokenizerBase, path: str | None, name: str
                     ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None, Path]:
    """The draft model at `path` (a .safetensors draft, a local model directory, or None for the draft distilled
    for the embedded model), its own tokenizer (None for a draft file: it uses the target's) and where the
    vocabulary ranking pinned for it would lie."""
    if path is None or Path(path).suffix == ".safetensors":
        from specpipe.distill.draft_model import DEFAULT_DRAFT_PATH, load_draft

        file = local_path(path) if path else DEFAULT_DRAFT_PATH
        draft = load_draft(target.model, tokenizer, file)
        draft_tokenizer, pinned = None, pinned_vocab_path(file)
    else:
        (draft, draft_tokenizer), pinned = _load_local(path, target, name), pinned_vocab_path(local_path(path))
        from specpipe.pipelines.builder import check_same_tokenizer

        check_same_tokenizer(tokenizer, draft_tokenizer, name)  # before anything counts tokens by the target's ids
    return draft, draft_tokenizer, pinned


def _load_local(path: str, target: TargetModel, name: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = local_path(path)
    layout = folder_layout(folder)
    if layout is not None:  # a head folder: transformers would load it as a model with random layers
        raise wrong_layout(name, folder, layout, "draft_model")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{name}: drafter.path={path} is not a local model directory (no config.json there) "
                          f"nor a .safetensors draft: give a directory saved with save_pretrained, or a draft "
                          f"file from `python run.py task=distill_draft`")
    try:
        draft = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=target.dtype).to(target.device).eval()
        draft_tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as error:
        said = " ".join(str(error).split())  # transformers' messages run over several lines
        raise ConfigError(f"{name}: cannot load the draft model from drafter.path={path}: "
                          f"{said[:400]}") from None
    return draft, draft_tokenizer
