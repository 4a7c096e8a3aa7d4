"""`inferlab train-tiny`: train a small Llama-shaped model on CPU (a minute for tiny-trained).

The command around models/train_tiny.py, which trains and caches the models: its options, and
its plain mistakes as one line naming the option, exit 2."""

from __future__ import annotations

import argparse
import json
import sys

from harness.arguments import at_least
from models.files import UserFileError, check_model_output
from models.train_tiny import DEFAULTS, TRAINED_MODELS, cached_tiny_model, train_tiny

#: what both torch.manual_seed and numpy's generators take
MAX_SEED = 2**64 - 1


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(
            f"{text!r} is invalid; allowed: an integer in [0, 2**64 - 1]"
        )
    return value


def _error(message: str) -> int:
    print(f"inferlab train-tiny: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="inferlab train-tiny", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--text", help="training text file (default: the shipped corpus)")
    parser.add_argument("--out", help="output folder (default: the cache, reused if present)")
    parser.add_argument(
        "--force", action="store_true", help="write over an --out folder that is not empty"
    )
    parser.add_argument(
        "--model",
        default="tiny-trained",
        choices=list(TRAINED_MODELS),
        help="which shape (default: tiny-trained)",
    )
    parser.add_argument(
        "--steps", type=at_least(1), help="training steps, >= 1 (default: the model's)"
    )
    parser.add_argument("--seed", type=_seed, help=f"default: {DEFAULTS['seed']}")
    args = parser.parse_args(argv)
    params = dict(TRAINED_MODELS[args.model])
    params.update({k: v for k, v in (("steps", args.steps), ("seed", args.seed)) if v is not None})
    try:  # before training: a checkpoint already there is replaced only when asked
        if args.out:
            check_model_output(args.out, "--out", folder=True, force=args.force)
    except UserFileError as exc:
        return _error(str(exc))
    try:
        if args.out:
            out = train_tiny(args.text, args.out, **{**DEFAULTS, **params})
        else:
            out = cached_tiny_model(args.text, **params)
    except UserFileError as exc:  # --text missing, not a regular file, too large, not UTF-8
        return _error(f"--text: {exc}")
    except OSError as exc:  # the model could not be written (an unwritable --out, a full disk)
        return _error(f"{exc.filename or args.out}: cannot be written: {exc.strerror or exc}")
    log = json.loads((out / "train_log.json").read_text())
    print(
        f"{out}\n  steps {log['steps']}  loss {log['first_loss']:.3f} -> "
        f"{log['final_loss']:.3f}  ({log['seconds']} s, {log['parameters']:,} parameters)"
    )
    return 0
