"""The machine a benchmark ran on, as its reports record it: CPU and vector ISA, threads, OpenMP wait policy,
real-time throttling, GPUs, library versions (`machine_info`), and the one line the markdown reports print of it
(`machine_line`). Every benchmark task writes this beside its numbers because timings from CPUs of different
classes, or from a throttled or contended machine, do not compare.
"""
from __future__ import annotations

import os
import platform
from pathlib import Path


def realtime_throttling(settings: Path = Path("/proc/sys/kernel")) -> str:
    """Where this process runs under a real-time policy (`chrt -f 1` runs it SCHED_FIFO) and the kernel
    caps real-time tasks to a share of each period (Linux's default: 950000 of 1000000 us): a decode
    that keeps every core busy then stalls for the rest of each period, ~50 ms a second, falling on
    whichever forward spans it, which then takes several times its median. "" otherwise."""
    try:
        policy = os.sched_getscheduler(0)
        runtime = int((settings / "sched_rt_runtime_us").read_text())
        period = int((settings / "sched_rt_period_us").read_text())
    except (AttributeError, OSError, ValueError):
        return ""
    names = {os.SCHED_FIFO: "SCHED_FIFO", os.SCHED_RR: "SCHED_RR"}
    if policy not in names or runtime < 0 or runtime >= period:
        return ""
    return f"{names[policy]}, throttled to {runtime} of every {period} us"


def machine_info() -> dict:
    """The machine, threads and library versions of this process, for summary.json's `machine`."""
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import specpipe.distributed as distributed
    from specpipe.cost import openmp_wait_settings
    from specpipe.engine.cpu import cpu_description

    description = cpu_description()
    wait_policy, spin_count = openmp_wait_settings()
    return {
        "cpu": cpu,
        "cpu_capability": description["aten_capability"],  # ATen's vector ISA (AVX2, AVX512, ...)
        "isa_flags": " ".join(description["isa_flags"]),
        "onednn_max_cpu_isa": description["onednn_max_cpu_isa"] or "unset",
        "mkl_enable_instructions": description["mkl_enable_instructions"] or "unset",
        "onednn_linear": ", ".join(f"{dtype} {path}" for dtype, path in description["onednn_linear"].items()),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        # sleeping OpenMP threads (PASSIVE) wake late for every parallel region: every step is slower
        "omp_wait_policy": wait_policy or "unset",
        "gomp_spincount": spin_count or "unset",
        "realtime_throttling": realtime_throttling() or "none",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "world_size": distributed.world_size(),  # > 1: a tensor-parallel run under torchrun
    }


def machine_line(machine: dict) -> str:
    """The CPU with the ISA its kernels ran (reports from CPUs of different classes do not compare)."""
    mkl = machine.get("mkl_enable_instructions", "unset")
    isa = (f" (ATen {machine['cpu_capability']}, oneDNN cap {machine.get('onednn_max_cpu_isa', 'unset')}"
           f"{'' if mkl == 'unset' else f', MKL cap {mkl}'}, "
           f"prepacked linears: {machine.get('onednn_linear', '?')})" if machine.get("cpu_capability") else "")
    gpus = f", GPUs: {', '.join(machine['gpus'])}" if machine.get("gpus") else ""
    ranks = f", tensor parallel over {machine['world_size']} processes" if machine.get("world_size", 1) > 1 else ""
    waits = "".join(f", {name} {machine[key]}" for key, name in (("omp_wait_policy", "OMP_WAIT_POLICY"),
                                                                   ("gomp_spincount", "GOMP_SPINCOUNT"))
                    if machine.get(key, "unset") != "unset")
    throttling = machine.get("realtime_throttling", "none")
    throttled = "" if throttling == "none" else f", real-time {throttling}: stalls the rest of each period (noisy times)"
    return (f"{machine.get('cpu')}{isa}, {machine.get('cores')} cores, torch threads {machine.get('torch_threads')}"
            f"{waits}{throttled}{gpus}{ranks}, torch {machine.get('torch')}, transformers {machine.get('transformers')}")
