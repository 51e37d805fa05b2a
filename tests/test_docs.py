"""The documentation: the MkDocs site builds strictly (no broken page, link, anchor or API reference), the
pipeline tables name exactly the pipeline configs, the lab notebook's index reaches every run page, and the
README's own links resolve."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PIPELINE_CONFIGS = sorted(path.stem for path in (ROOT / "specpipe" / "conf" / "pipeline").glob("*.yaml"))


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                    reason="mkdocs is not installed (it comes with the dev extra: pip install -e '.[dev]')")
def test_site_builds_strictly(tmp_path):
    """`mkdocs build --strict`: a warning (a missing page, a broken link or anchor, an API reference to a name
    that no longer exists) fails the build."""
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                             "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "api" / "index.html").is_file()
    assert "specpipe.pipelines.pipeline.Pipeline.generate" in (tmp_path / "site" / "api" / "index.html").read_text()


def pipeline_table(path: Path) -> list[str]:
    """The pipeline names in the first column of the table whose header starts `| pipeline |`."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\|\s*pipeline\s*\|", line))
    names = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        first = line.split("|")[1]
        match = re.match(r"\s*`([a-z0-9_]+)`", first)
        assert match, f"{path.name}: a pipeline row without a `name` in its first column: {line}"
        names.append(match.group(1))
    return names


@pytest.mark.parametrize("page", ["README.md", "docs/pipelines/index.md"])
def test_pipeline_tables_match_configs(page):
    """Every conf/pipeline/*.yaml has a row, every row names an existing config, none twice."""
    names = pipeline_table(ROOT / page)
    assert len(names) == len(set(names)), f"{page}: a pipeline listed twice: {names}"
    assert sorted(names) == PIPELINE_CONFIGS, (f"{page}: missing {sorted(set(PIPELINE_CONFIGS) - set(names))}, "
                                               f"no such config {sorted(set(names) - set(PIPELINE_CONFIGS))}")


STAGE_PAGES = {"retriever": "retrieve.md", "drafter": "draft.md", "tree": "tree.md", "verifier": "verify.md",
               "commit": "commit.md", "augment": "augment.md"}


def quoted_words(page: Path) -> set[str]:
    """The identifiers inside `inline code` of a page, its fenced code blocks aside."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {word for quoted in re.findall(r"`([^`]+)`", text) for word in re.findall(r"[A-Za-z_]\w*", quoted)}


@pytest.mark.parametrize("group", sorted(STAGE_PAGES))
def test_every_stage_option_is_named_on_its_page(group):
    """Each config of a stage family (conf/<group>/NAME.yaml) and each of its settings appears in `code` on that
    family's page, so a setting added to a config without a word in the docs fails here (`name`, the label every
    stage carries, is explained once in the concepts page)."""
    from omegaconf import OmegaConf

    words = quoted_words(DOCS / "pipelines" / STAGE_PAGES[group])
    undocumented = []
    for path in sorted((ROOT / "specpipe" / "conf" / group).glob("*.yaml")):
        settings = [key for key in OmegaConf.to_container(OmegaConf.load(path))
                    if not key.startswith("_") and key not in ("defaults", "name")]
        undocumented += [f"{group}/{path.stem}.yaml: {key}" for key in [path.stem, *settings] if key not in words]
    assert not undocumented, f"docs/pipelines/{STAGE_PAGES[group]} does not name: {undocumented}"


def test_readme_default_pipeline_is_the_configured_one():
    default = re.search(r"^\s*- pipeline: (\w+)", (ROOT / "specpipe" / "conf" / "config.yaml").read_text(), re.M).group(1)
    rows = [line for line in (ROOT / "README.md").read_text().splitlines() if "(default)" in line]
    assert rows and all(f"`{default}` (default)" in row for row in rows)


def test_notebook_index_lists_every_run_in_order():
    """docs/notebook/index.md links every page of the notebook (the site's nav reaches the runs only through
    it), in run order."""
    index = (DOCS / "notebook" / "index.md").read_text()
    every_link = set(re.findall(r"\]\(([\w-]+\.md)\)", index))
    pages = sorted(path.name for path in (DOCS / "notebook").glob("*.md") if path.name != "index.md")
    assert every_link >= set(pages), f"not linked: {sorted(set(pages) - every_link)}"
    linked = re.findall(r"\]\(((?:run-\d\d|session-\d\d)\.md)\)", index)
    # session 6 came between runs 7 and 8 and had no run number of its own
    order = [7.5 if name == "session-06.md" else int(name[4:6]) for name in linked]
    assert order == sorted(order), "the notebook's runs are listed out of order"


def test_readme_links_resolve():
    """The README is read on the forge, outside the site: its relative links must name files that exist."""
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert targets, "the README links into the docs"
    missing = [target for target in targets if "://" not in target and not (ROOT / target).exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_readme_stays_short_and_current():
    """The README says what is, briefly (issue 81): measurement history belongs in docs/notebook/."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move reference text into docs/"
    history = [line for line in lines if re.search(r"\bruns? \d+\b", line, re.I)]
    assert not history, f"run numbers in the README (link the notebook page instead): {history}"
