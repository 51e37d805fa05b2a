"""Errors a user can act on. `run.py` prints their message without a traceback."""


class SpecpipeError(Exception):
    """Base class: the message says what was wrong and what to do about it."""


class ModelNotAvailable(SpecpipeError):
    """The model's weights are not on this machine (nothing is downloaded at run time)."""


class InvalidRequest(SpecpipeError):
    """A generate/bench request that cannot be served (empty prompt, too long, bad length...)."""


class ConfigError(SpecpipeError):
    """A configuration that composes but cannot be built (mismatched tokenizers, bad stage)."""


class StoreError(SpecpipeError):
    """A datastore that is missing, corrupt, or built for another tokenizer or embedding model."""
