"""The Results page and the README's speed table are what bench/results_page.py renders from the summaries under
docs/results/: a hand edit, or a summary added without re-running the script, fails here."""
from __future__ import annotations

import importlib.util
import json
import re
import sys
from itertools import permutations
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
NUMBER = re.compile(r"\d+(?:\.\d+)?")


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("results_page", ROOT / "bench" / "results_page.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves its annotations through its module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def results_page() -> ModuleType:
    return load_script()


@pytest.fixture(scope="module")
def measurements(results_page: ModuleType) -> dict:
    return results_page.load_measurements()


def stale_message(results_page: ModuleType, committed: str, rendered: str, name: str) -> str:
    return (f"{name} is not what the summaries under docs/results/ give: run `{results_page.REFRESH}` "
            f"(and edit docs/results/ or the script, not the page)\n"
            + results_page.difference(committed, rendered, name)[:4000])


def test_results_page_is_rendered_from_the_summaries(results_page: ModuleType, measurements: dict) -> None:
    committed = results_page.PAGE.read_text()
    rendered = results_page.render_page(measurements)
    assert committed == rendered, stale_message(results_page, committed, rendered, "docs/BENCHMARKS.md")


def readme_table(results_page: ModuleType) -> str:
    text = results_page.README.read_text()
    start, end = results_page.readme_block(text)
    return text[start:end].strip("\n")


def test_readme_speed_table_is_rendered_from_the_summaries(results_page: ModuleType, measurements: dict) -> None:
    committed = readme_table(results_page)
    rendered = results_page.render_readme_table(measurements)
    assert committed == rendered, stale_message(results_page, committed, rendered, "README.md's speed table")


def quoted_speeds(summary: dict) -> list[float]:
    """What the README may quote from one summary: its tok/s and speedups, and the ratios of its methods'
    overall tok/s to one another (the README's 'over llama.cpp')."""
    found = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("tok_s", "throughput_tok_s", "speedup") and isinstance(value, (int, float)):
                    found.append(float(value))
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(summary)
    overall = [metrics["tok_s"] for metrics in summary.get("overall", {}).values()]
    found += [a / b for a, b in permutations(overall, 2)]
    return found


def test_every_number_of_the_readme_table_comes_from_a_summary(results_page: ModuleType) -> None:
    """Each number in the value cells (between the workload and the notebook link) is, at its printed
    precision, a tok/s, a speedup or a ratio of two methods' tok/s in some summary under docs/results/."""
    speeds = [value for folder in sorted(RESULTS.iterdir()) if (folder / "summary.json").is_file()
              for value in quoted_speeds(json.loads((folder / "summary.json").read_text()))]
    rows = [line for line in readme_table(results_page).splitlines()[2:] if line.startswith("|")]
    assert rows, "README.md's speed table has no rows"
    unsourced = []
    for row in rows:
        for cell in row.strip("|").split("|")[1:-1]:
            for number in NUMBER.findall(cell):
                digits = len(number.partition(".")[2])
                if not any(f"{value:.{digits}f}" == number for value in speeds):
                    unsourced.append(f"{number} in {cell.strip()!r}")
    assert not unsourced, f"README.md's speed table quotes numbers no summary under docs/results/ holds: {unsourced}"


def test_every_measurement_is_placed(measurements: dict) -> None:
    """Each docs/results/NAME/ says which notebook page discusses it (an existing one), its machine and weights,
    and has a command (its summary's or source.json's)."""
    folders = sorted(path.name for path in RESULTS.iterdir() if path.is_dir())
    assert sorted(measurements) == folders
    for name, measurement in measurements.items():
        assert (ROOT / "docs" / "notebook" / measurement.notebook).is_file(), f"{name}: no page {measurement.notebook}"
        assert measurement.source.get("machine") and measurement.source.get("weights"), name
        assert measurement.command and measurement.dtype, name
        plot = measurement.source.get("plot")
        assert plot is None or (ROOT / "docs" / plot).is_file(), f"{name}: no plot docs/{plot}"
