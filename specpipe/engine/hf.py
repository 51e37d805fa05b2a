"""transformers' own forward, unchanged: the reference every faster engine is measured against."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn

from specpipe.engine.base import claim_model
from specpipe.engine.quantize import checked_quantization

log = logging.getLogger(__name__)


@dataclass
class HFEngine:
    name: str = "hf"

    def apply(self, model: nn.Module, quantize: str | None = None, drafter: bool = False,
              native: dict | None = None) -> nn.Module:
        claim_model(model, self.name)  # refuses a model another engine rewrote
        if checked_quantization(quantize, f"engine={self.name}") == "int8":  # "auto" asks for int8 only where an engine's kernel serves it
            log.warning("engine=hf runs transformers' own forward: %s draft weights need engine=fast (specpipe's "
                        "CPU kernel); the weights stay %s", quantize, next(model.parameters()).dtype)
        return model
