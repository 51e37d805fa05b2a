"""specpipe's command line: `specpipe [task=generate|bench|serve|...] [pipeline=...] [model=...] ...`.

The same entry point runs as `python run.py` in a checkout, `python -m specpipe` and the `specpipe` console
script of an installed wheel. Configs come from the package's `conf/`; a folder of your own is added with
`hydra.searchpath=[file:///path/to/conf]`, where `pipeline/NAME.yaml` and the other groups are found beside
the shipped ones.
"""
from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from specpipe.errors import SpecpipeError
from specpipe.paths import CONFIG_DIR


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from specpipe.tasks import run_task

    try:
        run_task(cfg)
    except SpecpipeError as error:
        print(f"specpipe: error: {error}", file=sys.stderr)
        sys.exit(2)
