"""The Engine protocol: how the target model's forward is made fast before decoding starts.

An engine rewrites a loaded model in place (swapping modules; never its modeling code) and
records its name on the model, so one instance is never run under two engines by mistake.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import ContextManager, Protocol, runtime_checkable

from torch import nn

from specpipe.errors import ConfigError

ENGINE_ATTRIBUTE = "specpipe_engine"
# What an engine did to the model, in words: linear kernels, lean blocks, lean forward (part of the
# cost-curve cache key: one engine name can run different code by config or by CPU).
REWRITE_ATTRIBUTE = "specpipe_engine_rewrite"
# Where an engine's products can run on AMX tiles for forwards that permit them: its
# specpipe.engine.cpu_kernel.TileRows (absent elsewhere); see `tiles_permitted`.
TILES_ATTRIBUTE = "specpipe_amx_tiles"
# Where an engine computes every row of a decoding step or verify as a one-row forward would (engine.batch_invariant):
# a ThreadFlag (absent elsewhere), raised by the target for its steps and verifies, not for prefills (which vanilla
# and speculation share); inside it the engine's products take only paths whose per-row sums do not depend on how
# many rows came with the row (never oneDNN's or AMX tiles'), at any row count. See `row_invariant`.
ROW_INVARIANCE_ATTRIBUTE = "specpipe_row_invariance"


@runtime_checkable
class Engine(Protocol):
    name: str

    # quantize: None, "int8" or "auto" for a drafter's weights (specpipe.engine.quantize); an engine that
    # cannot leaves them in the model's dtype (with a warning for "int8"). drafter: the model only drafts (the
    # target verifies what it computes), so the engine may run it in ways that are not bitwise transformers'
    # native: given for the target only (None for a drafter or a stage's modules): its linears in the GGUF blocks of
    # its file by module name (LoadedModel.native, maybe empty), for an engine that multiplies weights as the file
    # holds them or quantizes the target at load; others ignore it
    def apply(self, model: nn.Module, quantize: str | None = None, drafter: bool = False,
              native: dict | None = None) -> nn.Module: ...


def claim_model(model: nn.Module, engine: str) -> bool:
    """Records `engine` on the model; False when it already runs that engine (nothing to do).

    A model another engine has rewritten cannot be turned back: that is a clear error.
    """
    current = getattr(model, ENGINE_ATTRIBUTE, "hf")
    if current == engine:
        return False
    if current != "hf":
        raise ConfigError(
            f"this model instance was already rewritten for engine={current}; load a fresh instance to "
            f"run it with engine={engine}")
    setattr(model, ENGINE_ATTRIBUTE, engine)
    return True


def spread_description(model: nn.Module) -> str | None:
    """Why the model is not one plain module on one device, in words (None when it is).

    Engines that swap modules cannot rewrite a model that accelerate's hooks dispatch, that
    tensor parallel shards into DTensors, or whose linears a quantization library replaced.
    """
    device_map = getattr(model, "hf_device_map", None)
    if device_map and (len(set(map(str, device_map.values()))) > 1 or "disk" in device_map.values()):
        return f"the model is spread by a device map over {sorted(set(map(str, device_map.values())))}"
    if getattr(model, "is_quantized", False):
        method = getattr(getattr(model, "hf_quantizer", None), "quantization_config", None)
        return f"the model is quantized ({getattr(method, 'quant_method', 'unknown method')})"
    from torch.distributed.tensor import DTensor

    if any(isinstance(parameter, DTensor) for parameter in model.parameters()):
        return "the model is sharded for tensor parallel"
    return None


def tiles_permitted(model: nn.Module, permitted: bool) -> ContextManager:
    """Runs a forward of `model` with its products on AMX tiles where the engine put them there and `permitted`
    (a forward whose rows need not be bitwise one-token steps'); a no-op otherwise."""
    tiles = getattr(model, TILES_ATTRIBUTE, None) if permitted else None
    return tiles.permitted() if tiles is not None else contextlib.nullcontext()


class ThreadFlag:
    """A flag raised for the calling thread while `raised()` is open (a nested use restores what was before): how a
    forward may run, where requests decoded in parallel threads share one model."""

    def __init__(self) -> None:
        self._local = threading.local()

    def is_raised(self) -> bool:
        return getattr(self._local, "raised", False)

    @contextlib.contextmanager
    def raised(self) -> Iterator[None]:
        before = self.is_raised()
        self._local.raised = True
        try:
            yield
        finally:
            self._local.raised = before


def row_invariant(model: nn.Module) -> ContextManager:
    """Runs a forward of `model` with every row computed as its one-row forward would be, where the engine offers
    that (engine.batch_invariant); a no-op otherwise."""
    invariance = getattr(model, ROW_INVARIANCE_ATTRIBUTE, None)
    return invariance.raised() if invariance is not None else contextlib.nullcontext()


def offers_row_invariance(model: nn.Module) -> bool:
    """Whether the engine computes `model`'s forwards under `row_invariant` row by row (engine.batch_invariant)."""
    return getattr(model, ROW_INVARIANCE_ATTRIBUTE, None) is not None


def row_invariance_active(module: nn.Module) -> bool:
    """Whether this thread runs a forward of `module` inside `row_invariant`."""
    invariance = getattr(module, ROW_INVARIANCE_ATTRIBUTE, None)
    return invariance is not None and invariance.is_raised()
