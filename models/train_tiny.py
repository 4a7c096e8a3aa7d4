"""Small Llama-shaped models with learned weights, trained on CPU (a minute for tiny-trained);
`inferlab train-tiny` (harness/train_tiny_cli.py) is the command.

The dummy presets have random weights, so their logits carry no signal: a quantization or
dtype change cannot be judged on them. This trains a small real model (Hugging Face
``LlamaForCausalLM``, fp32, CPU) on a text file (default: the shipped corpus
``models/data/*.txt``) with the project's default tokenizer, and saves a checkpoint
folder the engine loads with ``LLM(model=folder)``: ``config.json``, ``model.safetensors``,
``tokenizer.json`` and ``train_log.json``.

Training is seeded and deterministic on a given machine and thread count: ``torch.manual_seed``,
batches drawn from a ``numpy`` Generator, AdamW with linear warmup then cosine decay.
``max_position_embeddings`` equals ``seq_len`` (the model never saw longer contexts).

``cached_tiny_model(...)`` trains once per (text, settings) and reuses the folder
``$INFERLAB_CACHE_DIR`` (else ``$XDG_CACHE_HOME/inferlab``, else ``~/.cache/inferlab``)
``/tiny-trained-<hash>``. ``TRAINED_MODELS`` names the models `model=` (and a speculative
draft's `model`) accepts: ``tiny-trained``, and ``tiny-trained-large`` with
``tiny-trained-draft``, a target and its draft for speculative decoding.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.files import DATA, UserFileError, read_input_text
from models.tokenizer import CORPUS_DIR

DEFAULTS: dict[str, Any] = dict(
    steps=200,
    seed=0,
    hidden=128,
    layers=4,
    heads=4,
    kv_heads=2,
    intermediate=384,
    seq_len=128,
    batch=16,
    lr=3e-3,
)

# name -> settings over DEFAULTS. A draft / target pair for speculative decoding, trained on the
# same text and tokenizer until both nearly recite it (so the draft guesses what the target
# says): the target has 29M parameters, the shape class where a decode step on this CPU costs
# weights rather than per-layer overhead; the draft is tiny-trained's 1.8M shape (6%) trained
# five times longer.
TRAINED_MODELS: dict[str, dict[str, Any]] = {
    "tiny-trained": {},
    "tiny-trained-large": dict(
        hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1536, batch=8, steps=800, lr=2e-3
    ),
    "tiny-trained-draft": dict(steps=1000),
}


def trained_model_path(name: str) -> Path:
    """The checkpoint folder of the trained model `name` (a key of TRAINED_MODELS), in the
    cache: trained on first use."""
    return cached_tiny_model(**TRAINED_MODELS[name])


def corpus_text(text_path: str | Path | None = None) -> str:
    """The training text: the file given (a regular file within the limit for text: not a
    FIFO or /dev/zero), else the shipped corpus (sorted by name, joined)."""
    if text_path is not None:
        return read_input_text(text_path, DATA)
    return "\n".join(p.read_text(encoding="utf-8") for p in sorted(CORPUS_DIR.glob("*.txt")))


def train_tiny(
    text_path: str | Path | None,
    out_dir: str | Path,
    steps: int = 200,
    seed: int = 0,
    hidden: int = 128,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 384,
    seq_len: int = 128,
    batch: int = 16,
    lr: float = 3e-3,
) -> Path:
    """Train and save a tiny Llama; returns the checkpoint folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from models.tokenizer import default_tokenizer

    for name, value in (("steps", steps), ("batch", batch), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"train-tiny: {name}={value!r} is invalid; allowed: an integer >= 1")
    start = time.perf_counter()
    tok = default_tokenizer()
    ids = np.asarray(tok.encode(corpus_text(text_path), add_special_tokens=False), np.int64)
    if len(ids) <= seq_len + 1:
        raise UserFileError(
            f"{text_path or CORPUS_DIR}: {len(ids)} tokens; allowed: a text of more than "
            f"{seq_len + 1} tokens (one training window)"
        )
    vocab = -(-tok.vocab_size // 64) * 64
    bos = tok.special.bos_id
    eos = tok.special.eos_ids[0] if tok.special.eos_ids else None

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=seq_len,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config).float()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    rng = np.random.default_rng(seed)
    data = torch.from_numpy(ids)
    losses: list[float] = []
    for _ in range(steps):
        starts = rng.integers(0, len(ids) - seq_len, size=batch)
        x = torch.stack([data[s : s + seq_len] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tok.backend.save(str(out / "tokenizer.json"))
    log = dict(
        steps=steps,
        seed=seed,
        tokens=len(ids),
        vocab_size=vocab,
        parameters=sum(p.numel() for p in model.parameters()),
        first_loss=losses[0] if losses else None,
        final_loss=float(np.mean(losses[-10:])) if losses else None,
        losses=[round(v, 4) for v in losses],
        seconds=round(time.perf_counter() - start, 2),
        threads=torch.get_num_threads(),
    )
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    return out


def cache_key(text_path: str | Path | None = None, **params: Any) -> str:
    from models.tokenizer import default_tokenizer

    settings = {**DEFAULTS, **params}
    h = hashlib.sha256(corpus_text(text_path).encode())
    h.update(json.dumps(settings, sort_keys=True).encode())
    h.update(default_tokenizer().backend.to_str().encode())
    return h.hexdigest()[:16]


def cached_tiny_model(text_path: str | Path | None = None, **params: Any) -> Path:
    """Train once per (text, settings, tokenizer) into the cache dir; reuse it afterwards."""
    from models.cache import build_folder_once, cache_dir

    out = cache_dir() / f"tiny-trained-{cache_key(text_path, **params)}"
    return build_folder_once(
        out,
        "config.json",
        lambda tmp: train_tiny(text_path, tmp, **{**DEFAULTS, **params}),
        "trained-model cache",
    )
