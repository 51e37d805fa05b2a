"""Capacity-plan arithmetic: what a model needs in memory, on how many devices of a kind it fits, and
what one verify step of q query tokens costs by the roofline of the device, each a function of typed
inputs (an `Architecture`, a `WeightInventory` taken from the model built on the meta device, a
`Hardware`) that `specpipe.tasks.plan_build` composes into the plan of `task=plan`. Placement under a
device map is accelerate's own (`infer_auto_device_map` over `compute_module_sizes`), not a
re-implementation of it. Bytes are exact integers where they are counts of stored elements; a GiB is
2**30 bytes; bandwidths are GB/s (1e9 bytes/s) and peaks TFLOPS (1e12/s), as datasheets print them.
"""
from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

GIB = 1 << 30
FP32_BYTES = 4
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Quantized modes are bitsandbytes' as transformers configures them (`model.quantization=8bit|4bit`):
# 8-bit keeps one fp32 scale per output row of each linear (LLM.int8's SCB); 4-bit one fp32 absmax
# per block of 64 weights (Params4bit's default block, no double quantization: BitsAndBytesConfig's
# default). The output layer and the embeddings stay in the compute dtype, as transformers leaves them.
BNB_SCALE_BYTES = 4
BNB_4BIT_BLOCK = 64


@dataclass(frozen=True)
class Hardware:
    """One device of a kind, as its datasheet (or a measurement here) gives it."""

    name: str
    description: str
    kind: str                          # "gpu" | "cpu"
    memory_gib: float
    bandwidth_gbs: float               # memory read bandwidth
    tflops: Mapping[str, float]        # dense peak per compute dtype (fp32, bf16, ...)
    interconnect_gbs: float | None = None  # device-to-device, both directions together (NVLink's figure)
    max_devices: int | None = None     # None: as many as asked (several nodes)

    def __post_init__(self) -> None:
        if self.kind not in ("gpu", "cpu"):
            raise ValueError(f"hardware {self.name}: kind must be gpu or cpu, got {self.kind!r}")
        if self.memory_gib <= 0 or self.bandwidth_gbs <= 0 or not self.tflops:
            raise ValueError(f"hardware {self.name}: memory_gib, bandwidth_gbs and tflops must be positive")

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)

    def usable_bytes(self, headroom: float) -> int:
        """What a plan may fill: the rest is left to the allocator, the runtime's context and fragmentation."""
        return int(self.memory_bytes * (1.0 - headroom))

    def device_limit(self, asked: int) -> int:
        """The most devices of this kind a plan may use: `asked`, or fewer where the kind has a maximum."""
        return min(asked, self.max_devices or asked)

    def peak_flops(self, dtype: str) -> float:
        if dtype not in self.tflops:
            raise ValueError(f"hardware {self.name} gives no peak for {dtype} (it has {sorted(self.tflops)})")
        return self.tflops[dtype] * 1e12

    @property
    def link_bytes_per_s(self) -> float | None:
        """One direction of the link: a ring all-reduce sends and receives at once, each at half the total."""
        return self.interconnect_gbs * 1e9 / 2 if self.interconnect_gbs else None


@dataclass(frozen=True)
class Architecture:
    """The shape fields of a decoder-only transformer that the plan's arithmetic needs."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, config) -> "Architecture":
        """From a transformers PretrainedConfig (head_dim defaults to hidden / heads, KV heads to heads)."""
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(str(config.model_type), int(config.hidden_size), int(config.intermediate_size),
                   int(config.num_hidden_layers), heads, int(getattr(config, "num_key_value_heads", None) or heads),
                   int(head_dim), int(config.vocab_size), bool(getattr(config, "tie_word_embeddings", False)))


def kv_bytes_per_token(arch: Architecture, dtype_bytes: int) -> int:
    """Keys and values of every layer for one token: 2 x layers x kv_heads x head_dim x bytes."""
    return 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim * dtype_bytes


@dataclass(frozen=True)
class WeightInventory:
    """Unique parameter counts of a model by role (a tied output layer is the embedding's tensor)."""

    total: int
    embedding: int            # nn.Embedding tables: a lookup reads q rows, not the table
    quantizable: int          # nn.Linear weights but the output layer's: what bitsandbytes converts
    streamed: int             # read once per forward: all but embedding tables (a tied output layer reads the table)
    matmul: int               # weights multiplied by every query token: the linears and the output layer
    streamed_split: int       # streamed parameters split across ranks by the model's tp_plan
    split: int                # all parameters split by the tp_plan (the rest is replicated on every rank)
    quantizable_rows: int = 0    # output rows of the quantizable linears (one 8-bit scale each)
    quantizable_blocks: int = 0  # 4-bit blocks of the quantizable linears (one absmax each)

    @property
    def unquantized(self) -> int:
        return self.total - self.quantizable

    @property
    def replicated(self) -> int:
        return self.total - self.split

    @property
    def streamed_replicated(self) -> int:
        return self.streamed - self.streamed_split


def _plan_patterns(tp_plan: Mapping[str, str] | None) -> list[re.Pattern]:
    """transformers' tp_plan keys ("model.layers.*.self_attn.q_proj") as patterns over module names."""
    return [re.compile(re.escape(key).replace(r"\*", r"\d+") + r"$") for key in (tp_plan or {})]


def inventory(model: nn.Module) -> WeightInventory:
    """Counts `model`'s parameters by role; works on the meta device (only shapes are read)."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    patterns = _plan_patterns(getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None))
    roles: dict[int, dict] = {}  # id(parameter) -> what it is; a tied tensor gathers the roles of each owner
    for module_name, module in model.named_modules():
        split = any(pattern.match(module_name) for pattern in patterns)
        for name, parameter in module.named_parameters(recurse=False):
            role = roles.setdefault(id(parameter), {"numel": parameter.numel(), "rows": parameter.shape[0],
                                                    "embedding": False,
                                                    "read": False, "linear_weight": False, "output": False,
                                                    "split": False})
            role["split"] |= split
            if isinstance(module, nn.Embedding):
                role["embedding"] = True
            else:
                role["read"] = True
            if isinstance(module, nn.Linear) and name == "weight":
                role["linear_weight"] = True
                role["output"] |= module is output
    total = embedding = quantizable = streamed = matmul = streamed_split = split = rows = blocks = 0
    for role in roles.values():
        n = role["numel"]
        total += n
        embedding += n if role["embedding"] else 0
        # the output layer and an embedding tied to it stay unquantized, as transformers' quantizers leave them
        if role["linear_weight"] and not role["output"] and not role["embedding"]:
            quantizable += n
            rows += role["rows"]
            blocks += math.ceil(n / BNB_4BIT_BLOCK)
        streamed += n if role["read"] else 0
        matmul += n if role["linear_weight"] else 0
        streamed_split += n if role["read"] and role["split"] else 0
        split += n if role["split"] else 0
    return WeightInventory(total, embedding, quantizable, streamed, matmul, streamed_split, split, rows, blocks)


def weight_bytes(params: int, dtype_bytes: int) -> int:
    return params * dtype_bytes


@dataclass(frozen=True)
class Precision:
    """How a mode stores the weights: the quantizable linears at `bits` (None: everything at
    `dtype_bytes`, which is also the compute dtype and the unquantized tensors' size)."""

    name: str                 # bf16 | fp16 | fp32 | int8 | int4
    dtype_bytes: int
    bits: int | None = None

    def scales(self, inv: WeightInventory) -> int:
        if self.bits is None:
            return 0
        return BNB_SCALE_BYTES * (inv.quantizable_rows if self.bits == 8 else inv.quantizable_blocks)

    def quantized_weights(self, inv: WeightInventory) -> int:
        """The quantizable linears' own bytes, scales not included."""
        return inv.quantizable * self.bits // 8 if self.bits is not None else 0

    def total_bytes(self, inv: WeightInventory) -> int:
        if self.bits is None:
            return weight_bytes(inv.total, self.dtype_bytes)
        return self.quantized_weights(inv) + self.scales(inv) + weight_bytes(inv.unquantized, self.dtype_bytes)

    def streamed_bytes(self, inv: WeightInventory) -> int:
        if self.bits is None:
            return weight_bytes(inv.streamed, self.dtype_bytes)
        # every quantizable weight is streamed: a linear's weight is read whole by each forward
        return self.quantized_weights(inv) + self.scales(inv) \
            + weight_bytes(inv.streamed - inv.quantizable, self.dtype_bytes)


def precision(name: str, compute_dtype: str) -> Precision:
    """bf16 / fp16 / fp32: every tensor in that dtype; int8 / int4: bitsandbytes over `compute_dtype`."""
    if name in DTYPE_BYTES:
        return Precision(name, DTYPE_BYTES[name])
    bits = {"int8": 8, "int4": 4}.get(name)
    if bits is None:
        raise ValueError(f"unknown precision {name!r}: use one of {sorted(DTYPE_BYTES)} or int8, int4")
    return Precision(name, DTYPE_BYTES[compute_dtype], bits)


@dataclass(frozen=True)
class TreeBuffers:
    """The verify forward's own memory for q tree tokens over `context` cached ones."""

    queries: int
    logits: int       # q x vocab fp32 logits (the acceptance rule reads them in fp32)
    activations: int  # q x (hidden + 2 x intermediate): the residual stream and one layer's gate and up products
    mask: int         # q x (context + q) booleans: the tree mask

    @property
    def total(self) -> int:
        return self.logits + self.activations + self.mask


def tree_buffers(arch: Architecture, queries: int, context: int, dtype_bytes: int) -> TreeBuffers:
    return TreeBuffers(queries, queries * arch.vocab_size * FP32_BYTES,
                       queries * (arch.hidden_size + 2 * arch.intermediate_size) * dtype_bytes,
                       queries * (context + queries))


def valid_tensor_parallel(arch: Architecture, limit: int) -> list[int]:
    """Ranks N up to `limit` that split the model evenly: N divides the attention heads, the KV heads,
    the MLP width and the vocabulary (transformers' tp_plan splits each of them N ways)."""
    return [n for n in range(1, limit + 1)
            if not (arch.num_attention_heads % n or arch.num_key_value_heads % n or arch.intermediate_size % n
                    or arch.vocab_size % n)]


@dataclass(frozen=True)
class Fit:
    """Where a mode fits: the fewest devices (None: not within the limit) and each one's bytes there."""

    mode: str
    devices: int | None
    per_device: tuple[int, ...] = ()   # bytes used on each device at that count
    usable: int = 0                    # bytes a device may fill
    detail: str = ""
    placement: Mapping[str, int] = field(default_factory=dict)  # device map (module -> device), device-map modes

    @property
    def fits(self) -> bool:
        return self.devices is not None


def tensor_parallel_fit(inv: WeightInventory, precision: Precision, kv_bytes_total: int, shared_bytes: int,
                        usable: int, ranks: Sequence[int], mode: str = "tensor parallel") -> Fit:
    """The fewest valid ranks N whose per-rank bytes fit: the split weights / N, the replicated ones,
    the KV cache / N (each rank holds its KV heads) and what every rank keeps (tree buffers, draft)."""
    dtype = precision.dtype_bytes
    for n in ranks:
        per_rank = (math.ceil(weight_bytes(inv.split, dtype) / n) + weight_bytes(inv.replicated, dtype)
                    + math.ceil(kv_bytes_total / n) + shared_bytes)
        if per_rank <= usable:
            return Fit(mode, n, (per_rank,) * n, usable)
    return Fit(mode, None, (), usable, f"no valid N in {list(ranks)} fits")


def _device_of(name: str, placement: Mapping[str, int | str]) -> int | str | None:
    best = None
    for key, device in placement.items():
        if key == "" or name == key or name.startswith(key + "."):
            if best is None or len(key) > len(best[0]):
                best = (key, device)
    return best[1] if best else None


def device_map_fit(model: nn.Module, precision: Precision, kv_bytes_per_layer: int, shared_bytes: int,
                   usable: int, limit: int, mode: str = "device map",
                   adjust_max_memory: Callable[[dict], dict] | None = None) -> Fit:
    """The fewest devices accelerate's `infer_auto_device_map` places the whole model on, each
    device keeping room for the KV cache of the layers it holds, the tree buffers and the draft
    (`shared_bytes`) and its share of the quantization scales.

    accelerate places weights only, so the room for the KV cache is given as a per-device budget:
    first the even share, then the KV of the layers each device was given, until the placement
    stops changing. Like transformers' device_map="auto", accelerate also keeps the largest layer's
    size free on device 0 (for offloading, which this plan never does): that is its rule, kept.
    `adjust_max_memory` is what a loader does to those budgets before placing (transformers'
    bitsandbytes quantizers keep 10% back for the buffers quantizing creates)."""
    from accelerate.utils import compute_module_sizes, infer_auto_device_map
    from accelerate.utils.dataclasses import CustomDtype

    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    layer_names = [name for name, module in model.named_modules() if type(module).__name__ in layer_classes]
    dtype, special = _accelerate_dtypes(model, precision, CustomDtype)
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special)
    scales = precision.scales(inventory(model))
    quiet = logging.getLogger("accelerate.utils.modeling")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # it warns that devices 0..N-1 are not on this machine: they need not be
    try:
        for n in range(1, limit + 1):
            fixed = shared_bytes + math.ceil(scales / n)
            kv = [math.ceil(kv_bytes_per_layer * len(layer_names) / n)] * n
            seen = []
            for _ in range(8):
                budgets = {i: max(0, usable - fixed - kv[i]) for i in range(n)}
                if adjust_max_memory is not None:
                    budgets = {i: int(budget) for i, budget in adjust_max_memory(budgets).items()}
                placement = infer_auto_device_map(model, max_memory={**budgets, "cpu": 0}, dtype=dtype,
                                                  special_dtypes=special, no_split_module_classes=list(layer_classes),
                                                  clean_result=False)
                if any(not isinstance(device, int) for device in placement.values()):
                    break  # something went to cpu or disk: n devices are too few
                layers = [sum(_device_of(name, placement) == i for name in layer_names) for i in range(n)]
                weights = [sum(sizes[key] for key, device in placement.items() if device == i) for i in range(n)]
                used = [weights[i] + layers[i] * kv_bytes_per_layer + fixed for i in range(n)]
                if all(u <= usable for u in used):
                    return Fit(mode, n, tuple(used), usable, placement=dict(placement))
                if layers in seen:
                    break
                seen.append(layers)
                kv = [layers[i] * kv_bytes_per_layer for i in range(n)]
    finally:
        quiet.setLevel(level)
    return Fit(mode, None, (), usable, f"does not fit on {limit} device(s)")


def _accelerate_dtypes(model: nn.Module, precision: Precision, custom) -> tuple[object, dict[str, object] | None]:
    """accelerate's (dtype, special_dtypes) for a precision: a quantized mode stores the quantizable
    linears at int8 / int4 (accelerate's CustomDtype.INT4, as transformers' 4-bit quantizer sizes
    them) and every other tensor at the compute dtype."""
    by_bytes = {4: torch.float32, 2: torch.bfloat16}
    compute = by_bytes[precision.dtype_bytes]
    if precision.bits is None:
        return compute, None
    quantized_dtype = {8: torch.int8, 4: custom.INT4}[precision.bits]
    output = model.get_output_embeddings()
    quantized = {id(module.weight) for module in model.modules()
                 if isinstance(module, nn.Linear) and module is not output}
    embedding_ids = {id(module.weight) for module in model.modules() if isinstance(module, nn.Embedding)}
    special = {name: compute for name, tensor in list(model.named_parameters()) + list(model.named_buffers())
               if id(tensor) not in quantized or id(tensor) in embedding_ids}
    return quantized_dtype, special


@dataclass(frozen=True)
class StepCost:
    """One verify forward of `queries` tokens on one device of the plan, by the roofline."""

    queries: int
    bytes: int           # read from memory per device: weights + KV cache
    flops: float         # per device
    memory_ms: float
    compute_ms: float
    comm_ms: float       # tensor parallel: all-reduces and the logits gather at link bandwidth (no latency)

    @property
    def ms(self) -> float:
        return max(self.memory_ms, self.compute_ms) + self.comm_ms

    @property
    def bound(self) -> str:
        return "compute" if self.compute_ms > self.memory_ms else "memory"


@dataclass(frozen=True)
class StepModel:
    """What a verify step reads and computes, per device, as functions of q (ranks = tensor-parallel N)."""

    arch: Architecture
    inv: WeightInventory
    precision: Precision
    context: int
    ranks: int = 1
    weights_read: int | None = None  # bytes an engine is known to stream instead (one device)

    def weight_bytes_read(self) -> int:
        if self.weights_read is not None:
            return self.weights_read
        if self.ranks == 1:
            return self.precision.streamed_bytes(self.inv)
        dtype = self.precision.dtype_bytes  # tensor parallel runs unquantized here
        return math.ceil(weight_bytes(self.inv.streamed_split, dtype) / self.ranks) \
            + weight_bytes(self.inv.streamed_replicated, dtype)

    def kv_bytes_read(self, queries: int) -> int:
        """The cache of `context` tokens plus the q tree tokens' own keys and values, per rank."""
        return math.ceil(kv_bytes_per_token(self.arch, self.precision.dtype_bytes) * (self.context + queries)
                         / self.ranks)

    def flops(self, queries: int) -> float:
        """2 x matmul parameters x q, plus attention: QK^T and AV over context + q keys in every head."""
        arch = self.arch
        attention = 4 * arch.num_hidden_layers * arch.num_attention_heads * arch.head_dim * queries \
            * (self.context + queries)
        return (2 * self.inv.matmul * queries + attention) / self.ranks

    def comm_bytes(self, queries: int) -> float:
        """Bytes one rank sends per step: a ring all-reduce of q x hidden after attention and after the
        MLP of every layer (and after the split embedding lookup), each 2 (N - 1) / N of its size, and
        the gather of the split logits, (N - 1) / N of q x vocab."""
        if self.ranks == 1:
            return 0.0
        n, arch, dtype = self.ranks, self.arch, self.precision.dtype_bytes
        reduces = 2 * arch.num_hidden_layers + 1
        return reduces * 2 * (n - 1) / n * queries * arch.hidden_size * dtype \
            + (n - 1) / n * queries * arch.vocab_size * dtype


def step_cost(model: StepModel, hardware: Hardware, queries: int, compute_dtype: str) -> StepCost:
    read = model.weight_bytes_read() + model.kv_bytes_read(queries)
    flops = model.flops(queries)
    comm = model.comm_bytes(queries)
    link = hardware.link_bytes_per_s
    if comm and not link:
        raise ValueError(f"hardware {hardware.name} has no interconnect_gbs: it cannot run tensor parallel")
    return StepCost(queries, read, flops, read / (hardware.bandwidth_gbs * 1e9) * 1e3,
                    flops / hardware.peak_flops(compute_dtype) * 1e3, comm / link * 1e3 if comm else 0.0)


def ridge_queries(model: StepModel, hardware: Hardware, compute_dtype: str, limit: int = 1 << 20) -> int | None:
    """The fewest query tokens at which a verify step is compute bound (None: not up to `limit`).
    Below it the step's time is the weights' read time: a tree of up to that many tokens is nearly free."""
    def compute_bound(q: int) -> bool:
        return step_cost(model, hardware, q, compute_dtype).bound == "compute"

    if not compute_bound(limit):
        return None
    low, high = 1, limit  # compute grows faster with q than the KV bytes read: one crossing
    if compute_bound(low):
        return low
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if compute_bound(middle) else (middle, high)
    return high


def build_meta_model(config) -> nn.Module:
    """The model a transformers config describes, on the meta device (no memory), weights tied as loaded."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    model.tie_weights()  # init_empty_weights leaves a tied output layer as its own tensor
    return model
