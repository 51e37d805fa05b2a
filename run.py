"""specpipe's command line: `python run.py [task=generate|bench] [pipeline=...] [model=...] ...`."""
from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from specpipe.errors import SpecpipeError


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from specpipe.tasks import run_task

    try:
        run_task(cfg)
    except SpecpipeError as error:
        print(f"specpipe: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
