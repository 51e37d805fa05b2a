"""The decoding loop (`decoder`), its application API (`pipeline`) and what builds both from config (`builder`).

The builder makes Pipelines and `Pipeline.from_config` builds through the builder: the two are wired here, where
this package is imported (before any of its modules), rather than by pipeline.py importing the builder back.
"""
from specpipe.pipelines import builder as _builder
from specpipe.pipelines import pipeline as _pipeline


def _build_from_overrides(overrides, config_dirs=()):
    """`conf/` (and `config_dirs`) composed with `overrides`, built (the builder's functions looked up per call)."""
    return _builder.build_pipeline(_builder.compose_config(overrides, config_dirs))


_pipeline.use_config_builder(_build_from_overrides)
