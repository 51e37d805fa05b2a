"""`task=bench_cost`: milliseconds per target forward against the number of query tokens.

For each dtype it loads the model once per engine and measures, in one process:

- `transformers`: the stock model as `generate` runs it (its own attention, `DynamicCache`;
  q tokens = a causal chain, as assisted generation verifies);
- `specpipe-ENGINE` for each configured engine: specpipe's verify forward (tree mask through the
  attention plug-in point, position-indexed cache) on the model that engine rewrote.

Each point is the median of rounds after a warm-up round; a round runs every engine and every q
once (`measure_cost_curves`), so drift of the machine hits all engines alike.
Writes cost.json, cost.md (tables and the issue's ratios) and cost.png (ms vs q, a line per
engine and dtype, a panel per KV length), and stores the specpipe curves at the drafting
policy's KV length in the cost cache, so pipelines draft by what was just measured.
"""
from __future__ import annotations

import gc
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm
from transformers import DynamicCache

from specpipe.cost import (OtherProcessesLoad, measure_cost_curves, measure_read_bandwidth, store_cost_curve,
                           streamed_weight_bytes)
from specpipe.errors import ConfigError, InvalidRequest
from specpipe.models import parse_dtype
from specpipe.tasks.bench_machine import machine_info, machine_line
from specpipe.tasks.bench_report import write_atomically, write_text
from specpipe.tasks.bench_settings import output_dir
from specpipe.paths import CONFIG_DIR
from specpipe.pipelines.builder import compose_config, load_model
from specpipe.stages.draft.draft_model import root_and_tree_rows
from specpipe.tasks.forward_profile import profile_forward, row_value, top_ops
from specpipe.target import TargetModel
from specpipe.types import DraftTree

log = logging.getLogger(__name__)

STOCK = "transformers"
POLICY_KV_LENGTH = 256  # the KV length `cached_cost_curve` measures at


class _TruncatingDynamicCache(DynamicCache):
    """DynamicCache whose `crop(n)` keeps the first n entries (this transformers only removes from the end)."""

    def crop(self, max_length: int) -> None:
        surplus = self.get_seq_length() - max_length
        if surplus > 0:
            super().crop(-surplus)


class TransformersForward:
    """The stock forward, shaped like TargetModel for `measure_cost_curve`: a tree's nodes see their ancestors through
    a 4D mask, as TargetModel verifies them."""

    engine = STOCK

    def __init__(self, model, name: str) -> None:
        self.model = model
        self.name = name
        self.vocab_size = int(model.config.vocab_size)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    def new_cache(self) -> DynamicCache:
        return _TruncatingDynamicCache(config=self.model.config)

    @torch.inference_mode()
    def prefill(self, prompt: list[int], cache: DynamicCache) -> None:
        self.model(input_ids=torch.tensor([prompt], device=self.device), past_key_values=cache, use_cache=True,
                   logits_to_keep=1)

    @torch.inference_mode()
    def forward_tree(self, root_token: int, tree: DraftTree, cache: DynamicCache) -> torch.Tensor:
        tokens, positions, mask = root_and_tree_rows(root_token, tree, cache.get_seq_length())  # [q], [q], [q, kv]
        return self.model(input_ids=tokens[None].to(self.device), position_ids=positions[None].to(self.device),
                          attention_mask=mask[None, None].to(self.device), past_key_values=cache, use_cache=True).logits


@dataclass(frozen=True)
class CostSettings:
    queries: tuple[int, ...]
    kv_lengths: tuple[int, ...]
    dtypes: tuple[str, ...]
    engines: tuple[str, ...]
    rounds: int
    profile_queries: tuple[int, ...]  # q values profiled op by op at the policy KV length (empty: none)
    out: Path


def read_settings(cfg: DictConfig) -> CostSettings:
    bench = cfg.bench_cost
    queries = tuple(int(q) for q in bench.queries)
    if not queries or min(queries) < 1 or list(queries) != sorted(set(queries)):
        raise InvalidRequest(f"bench_cost.queries must be increasing positive counts, got {list(queries)}")
    kv_lengths = tuple(int(n) for n in bench.kv_lengths)
    if not kv_lengths or min(kv_lengths) < 1:
        raise InvalidRequest(f"bench_cost.kv_lengths must be positive, got {list(kv_lengths)}")
    for name in bench.dtypes:
        parse_dtype(name)
    if int(bench.rounds) < 1:
        raise InvalidRequest(f"bench_cost.rounds must be >= 1, got {bench.rounds}")
    engines = tuple(str(name) for name in bench.engines)
    for name in engines:
        engine_config_path(name.split()[0])
    profile_queries = tuple(int(q) for q in bench.get("profile_queries") or ())
    if profile_queries and min(profile_queries) < 1:
        raise InvalidRequest(f"bench_cost.profile_queries must be positive counts, got {list(profile_queries)}")
    return CostSettings(queries, kv_lengths, tuple(str(d) for d in bench.dtypes), engines, int(bench.rounds),
                        profile_queries, output_dir(bench.get("out"), "bench_cost.out"))


def engine_config_path(name: str) -> Path:
    path = CONFIG_DIR / "engine" / f"{name}.yaml"
    if not path.is_file():
        options = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ConfigError(f"unknown engine {name!r} in bench_cost.engines; choose from {options}")
    return path


def build_engine_by_name(name: str):
    """The engine `engine=NAME` builds, composed as Hydra composes it (an engine config may extend another).
    "NAME KEY=VALUE ..." sets the engine's fields too (`fast target_weights=dense`)."""
    from hydra import compose
    from hydra.core.global_hydra import GlobalHydra
    from hydra.utils import instantiate

    engine, *fields = name.split()
    engine_config_path(engine)  # a clear error for an unknown name
    overrides = [f"engine={engine}", *(f"engine.{field}" for field in fields)]
    if GlobalHydra.instance().is_initialized():  # inside run.py: compose with the app's own search path
        engine_cfg = compose(config_name="config", overrides=overrides).engine
    else:
        engine_cfg = compose_config(overrides).engine
    return instantiate(engine_cfg)


def runners(cfg: DictConfig, dtype: str, engines: Sequence[str]) -> dict:
    """label -> runner for one dtype, each on its own freshly loaded instance of the model."""
    model_cfg = OmegaConf.merge(cfg.model, {"dtype": dtype})
    loaded = load_model(model_cfg)
    result = {STOCK: TransformersForward(loaded.model, loaded.name)}
    for name in engines:
        loaded = load_model(model_cfg)
        engine = build_engine_by_name(name)
        engine.apply(loaded.model, native=loaded.native)
        result[f"specpipe-{name}"] = TargetModel(loaded.model, name=loaded.name, attention="sdpa",
                                                        engine=engine.name)
    return result


def measure(cfg: DictConfig, settings: CostSettings) -> tuple[list[dict], list[dict], list[dict]]:
    """Every engine of a dtype is loaded at once and measured in the same interleaved rounds, so
    the ratios between engines do not depend on when each was measured. Returns the curve rows,
    the op profiles ({engine, dtype, queries, ops: {op: ms per forward}}) and the weight bytes each
    runner streams per step ({engine, dtype, weight_bytes})."""
    rows, profiles, weights = [], [], []
    jobs = len(settings.dtypes) * (len(settings.kv_lengths) + bool(settings.profile_queries))
    with tqdm(total=jobs, desc="bench_cost", file=sys.stderr) as progress:
        for dtype in settings.dtypes:
            by_label = runners(cfg, dtype, settings.engines)
            weights += [{"engine": label, "dtype": dtype, "weight_bytes": streamed_weight_bytes(runner.model)}
                        for label, runner in by_label.items()]
            for kv_length in settings.kv_lengths:
                progress.set_postfix_str(f"{dtype} kv={kv_length}")
                with OtherProcessesLoad() as load:
                    curves = measure_cost_curves(list(by_label.values()), settings.queries, kv_length=kv_length,
                                                 rounds=settings.rounds)
                competed = load.competed()
                if competed:
                    log.warning("bench_cost: other processes kept %.1f of the %d CPUs busy while %s kv=%d was "
                                "measured: these rows are that moment's, and the decoding curve is not cached",
                                load.cores, load.cpus, dtype, kv_length)
                for (label, runner), curve in zip(by_label.items(), curves):
                    rows += [{"engine": label, "dtype": dtype, "kv_length": kv_length, "queries": q, "ms": ms}
                             for q, ms in zip(curve.queries, curve.milliseconds)]
                    if isinstance(runner, TargetModel) and kv_length == POLICY_KV_LENGTH and not competed:
                        store_cost_curve(runner, curve, kv_length)
                progress.update()
            if settings.profile_queries:
                progress.set_postfix_str(f"{dtype} profile")
                profiles += [{"engine": label, "dtype": dtype, "queries": q,
                              "ops": profile_forward(runner, q, kv_length=POLICY_KV_LENGTH)}
                             for label, runner in by_label.items() for q in settings.profile_queries]
                progress.update()
            del by_label
            gc.collect()
    return rows, profiles, weights


def memory_floors(rows: Sequence[dict], weights: Sequence[dict], bandwidth_gbs: float,
                  kv_length: int) -> list[dict]:
    """Each runner's one-token step beside its physical floor: the weight bytes it streams per step
    over the measured read bandwidth. A bf16 model whose linears run prepacked in fp32 streams
    fp32 bytes, so its floor is fp32's."""
    floors = []
    for entry in weights:
        step = lookup(rows, entry["engine"], entry["dtype"], kv_length, 1)
        floor_ms = entry["weight_bytes"] / (bandwidth_gbs * 1e9) * 1000.0
        floors.append({**entry, "floor_ms": floor_ms, "step_ms": step,
                       "x_floor": step / floor_ms if step is not None else None})
    return floors


def floors_markdown(floors: Sequence[dict], bandwidth_gbs: float, kv_length: int) -> str:
    lines = [f"### Memory floor (read bandwidth {bandwidth_gbs:.1f} GB/s, one-token step, KV {kv_length})", "",
             "| engine | dtype | weights streamed (MB) | floor (ms) | step (ms) | step / floor |",
             "|---|---|---:|---:|---:|---:|"]
    for f in floors:
        step = f"{f['step_ms']:.1f}" if f["step_ms"] is not None else "-"
        ratio = f"{f['x_floor']:.2f}x" if f["x_floor"] is not None else "-"
        lines.append(f"| {f['engine']} | {f['dtype']} | {f['weight_bytes'] / 1e6:.0f} | {f['floor_ms']:.1f} | "
                     f"{step} | {ratio} |")
    return "\n".join(lines) + "\n"


def lookup(rows: Sequence[dict], engine: str, dtype: str, kv_length: int, queries: int) -> float | None:
    for row in rows:
        if (row["engine"], row["dtype"], row["kv_length"], row["queries"]) == (engine, dtype, kv_length, queries):
            return row["ms"]
    return None


def bar_checks(rows: Sequence[dict], floors: Sequence[dict] = (), fast: str = "specpipe-fast",
               kv_length: int = POLICY_KV_LENGTH) -> list[dict]:
    """The issue's bars, where the rows hold what they need: (what, ratio, limit, met)."""
    checks = []

    def add(what: str, numerator: float | None, denominator: float | None, limit: float) -> None:
        if numerator is not None and denominator:
            ratio = numerator / denominator
            checks.append({"what": what, "ratio": ratio, "limit": limit, "met": ratio <= limit})

    add("fp32: our 1-token step / transformers' 1-token step",
        lookup(rows, fast, "fp32", kv_length, 1), lookup(rows, STOCK, "fp32", kv_length, 1), 0.6)
    add("fp32: our 16-token verify / transformers' 1-token step",
        lookup(rows, fast, "fp32", kv_length, 16), lookup(rows, STOCK, "fp32", kv_length, 1), 1.0)
    add("bf16: our 16-token verify / our 1-token step",
        lookup(rows, fast, "bf16", kv_length, 16), lookup(rows, fast, "bf16", kv_length, 1), 1.2)
    for floor in floors:
        if (floor["engine"], floor["dtype"]) == (fast, "fp32"):
            add("fp32: our 1-token step / memory floor", floor["step_ms"], floor["floor_ms"], 1.6)
    return checks


def markdown(rows: Sequence[dict], settings: CostSettings, checks: Sequence[dict]) -> str:
    labels = [STOCK] + [f"specpipe-{name}" for name in settings.engines]
    lines = []
    for dtype in settings.dtypes:
        for kv_length in settings.kv_lengths:
            lines += [f"### {dtype}, KV length {kv_length} (ms per forward, median)", "",
                      "| q | " + " | ".join(labels) + " | " + " | ".join(f"{label} / {STOCK} q=1" for label in labels[1:]) + " |",
                      "|---:|" + "---:|" * (2 * len(labels) - 1)]
            base = lookup(rows, STOCK, dtype, kv_length, 1)
            for q in settings.queries:
                values = [lookup(rows, label, dtype, kv_length, q) for label in labels]
                cells = [f"{v:.1f}" if v is not None else "-" for v in values]
                ratios = [f"{v / base:.2f}x" if v is not None and base else "-" for v in values[1:]]
                lines.append(f"| {q} | " + " | ".join(cells + ratios) + " |")
            lines.append("")
    if checks:
        lines += ["### Bars (KV 256)", "", "| check | ratio | limit | met |", "|---|---:|---:|:---:|"]
        lines += [f"| {c['what']} | {c['ratio']:.2f} | {c['limit']:.1f} | {'yes' if c['met'] else 'NO'} |"
                  for c in checks]
    return "\n".join(lines) + "\n"


def profile_markdown(profiles: Sequence[dict]) -> str:
    """Per dtype: op self time per forward (torch profiler), a column per engine and q."""
    lines = []
    for dtype in dict.fromkeys(p["dtype"] for p in profiles):
        columns = [p for p in profiles if p["dtype"] == dtype]
        shown = top_ops([p["ops"] for p in columns])
        lines += [f"### Where the time goes: {dtype}, KV length {POLICY_KV_LENGTH} (ms per forward)", "",
                  "| op | " + " | ".join(f"{p['engine']} q={p['queries']}" for p in columns) + " |",
                  "|---|" + "---:|" * len(columns)]
        lines += [f"| {name} | " + " | ".join(f"{row_value(p['ops'], name, shown):.2f}" for p in columns) + " |"
                  for name in shown]
        lines.append("")
    return "\n".join(lines)


def plot(rows: Sequence[dict], settings: CostSettings, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(settings.kv_lengths), figsize=(6 * len(settings.kv_lengths), 4.5),
                             squeeze=False, sharey=True)
    labels = [STOCK] + [f"specpipe-{name}" for name in settings.engines]
    for ax, kv_length in zip(axes[0], settings.kv_lengths):
        for dtype in settings.dtypes:
            for label in labels:
                points = [(q, lookup(rows, label, dtype, kv_length, q)) for q in settings.queries]
                points = [(q, ms) for q, ms in points if ms is not None]
                ax.plot([q for q, _ in points], [ms for _, ms in points], marker="o",
                        linestyle="-" if dtype == "fp32" else "--", label=f"{label} {dtype}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("query tokens per forward (q)")
        ax.set_title(f"KV length {kv_length}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("ms per forward (median)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    write_atomically(path, lambda staging: fig.savefig(staging, format="png", dpi=120))
    plt.close(fig)


def run_bench_cost(cfg: DictConfig) -> dict:
    settings = read_settings(cfg)
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    bandwidth = measure_read_bandwidth()
    rows, profiles, weights = measure(cfg, settings)
    floor_kv = POLICY_KV_LENGTH if POLICY_KV_LENGTH in settings.kv_lengths else settings.kv_lengths[0]
    floors = memory_floors(rows, weights, bandwidth, floor_kv)
    checks = bar_checks(rows, floors)
    machine = machine_info()
    report = {"model": str(cfg.model.name), "machine": machine, "threads": torch.get_num_threads(),
              "rounds": settings.rounds, "read_bandwidth_gbs": bandwidth, "rows": rows, "floors": floors,
              "bars": checks, "profiles": profiles}
    settings.out.mkdir(parents=True, exist_ok=True)
    write_text(settings.out / "cost.json", json.dumps(report, indent=1))
    table = (f"machine: {machine_line(machine)}\n\n" + markdown(rows, settings, checks) + "\n"
             + floors_markdown(floors, bandwidth, floor_kv) + ("\n" + profile_markdown(profiles) if profiles else ""))
    write_text(settings.out / "cost.md", f"# Forward cost: {cfg.model.name}\n\n{table}")
    plot(rows, settings, settings.out / "cost.png", f"{cfg.model.name}: ms per target forward")
    print(table)
    print(f"bench_cost: report written to {settings.out}", file=sys.stderr)
    return report
