"""`inferlab serve [overrides...]`: the OpenAI-compatible server on the built-in engine.

    inferlab serve model=tiny engine.kv_cache=paged host=127.0.0.1 port=8000

Engine and model options are composed from configs/ exactly as `inferlab run` composes them
(`model=...`, `engine.<option>=...`, `variant=...`); the server's own options are bare keys
(`host`, `port`, `max_queue_len`, `served_model_name`, `log_level`, `access_log`,
`shutdown_timeout_s`, `read_timeout_s`, `keep_alive_timeout_s`, `api_key`, `max_body_bytes`,
`max_header_bytes`, `max_header_count`, `metrics_names`, `profile_dir`).
The API key may come from INFERLAB_API_KEY instead (it then stays out of `ps` listings).

Anything that stops the start (a bad option, a checkpoint file that cannot be read, a port in
use) is one line on stderr naming the option, file or port, and exit status 2; the port is taken
before the model loads, so a port in use fails at once.
"""

from __future__ import annotations

import copy
import gc
import os
import sys
import traceback
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import yaml

import configs
import workloads  # noqa: F401  (the workload groups' schemas, for compose)
from engines import backends
from engines.builtin.backend import BuiltinBackend
from serving.auth import API_KEY_ENV, is_loopback
from serving.config import ServerConfig, ServerConfigError

CONFIG_GROUPS = ("engine", "model", "variant")  # what a server's config may override
SERVER_KEYS = tuple(f.name for f in fields(ServerConfig))
# kept as typed (a name may be "123")
TEXT_KEYS = ("host", "served_model_name", "log_level", "api_key", "profile_dir")

USAGE = f"""usage: inferlab serve [key=value ...]

An OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics; /start_profile and /stop_profile with profile_dir) on the built-in engine.
docs/serving.md has the details.

engine and model (composed from configs/, as in `inferlab run`):
  model=tiny|small|tinyllama-1.1b|llama3-8b|mistral-7b|tiny-trained|hf (model.path=DIR)
  engine.<option>=VALUE    e.g. engine.kv_cache=paged engine.max_num_seqs=64
  variant=NAME             a named engine variant from configs/variant/, e.g. variant=paged
server (defaults in brackets):
  host=ADDR [127.0.0.1]  port=N [8000]
  max_queue_len=N [1024]   requests admitted beyond engine.max_num_seqs; past it: HTTP 503
  served_model_name=NAME   the `model` clients must send [the model preset or path]
  log_level={"|".join(("critical", "error", "warning", "info", "debug", "trace"))} [info]
  access_log=true|false [false]
  shutdown_timeout_s=S [10]  after SIGTERM/SIGINT: how long running requests may finish
                             before they are aborted (streams get an error event); exit 0
  read_timeout_s=S [30]      a request's headers, then its body, must arrive within S seconds
  keep_alive_timeout_s=S [5] idle keep-alive connections are closed after S seconds
  api_key=KEY [${API_KEY_ENV}, else none]  /v1/* requests must send
                             `Authorization: Bearer KEY` (401 otherwise); api_key=null: none
  max_body_bytes=N [8388608] larger request bodies get HTTP 413 unread
  max_header_bytes=N [65536] a larger request line and headers get HTTP 431 unread
  max_header_count=N [100]   more header fields get HTTP 431
  metrics_names=[inferlab,vllm] [both]  the names /metrics exports: inferlab_*, vLLM's
                             vllm:* (its Grafana dashboards work), or both
  profile_dir=DIR [none]     POST /start_profile and /stop_profile run torch.profiler on
                             the engine and write a Chrome trace into DIR (vLLM's
                             VLLM_TORCH_PROFILER_DIR); without it they answer 404

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
                "(e.g. model=tiny engine.kv_cache=paged)"
            )
    if "api_key" not in server and os.environ.get(API_KEY_ENV):
        key = os.environ[API_KEY_ENV]
        if key != key.strip():  # the key itself stays out of the message: it is a secret
            raise UsageError(
                f"{API_KEY_ENV}: invalid; allowed: a key without surrounding whitespace"
            )
        server["api_key"] = key
    return ServerConfig.from_dict(server), overrides


def compose_config(overrides: list[str]) -> dict[str, Any]:
    """The engine and model config groups, composed from configs/ with the overrides."""
    from omegaconf import OmegaConf

    cfg = configs.compose(overrides)
    config = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    assert isinstance(config, dict)
    return {"engine": config["engine"], "model": config["model"]}


def build_backend(argv: list[str]) -> tuple[BuiltinBackend, ServerConfig]:
    """Parse, compose and validate; the backend is not loaded yet. Raises ValueError (or a
    Hydra/OmegaConf error) with a message that names the bad option."""
    server, overrides = parse_args(argv)
    config = compose_config(overrides)
    engine = dict(config["engine"])
    if engine.get("backend", "builtin") != "builtin":
        raise UsageError(
            f"engine.backend: {engine['backend']!r} cannot be served; "
            "`inferlab serve` runs the built-in engine (engine.backend=builtin)"
        )
    check_checkpoint(config["model"])
    backend = backends.build_backend(engine, config["model"])
    assert isinstance(backend, BuiltinBackend)
    if server.served_model_name is None:  # what the user named, not a resolved cache path
        served = str(config["model"].get("path") or config["model"]["name"])
        server = replace(server, served_model_name=served)
    return backend, server


def check_checkpoint(model: dict[str, Any]) -> None:
    """What a served checkpoint folder must hold before anything loads: the folder itself,
    and a tokenizer (`run` falls back to the project's BPE, whose ids mean nothing to a real
    checkpoint; a server would answer in gibberish)."""
    path = model.get("path")
    if not path:
        return
    folder = Path(str(path))
    if not folder.exists():
        raise UsageError(
            f"model.path: {folder} does not exist; allowed: a Hugging Face "
            "checkpoint folder (config.json, *.safetensors, tokenizer.json)"
        )
    if folder.is_dir() and not model.get("tokenizer") and not (folder / "tokenizer.json").is_file():
        raise UsageError(
            f"model.path: {folder / 'tokenizer.json'} is missing; add the "
            "checkpoint's tokenizer.json, or name one with model.tokenizer=PATH"
        )


def warm_up(backend: BuiltinBackend) -> None:
    """One short generation, so the first client does not pay one-time costs."""
    from engines.builtin.llm import LLM
    from engines.sampling_params import SamplingParams

    assert backend.engine is not None
    LLM.from_engine(backend.engine).generate("Hello", SamplingParams(max_tokens=2, temperature=0.0))


def log_config(log_level: str) -> dict[str, Any]:
    """uvicorn's logging setup, plus the server's own one-line messages (`inferlab.serve`:
    disconnects, timeouts, shutdown) through the same handler and format."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["inferlab"] = {
        "handlers": ["default"],
        "level": log_level.upper(),
        "propagate": False,
    }
    return config


def main(argv: list[str]) -> int:
    if any(arg in ("-h", "--help", "help") for arg in argv):
        print(USAGE)
        return 0
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from serving.lifecycle import bind_socket

    try:
        backend, server = build_backend(argv)
        sock = bind_socket(server.host, server.port)
    except (ValueError, ServerConfigError, HydraException, OmegaConfBaseException) as exc:
        print(f"inferlab serve: {exc}", file=sys.stderr)
        return 2
    if server.api_key is None and not is_loopback(server.host):
        print(
            f"inferlab serve: warning: listening on {server.host} without an API key: anyone "
            f"who can reach the port can use the server (set {API_KEY_ENV} or api_key=)",
            file=sys.stderr,
        )
    try:
        backend.load()
        warm_up(backend)
    except Exception as exc:  # a start that fails is one line, whatever failed (see --help)
        sock.close()
        if server.log_level in ("debug", "trace"):
            traceback.print_exc()
        print(f"inferlab serve: {load_error(exc)}", file=sys.stderr)
        return 2

    from serving.app import create_app
    from serving.lifecycle import Server, uvicorn_config

    app = create_app(backend, server)
    # What exists now (model, tokenizer, libraries: ~400k objects) lives as long as the process.
    # Frozen out of the collector, it costs no full-collection pause while serving (seconds on
    # a busy machine, during which nothing is served). vLLM's server does the same.
    gc.collect()
    gc.freeze()
    serving = app.state.serving
    uvicorn_server = Server(
        uvicorn_config(app, server, log_config=log_config(server.log_level)),
        serving,
        server.shutdown_timeout_s,
    )
    facts = backend.describe()
    port = sock.getsockname()[1]
    print(
        f"inferlab serve: {facts['model']} ({facts['architecture']}, {facts['dtype']}, "
        f"{facts['device']}, kv_cache={facts['kv_cache']}, max_model_len="
        f"{facts['max_model_len']}, max_num_seqs={facts['max_num_seqs']}) on "
        f"http://{server.host}:{port}/v1",
        file=sys.stderr,
    )
    try:
        uvicorn_server.run(sockets=[sock])
    finally:
        serving.close()
        backend.close()
        sock.close()
        gc.unfreeze()  # finalized at exit as usual (frozen, triton reports them as leaked)
    return 0


def load_error(exc: Exception) -> str:
    """A failed model load as one line: the engine's own messages name the file; an OSError
    names it here."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    if isinstance(exc, ValueError | OSError):
        return str(exc)
    return f"cannot load the model: {type(exc).__name__}: {exc}".splitlines()[0]
