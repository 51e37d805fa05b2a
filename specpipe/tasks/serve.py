"""`task=serve`: the OpenAI-compatible server over the configured pipeline (specpipe.serving.server)."""
from __future__ import annotations

import os
import sys

from omegaconf import DictConfig

from specpipe.errors import ConfigError
from specpipe.pipelines.builder import build_pipeline
from specpipe.serving.server import API_KEY_ENVIRONMENT, Server, ServeSettings


def read_settings(cfg: DictConfig) -> ServeSettings:
    serve = cfg.get("serve")
    if serve is None:
        raise ConfigError("task=serve needs the serve settings of conf/task/serve.yaml")
    port = serve.port
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"serve.port must be a port number (0 = any free one), got {port!r}")
    for key in ("max_body_bytes", "default_max_tokens"):
        value = serve.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"serve.{key} must be a positive integer, got {value!r}")
    grace = serve.grace_seconds
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or grace < 0:
        raise ConfigError(f"serve.grace_seconds must be a number of seconds >= 0, got {grace!r}")
    api_key = serve.get("api_key") or os.environ.get(API_KEY_ENVIRONMENT) or None
    if api_key is not None and (not isinstance(api_key, str) or not api_key.strip()):
        raise ConfigError("serve.api_key must be a non-empty string")
    return ServeSettings(str(serve.host), port, api_key, serve.get("model_name"), serve.max_body_bytes,
                         serve.default_max_tokens, float(grace))


def run_serve(cfg: DictConfig) -> None:
    settings = read_settings(cfg)
    pipeline = build_pipeline(cfg)
    if settings.api_key is None and settings.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"specpipe: warning: serving on {settings.host} without an API key (serve.api_key or "
              f"{API_KEY_ENVIRONMENT}): anyone who reaches this port can use it", file=sys.stderr)
    status = Server(pipeline, settings).run()
    sys.exit(status)
