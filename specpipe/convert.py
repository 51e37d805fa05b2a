"""`python -m specpipe.convert [model=NAME]`: convert an embedded GGUF model to its safetensors cache once."""
from __future__ import annotations

import sys

from hydra.utils import instantiate

from specpipe.errors import SpecpipeError
from specpipe.models import EmbeddedGGUFModel
from specpipe.pipelines.builder import compose_config


def main(argv: list[str]) -> int:
    try:
        source = instantiate(compose_config(argv).model)
        if not isinstance(source, EmbeddedGGUFModel):
            print(f"model {source.name!r} is not an embedded GGUF model; nothing to convert")
            return 0
        print(f"{source.name}: converted model at {source.convert()}")
        return 0
    except SpecpipeError as error:
        print(f"specpipe: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
