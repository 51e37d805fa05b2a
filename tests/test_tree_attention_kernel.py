"""The Triton tree-attention kernel (run by Triton's interpreter: conftest sets TRITON_INTERPRET=1)
against its torch reference, both against an independent path oracle (every node's output is plain
attention over cache + its own root-to-node path), and end to end: `attention=triton` decodes the
same tokens as `attention=sdpa` and as plain greedy decoding.

Sizes stay small (head_dim 16-32, a few heads, short caches): the interpreter is ~1000x slower
than torch."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO, random_prompts, run_cli, run_steps
from specpipe.errors import ConfigError
from specpipe.kernels.hf_adapter import make_attention_forward
from specpipe.kernels.reference import tree_attention_reference
from specpipe.pipelines.builder import build_pipeline, compose_config
from specpipe.target import TREE_ATTENTION, TargetModel, resolve_attention
from specpipe.types import DraftTree
from test_tree_attention import SHAPES, paths, tree_parents


@pytest.fixture(scope="module")
def kernel():
    """The Triton kernel module (importing it registers its attention function)."""
    pytest.importorskip("triton")
    from specpipe.kernels import tree_attention as module

    assert module.INTERPRETED, "conftest sets TRITON_INTERPRET=1 before the kernel module is imported"
    return module


def random_parents(shape: str, n: int, generator: torch.Generator) -> list[int]:
    """Parents (-1 = child of the last committed token, which sits in the cache) of an n-node tree."""
    if shape == "chain":
        return list(range(-1, n - 1))
    if shape == "wide":
        return [-1] * n
    if shape == "random":
        return [int(torch.randint(-1, i, (1,), generator=generator)) if i else -1 for i in range(n)]
    raise ValueError(shape)


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: node i sees node j iff j is an ancestor-or-self of i."""
    return DraftTree.from_parents(torch.zeros(len(parents)), torch.tensor(parents)).mask


@dataclass(frozen=True)
class Case:
    name: str
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    cache_lens: tuple[int, ...] = (13,)
    nodes: int = 7
    shape: str = "random"  # chain | wide | random | causal (tree_mask=None)
    dtype: torch.dtype = torch.float32
    padding: int = 3  # extra keys after the longest sequence, never seen
    options: tuple = ()  # kernel tuning overrides: (("block_n", 16), ...)


CASES = [
    Case("single_node", nodes=1, cache_lens=(9,)),
    Case("single_node_empty_cache", nodes=1, cache_lens=(0,)),
    Case("odd_sizes", heads=3, kv_heads=1, head_dim=24, cache_lens=(37,), nodes=11),
    Case("deep_chain", shape="chain", nodes=40, cache_lens=(21,), options=(("block_m", 16), ("block_n", 16))),
    Case("wide_tree", shape="wide", nodes=33, cache_lens=(5,), options=(("block_n", 16),)),
    Case("gqa_1", heads=2, kv_heads=2, nodes=19, cache_lens=(50,), options=(("block_n", 16),)),
    Case("gqa_3", heads=6, kv_heads=2, nodes=13, cache_lens=(29,), options=(("block_m", 16),)),
    Case("gqa_4", heads=8, kv_heads=2, head_dim=32, nodes=9, cache_lens=(70,)),
    Case("causal_prefill", shape="causal", nodes=45, cache_lens=(0,), options=(("block_m", 16), ("block_n", 16))),
    Case("causal_after_cache", shape="causal", heads=6, kv_heads=2, nodes=10, cache_lens=(23,),
         options=(("block_m", 16),)),
    Case("batch2_cache_lens", cache_lens=(4, 41), nodes=10, padding=6),
    Case("batch2_empty_cache", cache_lens=(0, 17), nodes=6, shape="wide"),
    Case("splits", cache_lens=(90, 33), nodes=12, options=(("num_splits", 3), ("block_n", 16))),
    Case("splits_more_than_blocks", cache_lens=(5,), nodes=4, options=(("num_splits", 4), ("block_n", 16))),
    Case("bf16", dtype=torch.bfloat16, heads=6, kv_heads=2, head_dim=32, cache_lens=(31,), nodes=14),
    Case("bf16_batch2_splits", dtype=torch.bfloat16, cache_lens=(60, 7), nodes=9, options=(("num_splits", 2),)),
    Case("fp16", dtype=torch.float16, heads=4, kv_heads=1, cache_lens=(19,), nodes=8),
]
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
             torch.float16: dict(atol=2e-3, rtol=2e-3)}


def make_inputs(case: Case, seed: int = 0):
    """(query [B, H, q, D], key/value [B, KVH, kv, D], tree_mask [B, q, q] | None, cache_lens [B])."""
    generator = torch.Generator().manual_seed(seed)
    batch, q = len(case.cache_lens), case.nodes
    kv = max(case.cache_lens) + q + case.padding
    query = torch.randn(batch, case.heads, q, case.head_dim, generator=generator)
    key = torch.randn(batch, case.kv_heads, kv, case.head_dim, generator=generator)
    value = torch.randn(batch, case.kv_heads, kv, case.head_dim, generator=generator)
    for b, cache_len in enumerate(case.cache_lens):
        # Padding holds huge values: a kernel that read it would be far off.
        key[b, :, cache_len + q:] = 300.0
        value[b, :, cache_len + q:] = 1e4
    if case.shape == "causal":
        tree_mask = None
    else:
        tree_mask = torch.stack([ancestor_mask(random_parents(case.shape, q, generator)) for _ in case.cache_lens])
    cache_lens = torch.tensor(case.cache_lens, dtype=torch.int32)
    return query.to(case.dtype), key.to(case.dtype), value.to(case.dtype), tree_mask, cache_lens


def path_oracle(query, key, value, tree_mask, cache_lens) -> torch.Tensor:
    """[B, H, q, D] fp32: each node's output from SDPA over its own keys only (cache + ancestors + itself),
    gathered one node at a time, no mask involved."""
    batch, heads, q, _ = query.shape
    group = heads // key.shape[1]
    if tree_mask is None:
        tree_mask = torch.ones(q, q, dtype=torch.bool).tril().expand(batch, q, q)
    out = torch.empty(query.shape, dtype=torch.float32)
    for b in range(batch):
        cache_len = int(cache_lens[b])
        for node in range(q):
            keep = torch.cat([torch.arange(cache_len), cache_len + tree_mask[b, node].nonzero().flatten()])  # [len]
            k = key[b, :, keep].float().repeat_interleave(group, dim=0)  # [H, len, D]
            v = value[b, :, keep].float().repeat_interleave(group, dim=0)  # [H, len, D]
            out[b, :, node] = F.scaled_dot_product_attention(query[b, :, node:node + 1].float(), k, v)[:, 0]
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_kernel_matches_reference(kernel, case):
    query, key, value, tree_mask, cache_lens = make_inputs(case)
    expected = tree_attention_reference(query, key, value, tree_mask, cache_lens)
    out = kernel.tree_attention(query, key, value, tree_mask, cache_lens, **dict(case.options))
    assert out.shape == query.shape and out.dtype == query.dtype
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[case.dtype])


ORACLE_CASES = [case for case in CASES if case.dtype == torch.float32 and case.name in {
    "single_node", "odd_sizes", "deep_chain", "wide_tree", "gqa_3", "causal_after_cache", "batch2_cache_lens", "splits"}]


@pytest.mark.parametrize("case", ORACLE_CASES, ids=lambda case: case.name)
def test_kernel_and_reference_match_path_oracle(kernel, case):
    query, key, value, tree_mask, cache_lens = make_inputs(case, seed=1)
    expected = path_oracle(query, key, value, tree_mask, cache_lens)
    reference = tree_attention_reference(query, key, value, tree_mask, cache_lens)
    torch.testing.assert_close(reference, expected, atol=1e-5, rtol=1e-5)
    out = kernel.tree_attention(query, key, value, tree_mask, cache_lens, **dict(case.options))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_reference_matches_path_oracle_bf16_inputs():
    """The reference computes in fp32 whatever the input dtype: same as the oracle on the same bf16 values."""
    query, key, value, tree_mask, cache_lens = make_inputs(Case("bf16", dtype=torch.bfloat16, cache_lens=(8, 30)))
    expected = path_oracle(query, key, value, tree_mask, cache_lens)
    out = tree_attention_reference(query, key, value, tree_mask, cache_lens)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_query_that_sees_nothing_gets_zeros(kernel):
    """An empty cache and a node hidden from itself (a padded node): zeros, not NaN, in both."""
    query, key, value, tree_mask, cache_lens = make_inputs(Case("x", cache_lens=(0,), nodes=3, shape="chain"))
    tree_mask[0, 2] = False
    for fn in (kernel.tree_attention, tree_attention_reference):
        out = fn(query, key, value, tree_mask, cache_lens)
        assert torch.equal(out[0, :, 2], torch.zeros_like(out[0, :, 2]))
        assert torch.isfinite(out).all()


def test_kernel_takes_strided_inputs(kernel):
    """transformers hands over transposed views (query [B, q, H, D] -> [B, H, q, D]) and mask slices."""
    case = Case("strided", heads=4, kv_heads=2, cache_lens=(12,), nodes=6)
    query, key, value, tree_mask, cache_lens = make_inputs(case)
    query_t = query.transpose(1, 2).contiguous().transpose(1, 2)  # [B, H, q, D], non-contiguous
    big_mask = torch.zeros(1, 9, 20, dtype=torch.bool)
    big_mask[:, 2:8, 5:11] = tree_mask
    out = kernel.tree_attention(query_t, key, value, big_mask[:, 2:8, 5:11], cache_lens)
    torch.testing.assert_close(out, tree_attention_reference(query, key, value, tree_mask, cache_lens),
                               atol=1e-5, rtol=1e-5)


def test_bad_inputs_are_refused(kernel):
    query, key, value, tree_mask, cache_lens = make_inputs(Case("x"))
    with pytest.raises(ValueError, match="exceed"):
        kernel.tree_attention(query, key, value, tree_mask, cache_lens + 100)
    with pytest.raises(ValueError, match="divide"):
        kernel.tree_attention(query[:, :3], key, value, tree_mask, cache_lens)
    with pytest.raises(ValueError, match="tree_mask"):
        tree_attention_reference(query, key, value, tree_mask[:, :2], cache_lens)


class _Attention(torch.nn.Module):
    """What transformers' attention functions read from the attention module."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


@pytest.mark.parametrize("step", ["tree", "prefill", "one_token"])
def test_adapter_matches_transformers_sdpa(kernel, step):
    """The registered attention function returns what transformers' SDPA function returns for the same
    mask: a tree verify (mask built as TargetModel builds it), a causal prefill and a one-token step."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    generator = torch.Generator().manual_seed(4)
    q, cache_len = {"tree": (8, 17), "prefill": (21, 0), "one_token": (1, 30)}[step]
    query = torch.randn(1, q, 6, 16, generator=generator).transpose(1, 2)  # [1, H, q, D] as transformers passes
    key = torch.randn(1, 2, cache_len + q, 16, generator=generator)  # [1, KVH, kv, D]
    value = torch.randn(1, 2, cache_len + q, 16, generator=generator)
    mask = None
    if step == "tree":
        mask = torch.ones(1, 1, q, cache_len + q, dtype=torch.bool)  # [1, 1, q, kv]
        mask[0, 0, :, cache_len:] = ancestor_mask([-1, 0, 0, 1, -1, 4, 2, 6])
    module = _Attention(groups=3)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    for forward in (kernel.tree_attention_forward, make_attention_forward(tree_attention_reference)):
        out, weights = forward(module, query, key, value, mask, scaling=0.3)
        assert weights is None and out.shape == (1, q, 6, 16) and out.is_contiguous()
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_adapter_refuses_a_masked_cache(kernel):
    query, key, value = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 10, 16), torch.randn(1, 2, 10, 16)
    mask = torch.ones(1, 1, 3, 10, dtype=torch.bool)
    mask[0, 0, :, 0] = False  # left padding
    with pytest.raises(ValueError, match="whole cache"):
        kernel.tree_attention_forward(_Attention(1), query, key, value, mask)


@pytest.mark.parametrize("shape", ["chain", "mixed", "two_level"])
def test_target_tree_forward_matches_causal(kernel, tiny_chaotic, shape):
    """TargetModel(attention=triton): every node's logits equal a plain causal forward over its path.

    The causal forwards run on the same model instance (whatever engine rewrote its products) switched
    back to SDPA, so only the attention differs."""
    generator = torch.Generator().manual_seed(7 + SHAPES.index(shape))
    parents = tree_parents(shape, generator)
    context = torch.randint(300, 5000, (23,), generator=generator).tolist()
    tokens = torch.randint(300, 5000, (len(parents),), generator=generator).tolist()
    model = tiny_chaotic.loaded.model
    target = TargetModel(model, name="t", attention="triton")
    assert target.attn_implementation == kernel.TRITON_TREE_ATTENTION
    cache = target.new_cache()
    prefill = target.prefill(context[:-1], cache)
    out = target.forward_tree(context[-1], DraftTree.from_parents(torch.tensor(tokens), torch.tensor(parents)), cache)

    TargetModel(model, name="oracle", attention="sdpa")  # switches the shared model back to SDPA

    def causal_last_logits(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()

    torch.testing.assert_close(prefill.logits[-1], causal_last_logits(context[:-1]), atol=1e-4, rtol=0)
    torch.testing.assert_close(out.logits[0], causal_last_logits(context), atol=1e-4, rtol=0)
    for node, path in enumerate(paths(parents)):
        expected = causal_last_logits(context + [tokens[i] for i in path])
        torch.testing.assert_close(out.logits[node + 1], expected, atol=1e-4, rtol=0,
                                   msg=lambda m: f"node {node} (path {path}): {m}")


@pytest.mark.parametrize("pipeline", ["lookahead_trie", "prompt_lookup"])
def test_pipeline_triton_matches_sdpa_and_greedy(kernel, tiny_mixed, pipeline, monkeypatch):
    launches = []
    launch = kernel._tree_attention_kernel

    class CountingKernel:  # kernel[grid](...) goes through here: proves the pipeline ran the kernel
        def __getitem__(self, grid):
            launches.append(grid)
            return launch[grid]

    monkeypatch.setattr(kernel, "_tree_attention_kernel", CountingKernel())
    triton_pipe = tiny_mixed.pipeline(pipeline, "attention=triton", fresh=True)
    sdpa_pipe = tiny_mixed.pipeline(pipeline, "attention=sdpa", fresh=True)
    assert triton_pipe.decoder.target.attn_implementation == kernel.TRITON_TREE_ATTENTION
    assert sdpa_pipe.decoder.target.attn_implementation == TREE_ATTENTION
    drafted, forwards = 0, 0
    for i, prompt in enumerate(random_prompts(6, seed=3)[1:4]):  # repetitive kinds: drafts get accepted
        tokens, steps = run_steps(triton_pipe, prompt, 10)
        assert tokens == run_steps(sdpa_pipe, prompt, 10)[0], f"prompt {i}"
        assert tokens == tiny_mixed.greedy_hf(prompt, 10), f"prompt {i}"
        drafted += sum(step.drafted for step in steps)
        forwards += len(steps)
    assert drafted > 0  # not vacuous: trees were verified by the kernel
    assert len(launches) >= forwards * tiny_mixed.loaded.model.config.num_hidden_layers


def test_unknown_attention_is_a_config_error(tiny):
    with pytest.raises(ConfigError, match="attention must be one of"):
        TargetModel(tiny.loaded.model, attention="flash")
    with pytest.raises(ConfigError, match="attention must be one of"):
        build_pipeline(compose_config(["model=tiny_random", "pipeline=vanilla", "attention=bogus"]),
                       loaded=tiny.loaded)


def test_triton_without_triton_is_a_config_error(monkeypatch, tiny):
    """Simulates a machine without Triton: `import triton` fails (the kernel module is forgotten too)."""
    import specpipe.kernels

    monkeypatch.setitem(sys.modules, "triton", None)  # None in sys.modules makes the import raise ImportError
    monkeypatch.delitem(sys.modules, "specpipe.kernels.tree_attention", raising=False)
    monkeypatch.delattr(specpipe.kernels, "tree_attention", raising=False)
    with pytest.raises(ConfigError, match="attention=triton needs Triton"):
        TargetModel(tiny.loaded.model, attention="triton")
    with pytest.raises(ConfigError, match="needs Triton"):
        build_pipeline(compose_config(["model=tiny_random", "pipeline=vanilla", "attention=triton"]),
                       loaded=tiny.loaded)
    # auto never needs Triton: SDPA on CPU, and on CUDA too when Triton is missing.
    assert resolve_attention("auto", torch.device("cpu")) == TREE_ATTENTION
    assert resolve_attention("auto", torch.device("cuda")) == TREE_ATTENTION
    assert TargetModel(tiny.loaded.model, attention="auto").attn_implementation == TREE_ATTENTION


def test_triton_on_cpu_without_interpreter_is_a_config_error(monkeypatch, kernel, tiny):
    monkeypatch.setattr(kernel, "INTERPRETED", False)
    with pytest.raises(ConfigError, match="runs on CUDA"):
        TargetModel(tiny.loaded.model, attention="triton")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        kernel.tree_attention(*make_inputs(Case("x")))
    assert resolve_attention("auto", torch.device("cpu")) == TREE_ATTENTION


def test_cli_bad_attention_is_a_clear_error(tmp_path):
    result = run_cli("model=tiny_random", "pipeline=vanilla", "attention=bogus", "max_new_tokens=2", cwd=tmp_path)
    assert result.returncode != 0
    assert "attention must be one of" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def _kernel_bench():
    spec = importlib.util.spec_from_file_location("kernel_bench", REPO / "bench" / "kernel_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kernel_bench_without_cuda_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert _kernel_bench().main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_kernel_bench_row_on_cpu(kernel):
    """A table row's logic (inputs, the check against the reference, timing) on CPU, interpreted, tiny."""
    bench = _kernel_bench()
    args = bench.parse_args(["--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--dtype", "fp32", "--no-flex"])
    row = bench.bench_case(19, 8, args, kernel.tree_attention, tree_attention_reference,
                           lambda fn, **_: 1.0, device="cpu")
    assert row == {"cache": 19, "tree": 8, "triton": 1000.0, "sdpa": 1000.0}


def test_kernel_bench_sweep_rows_on_cpu(kernel):
    """--sweep runs every tuning override and checks each against the reference (interpreted here, where
    upcast=False still upcasts: only a GPU times the 16-bit dots)."""
    bench = _kernel_bench()
    args = bench.parse_args(["--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--dtype", "bf16", "--sweep"])
    rows = bench.sweep_case(40, 6, args, kernel.tree_attention, tree_attention_reference,
                            lambda fn, **_: 0.002, device="cpu")
    assert len(rows) == len(bench.SWEEP)
    assert all(row.startswith("| 40 | 6 | upcast=") and "| 2.0 |" in row for row in rows), rows


COMPILE_SCRIPT = r'''
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from specpipe.kernels import tree_attention as ta

assert not ta.INTERPRETED
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def signature(fn, dtype, causal, constexprs):
    def kind(name):
        if name in constexprs:
            return "constexpr"
        if name in ("q_ptr", "k_ptr", "v_ptr", "o_ptr"):
            return "*" + TYPES[dtype]
        if name == "mask_ptr":
            return "*i32" if causal else "*u8"  # causal: cache_lens stands in for the unused mask
        if name == "cache_lens_ptr":
            return "*i32"
        if name.startswith("part_"):
            return "*fp32"
        return "fp32" if name == "scale_log2" else "i32"
    return {name: kind(name) for name in fn.arg_names}


# (arch, dtype, group * q rows, head_dim, splits, causal, upcast): a Llama-like verify (16-bit dots and
# upcast ones), a prefill, odd heads, fp32
for arch, dtype, rows, head_dim, splits, causal, upcast in [
        (90, torch.bfloat16, 4 * 8, 128, 8, False, True), (90, torch.bfloat16, 4 * 64, 128, 4, False, False),
        (80, torch.bfloat16, 4 * 200, 128, 1, True, True), (80, torch.float16, 4 * 16, 128, 2, False, False),
        (90, torch.float16, 3 * 33, 64, 1, False, True), (90, torch.float32, 4 * 16, 128, 2, False, True)]:
    block_m, block_n, block_d, num_warps = ta._launch_config(rows, head_dim, dtype)
    constexprs = dict(GROUP=4, NUM_SPLITS=splits, CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n,
                      BLOCK_D=block_d, DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32", UPCAST=upcast)
    source = ASTSource(ta._tree_attention_kernel, signature(ta._tree_attention_kernel, dtype, causal, constexprs),
                       constexprs)
    kernel = compile(source, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps, num_stages=2))
    assert kernel.metadata.shared <= 160 * 1024, (arch, dtype, kernel.metadata.shared)  # A100: 164 KB per block
    if splits > 1:
        merge = dict(GROUP=4, NUM_SPLITS=splits, BLOCK_M=block_m, BLOCK_D=block_d)
        compile(ASTSource(ta._merge_splits_kernel, signature(ta._merge_splits_kernel, dtype, False, merge), merge),
                target=GPUTarget("cuda", arch, 32), options=dict(num_warps=4))
print("compiled")
'''


def test_kernel_compiles_for_gpus(kernel, tmp_path):
    """No GPU here, but Triton compiles ahead of time down to cubin (its bundled ptxas) for sm_80 and
    sm_90 with the launch configuration the wrapper would pick: catches what the interpreter lets
    through (types, layouts, shared memory)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    result = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], capture_output=True, text=True, env=env,
                            timeout=300, cwd=REPO)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize("engine", ["fast", "hf"])
def test_a_batch_through_the_triton_kernel_equals_each_sequence_alone(kernel, tiny_mixed, engine):
    """`attention=triton` in a batched forward: each sequence's rows through the kernel over its own cache (the
    ragged batch's attention per sequence), its logits and greedy tokens those of the sequence alone; under
    engine=hf through transformers' own forward, which hands the kernel's adapter the batch."""
    from conftest import random_prompts
    from specpipe.target import VerifyRows

    if engine == "fast":
        pipe = tiny_mixed.pipeline("lookahead_trie", "attention=triton", fresh=True)
    else:  # a model of its own: the shared one runs the lean forward
        pipe = build_pipeline(compose_config([*tiny_mixed.overrides, "pipeline=lookahead_trie", "engine=hf",
                                              "attention=triton", "cost_curve=flat"]))
        pipe.target.model.load_state_dict(tiny_mixed.reference.state_dict())  # the same weights, stock keys
    target = pipe.decoder.target
    generator = torch.Generator().manual_seed(8)
    items, alone = [], []
    for length, nodes in ((20, 3), (9, 0), (31, 5)):
        prompt = torch.randint(300, 1300, (length,), generator=generator).tolist()
        tree = DraftTree.from_parents(torch.randint(300, 1300, (nodes,), generator=generator),
                                      torch.arange(-1, nodes - 1) if nodes else torch.empty(0, dtype=torch.long))
        caches = [target.new_cache(), target.new_cache()]
        for cache in caches:
            target.prefill(prompt[:-1], cache)
        items.append(VerifyRows(prompt[-1], tree, caches[0]))
        alone.append(target.forward_tree(prompt[-1], tree, caches[1]))
    for out, expected in zip(target.forward_trees(items), alone):
        torch.testing.assert_close(out.logits, expected.logits, atol=1e-4, rtol=0)
    prompts = random_prompts(4, seed=12)
    answers = pipe.generate_many(prompts, max_new_tokens=8)
    assert [answer.token_ids for answer in answers] == [tiny_mixed.greedy_hf(prompt, 8) for prompt in prompts]
