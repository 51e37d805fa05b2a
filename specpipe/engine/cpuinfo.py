"""What this CPU and this torch run: the CPU's feature flags, ATen's vector ISA, and so which build of
specpipe's CPU kernel this machine gets.

A leaf module (torch only): `specpipe.engine.cpu` (the oneDNN paths, `cpu_description`) and
`specpipe.engine.cpu_kernel` (the kernel's build) both ask it, and neither imports the other.
"""
from __future__ import annotations

import torch


def aten_capability() -> str:
    """ATen's vector ISA for its own CPU kernels (AVX2, AVX512, ...; `ATEN_CPU_CAPABILITY` caps it)."""
    return torch.backends.cpu.get_cpu_capability()


def cpu_model_and_flags() -> tuple[str, set[str]]:
    """(model name, feature flags) of the first CPU in /proc/cpuinfo; empty where it cannot be read."""
    flags: set[str] = set()
    model = ""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
                elif line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return model, flags


def cpu_flags() -> set[str]:
    """The CPU's feature flags (avx2, fma, avx512f, ...) as the kernel reports them; empty off Linux."""
    return cpu_model_and_flags()[1]


def kernel_isa(flags: set[str] | None = None, capability: str | None = None) -> str:
    """Which build of specpipe's CPU kernel a CPU with `flags` under ATen's `capability` (this machine's where
    None) gets: where the CPU has AVX-512F and ATen's own kernels run AVX-512 (not held back by
    ATEN_CPU_CAPABILITY), 'avx512_bf16' if it also has AVX512_BF16 (pair products of bf16 values), else
    'avx512'; 'avx2' elsewhere."""
    flags = cpu_flags() if flags is None else flags
    capability = aten_capability() if capability is None else capability
    if "avx512f" not in flags or not capability.startswith("AVX512"):
        return "avx2"
    return "avx512_bf16" if {"avx512bw", "avx512_bf16"} <= flags else "avx512"


def first_line(error: BaseException) -> str:
    """The first line of an error's message (its type's name where it has none): how a failed probe or build
    is said in one line."""
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
