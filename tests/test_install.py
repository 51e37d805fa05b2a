"""specpipe installed as a library: the wheel built from the repository's files, installed into a throwaway
virtualenv outside the checkout, runs the README's three entry points (the Python API, the `specpipe` command and
`python -m specpipe`) and the example application, from a directory that holds no specpipe source.

The throwaway environment gets specpipe from the wheel alone; the dependencies (torch and the rest, already
installed here) are reached through a .pth line naming this environment's site-packages, whose own .pth files
(among them the editable install of the checkout) Python does not read from such a line.
"""
from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.embedded

PROMPT = "How do I read a file line by line in Python?"


def run(command: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(the throwaway venv's python, a working directory outside the checkout, the copied source tree)."""
    root = tmp_path_factory.mktemp("install")
    source = root / "source"
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, listed):  # the files a clone has (and new ones not yet committed), nothing ignored
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w",
         str(root / "dist"), str(source)], cwd=root)
    wheel = next((root / "dist").glob("specpipe-*.whl"))

    venv = root / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=root)
    python = venv / "bin" / "python"
    venv_site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                         cwd=root).stdout.strip())
    (venv_site / "specpipe_test_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "--quiet",
         str(wheel)], cwd=root)
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    return python, elsewhere, source


def test_the_wheel_ships_the_configs_the_shipped_heads_and_the_kernel_sources(installed):
    _, _, source = installed
    wheel = next((source.parent / "dist").glob("specpipe-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {path.relative_to(REPO).as_posix() for path in (REPO / "specpipe" / "conf").rglob("*.yaml")}
    shipped = {path.relative_to(REPO).as_posix() for path in (REPO / "specpipe" / "data").rglob("*")
               if path.is_file() and "shards" not in path.parts}
    kernels = {path.relative_to(REPO).as_posix() for path in (REPO / "specpipe" / "kernels").rglob("*")
               if path.suffix in (".cpp", ".h", ".c")}
    assert configs and shipped and kernels
    assert not (configs | shipped | kernels) - names, sorted((configs | shipped | kernels) - names)[:10]
    assert not any(name.startswith(("tests/", "bench/", "docs/")) for name in names)


def test_the_api_from_another_directory_uses_the_installed_package(installed):
    python, elsewhere, _ = installed
    code = ("import json, specpipe; from specpipe import Pipeline; "
            "out = Pipeline.from_config(['pipeline=lookahead_trie']).generate('Hi', max_new_tokens=8); "
            "print(json.dumps({'file': specpipe.__file__, 'text': out.text, 'tokens': out.token_ids}))")
    result = json.loads(run([str(python), "-c", code], cwd=elsewhere).stdout.strip().splitlines()[-1])
    assert Path(result["file"]).resolve().is_relative_to(python.parent.parent.resolve()), result["file"]
    assert len(result["tokens"]) == 8 and result["text"].strip()


def test_own_config_folders_and_the_shipped_heads_from_the_wheel(installed):
    """A pipeline file of the user's own, in their folder, that drafts with the EAGLE head shipped in the wheel;
    its greedy answer is the plain one."""
    python, elsewhere, _ = installed
    (elsewhere / "my_conf" / "pipeline").mkdir(parents=True)
    (elsewhere / "my_conf" / "pipeline" / "my_eagle.yaml").write_text(
        "# @package _global_\ndefaults:\n  - eagle\n  - _self_\n\npipeline:\n  name: my_eagle\n")
    code = ("import json; from specpipe import Pipeline; "
            "pipe = Pipeline.from_config(['pipeline=my_eagle'], config_dirs=['my_conf']); "
            "plain = Pipeline.from_config(['pipeline=vanilla']); "
            f"a = pipe.generate({PROMPT!r}, max_new_tokens=24); b = plain.generate({PROMPT!r}, max_new_tokens=24); "
            "print(json.dumps({'name': pipe.name, 'same': a.token_ids == b.token_ids, "
            "'accepted': a.stats.mean_accepted}))")
    result = json.loads(run([str(python), "-c", code], cwd=elsewhere).stdout.strip().splitlines()[-1])
    assert result["name"] == "my_eagle" and result["same"] and result["accepted"] > 1.0, result


@pytest.mark.parametrize("entry", ["console_script", "module"])
def test_the_command_line_of_the_installed_package(installed, entry):
    python, elsewhere, _ = installed
    command = [str(python.parent / "specpipe")] if entry == "console_script" else [str(python), "-m", "specpipe"]
    result = run([*command, "pipeline=lookahead_trie", "max_new_tokens=8", "prompt=Hi"], cwd=elsewhere)
    assert "[lookahead_trie] 8 tokens" in result.stdout
    assert (elsewhere / "outputs").is_dir()  # Hydra's run folder: where the command ran, not in the package


def test_the_example_application_against_the_installed_package(installed):
    python, elsewhere, source = installed
    result = run([str(python), str(source / "examples" / "rag_app.py"), "--max-new-tokens", "24"], cwd=elsewhere)
    assert "retrieved:" in result.stdout and "answer:" in result.stdout and "mean accepted" in result.stdout
