"""`engine.launch`: the server under test, started by the run (docs/managed_servers.md).

A command template, the flags of the server (`params`, spelled in its `flag_style`), where it
says it is ready and what version it is. The presets `engine=serve_inferlab|serve_vllm|
serve_sglang|serve_tgi|serve_llamacpp|serve_llama_cpp_python` are these fields as data
(configs/engine/); an empty `command` starts nothing (the server at `engine.base_url` is
measured, as before).

`server_command` turns the template into the command line: `{name}` fields are filled from the
run (TEMPLATE_FIELDS); an argument that is one field alone and has no value is an error naming
it, an argument with text around a field without a value (`model.path={model_path}`) is left
out.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engines.options import Options, option

FLAG_STYLES = ("dashes", "underscores", "hydra")

#: The fields a command template may name, and what each holds.
TEMPLATE_FIELDS = {
    "python": "this Python (sys.executable), for servers installed beside the lab",
    "host": "engine.launch.host",
    "port": "the port (engine.launch.port, else a free one picked per job)",
    "model": "what the server loads: model.path, else the model group's name",
    "model_name": "the model group's name (a preset of configs/model/)",
    "model_path": "model.path, else none",
    "model_file": "model.path, else the installed file of a packaged model, else none",
    "served_model_name": "engine.model: the name requests send",
    "threads": "engine.launch.threads, else the cores the job may run on (its placement)",
}


class LaunchConfigError(ValueError):
    """An `engine.launch` option has a value the run cannot start a server with."""


def _placeholders(argument: str) -> list[str]:
    """The `{field}` names in one argument (ValueError for a malformed template)."""
    return [name for _, name, _, _ in string.Formatter().parse(argument) if name is not None]


def _valid_template(command: list[str]) -> bool:
    try:
        return all(set(_placeholders(arg)) <= set(TEMPLATE_FIELDS) for arg in command)
    except ValueError:
        return False


def _is_path(path: str | None) -> bool:
    return path is None or path.startswith("/")


@dataclass(frozen=True)
class LaunchConfig(Options):
    prefix = "engine.launch."
    section = "engine.launch"
    error = LaunchConfigError

    command: list[str] = option(
        default_factory=list,
        empty=True,
        valid=_valid_template,
        allowed=f"a list of arguments; fields in braces: {'|'.join(TEMPLATE_FIELDS)}",
        help="the server's command line, a template; empty: start nothing",
    )
    params: dict[str, Any] = option(
        default_factory=dict,
        allowed="a mapping of the server's flags, e.g. {max_num_seqs: 64}",
        help="flags appended to the command, spelled by flag_style; null values are left out",
    )
    flag_style: str = option(
        "dashes",
        choices=FLAG_STYLES,
        help="dashes: --max-num-seqs 64 (true: --flag, false: --no-flag); underscores: "
        "--n_threads 2 (booleans as true/false); hydra: engine.max_num_seqs=64",
    )
    args: list[str] = option(
        default_factory=list, empty=True, help="arguments appended after params, as given"
    )
    env: dict[str, Any] = option(
        default_factory=dict,
        help="environment variables set for the server (values as text, booleans as "
        "true/false); null: the variable removed from the server's environment",
    )
    host: str = option("127.0.0.1", valid=bool, allowed="an address", help="where it listens")
    port: int = option(0, ge=0, le=65535, help="0: a free port picked for each server")
    health_path: str = option(
        "/health",
        valid=_is_path,
        allowed="a path from the server's root, e.g. /health",
        help="GET answering 200 once the server is ready",
    )
    version_path: str | None = option(
        None,
        valid=_is_path,
        allowed="null or a path from the server's root, e.g. /version",
        help="GET whose JSON holds the server's version (null: not asked)",
    )
    version_field: str = option(
        "version", valid=bool, allowed="a dotted field name", help="where the version is"
    )
    reset_path: str | None = option(
        None,
        valid=_is_path,
        allowed="null or a path from the server's root, e.g. /reset_prefix_cache",
        help="POST before each job that reuses the server: its caches emptied",
    )
    startup_timeout_s: float = option(
        600.0, gt=0, unit="seconds", help="from start until the health check answers 200"
    )
    stop_timeout_s: float = option(
        30.0, ge=0, unit="seconds", help="after SIGTERM, before SIGKILL to its process group"
    )
    reuse: bool = option(
        True, help="keep the server up for the next job when its command line is the same"
    )
    gpus: int = option(0, ge=0, help="GPUs the server takes (claimed per job by launchers)")
    threads: int | None = option(
        None, ge=1, help="the template's {threads}; null: the cores the job may run on"
    )

    @property
    def enabled(self) -> bool:
        return bool(self.command)


def flag_arguments(params: Mapping[str, Any], style: str) -> list[str]:
    """`params` as command-line arguments in `style` (FLAG_STYLES), in their order."""
    out: list[str] = []
    items = _flattened(params) if style == "hydra" else list(params.items())
    for name, value in items:
        if value is None:
            continue
        if style == "hydra":
            out.append(f"{name}={_hydra_value(value)}")
        elif style == "underscores":
            out += [f"--{name}", *_values(value)]
        elif isinstance(value, bool):
            out.append(f"--{name.replace('_', '-')}" if value else f"--no-{name.replace('_', '-')}")
        else:
            out += [f"--{name.replace('_', '-')}", *_values(value)]
    return out


def _flattened(params: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    for name, value in params.items():
        if isinstance(value, Mapping) and value:  # an empty one is a value: `key={}`
            items += _flattened(value, f"{prefix}{name}.")
        else:
            items.append((f"{prefix}{name}", value))
    return items


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping | list | tuple):
        # vLLM's --speculative-config and kin take JSON; str() would write Python's True, 'a'
        return json.dumps(value)
    return str(value)


def environment(env: Mapping[str, Any]) -> dict[str, str | None]:
    """`engine.launch.env` as the server's variables: values as text, spelled as in `params`
    (`true`, not Python's `True`); None for a null, the variable removed (a null param is left
    out, too: the server's default), never the text "None"."""
    return {str(k): None if v is None else _text(v) for k, v in env.items()}


def _values(value: Any) -> list[str]:
    if isinstance(value, list | tuple):
        return [_text(v) for v in value]
    return [_text(value)]


# What Hydra's override grammar reads unquoted as the very same text; anything else (a comma,
# which it takes for a sweep, brackets, quotes, spaces, non-ASCII letters) is quoted.
_HYDRA_PLAIN = re.compile(r"[A-Za-z0-9_\-+./:~@%*]+")


def _hydra_value(value: Any) -> str:
    if isinstance(value, list | tuple):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    text = _text(value)
    if not isinstance(value, str) or _HYDRA_PLAIN.fullmatch(text):
        return text
    # quoted: Hydra reads a backslash as an escape only before a quote or at the end, so those
    # backslashes are doubled and each quote escaped
    body = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", text)
    body = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, body)
    return "'" + body + "'"


def server_command(launch: LaunchConfig, fields: Mapping[str, Any]) -> list[str]:
    """The command line: the template filled from `fields` (TEMPLATE_FIELDS), then params and
    args. LaunchConfigError names a field an argument needs and the run does not have."""
    command = []
    for argument in launch.command:
        names = _placeholders(argument)
        missing = [n for n in names if fields.get(n) in (None, "")]
        if missing and argument == "{" + missing[0] + "}":
            raise LaunchConfigError(
                f"engine.launch.command: {argument} has no value in this run "
                f"({missing[0]}: {TEMPLATE_FIELDS[missing[0]]})"
            )
        if not missing:
            command.append(argument.format(**fields))
    return command + flag_arguments(launch.params, launch.flag_style) + list(launch.args)
