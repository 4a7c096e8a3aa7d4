"""`inferlab serve [overrides...]`: the OpenAI-compatible server on the built-in engine.

    inferlab serve model=tiny engine.kv_cache=paged host=127.0.0.1 port=8000

Engine and model options are composed from configs/ exactly as `inferlab run` composes them
(`model=...`, `engine.<option>=...`, `variant=...`); the server's own options are bare keys
(`host`, `port`, `max_queue_len`, `served_model_name`, `log_level`, `access_log`).
"""

from __future__ import annotations

import re
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from engines.builtin.backend import BuiltinBackend
from serving.config import ServerConfig, ServerConfigError

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")
CONFIG_GROUPS = ("engine", "model", "variant")  # what a server's config may override
SERVER_KEYS = tuple(f.name for f in fields(ServerConfig))
TEXT_KEYS = ("host", "served_model_name", "log_level")  # kept as typed (a name may be "123")

USAGE = f"""usage: inferlab serve [key=value ...]

An OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics) on the built-in engine. docs/serving.md has the details.

engine and model (composed from configs/, as in `inferlab run`):
  model=tiny|small|tinyllama-1.1b|llama3-8b|mistral-7b|tiny-trained|hf (model.path=DIR)
  engine.<option>=VALUE    e.g. engine.kv_cache=paged engine.max_num_seqs=64
  variant=NAME             a named engine variant from configs/variant/, e.g. variant=paged
server (defaults in brackets):
  host=ADDR [127.0.0.1]  port=N [8000]
  max_queue_len=N [1024]   requests admitted beyond engine.max_num_seqs; past it: HTTP 503
  served_model_name=NAME   the `model` clients must send [the model preset or path]
  log_level={'|'.join(('critical', 'error', 'warning', 'info', 'debug', 'trace'))} [info]
  access_log=true|false [false]

example:
  inferlab serve model=tiny engine.kv_cache=paged port=8000
"""


class UsageError(ValueError):
    """The command line names something `inferlab serve` does not take."""


def parse_args(argv: list[str]) -> tuple[ServerConfig, list[str]]:
    """Split the command line into server options and Hydra overrides for the config groups."""
    server: dict[str, Any] = {}
    overrides: list[str] = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        bare = key.lstrip("+~")
        if not sep or not bare:
            raise UsageError(f"{arg!r}: expected key=value (see `inferlab serve --help`)")
        name = bare.removeprefix("server.")
        if name in SERVER_KEYS:
            if name in TEXT_KEYS:
                server[name] = None if value in ("null", "None", "~") else value
            else:
                server[name] = yaml.safe_load(value) if value else value
        elif bare.split(".")[0] in CONFIG_GROUPS:
            overrides.append(arg)
        else:
            raise UsageError(
                f"{key}: not an option of `inferlab serve`; allowed: {', '.join(SERVER_KEYS)}, "
                f"or overrides of the config groups {', '.join(CONFIG_GROUPS)} "
                "(e.g. model=tiny engine.kv_cache=paged)")
    return ServerConfig.from_dict(server), overrides


def compose_config(overrides: list[str]) -> dict[str, Any]:
    """The engine and model config groups, composed from configs/ with the overrides."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(version_base="1.3", config_dir=CONFIG_DIR):
        cfg = compose(config_name="config", overrides=overrides)
    config = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    assert isinstance(config, dict)
    return {"engine": config["engine"], "model": config["model"]}


def build_backend(argv: list[str]) -> tuple[BuiltinBackend, ServerConfig]:
    """Parse, compose and validate; the backend is not loaded yet. Raises ValueError (or a
    Hydra/OmegaConf error) with a message that names the bad option."""
    from harness.experiment import build_backend as build_harness_backend

    server, overrides = parse_args(argv)
    config = compose_config(overrides)
    engine = dict(config["engine"])
    if engine.get("backend", "builtin") != "builtin":
        raise UsageError(f"engine.backend: {engine['backend']!r} cannot be served; "
                         "`inferlab serve` runs the built-in engine (engine.backend=builtin)")
    backend = build_harness_backend(engine, config["model"])
    assert isinstance(backend, BuiltinBackend)
    if server.served_model_name is None:  # what the user named, not a resolved cache path
        server.served_model_name = str(config["model"].get("path") or config["model"]["name"])
    return backend, server


def warm_up(backend: BuiltinBackend) -> None:
    """One short generation, so the first client does not pay one-time costs."""
    from engines.builtin.llm import LLM
    from engines.sampling_params import SamplingParams

    assert backend.engine is not None
    LLM.from_engine(backend.engine).generate("Hello", SamplingParams(max_tokens=2,
                                                                     temperature=0.0))


def explain(exc: Exception) -> str:
    """The error, with the known options when Hydra refused an unknown key."""
    from engines.builtin.config import EngineConfig

    message = str(exc)
    match = re.match(r"Could not override '(engine|model)\.([^']+)'", message)
    if match is None:
        return message
    group, key = match.groups()
    known = ([f.name for f in fields(EngineConfig) if f.name not in ("model", "model_overrides",
                                                                     "tokenizer")] + ["backend"]
             if group == "engine" else ["name", "path", "tokenizer", "overrides"])
    return f"{group}.{key}: unknown option; known {group} options: {', '.join(sorted(known))}"


def main(argv: list[str]) -> int:
    if any(arg in ("-h", "--help", "help") for arg in argv):
        print(USAGE)
        return 0
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        backend, server = build_backend(argv)
        backend.load()
        warm_up(backend)
    except (ValueError, ServerConfigError, HydraException, OmegaConfBaseException) as exc:
        print(f"inferlab serve: {explain(exc)}", file=sys.stderr)
        return 2

    import uvicorn

    from serving.app import create_app

    app = create_app(backend, server)
    facts = backend.describe()
    print(f"inferlab serve: {facts['model']} ({facts['architecture']}, {facts['dtype']}, "
          f"{facts['device']}, kv_cache={facts['kv_cache']}, max_model_len="
          f"{facts['max_model_len']}, max_num_seqs={facts['max_num_seqs']}) on "
          f"http://{server.host}:{server.port}/v1", file=sys.stderr)
    try:
        uvicorn.run(app, host=server.host, port=server.port, log_level=server.log_level,
                    access_log=server.access_log)
    finally:
        backend.close()
    return 0
