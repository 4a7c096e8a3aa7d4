"""Text <-> token ids for the built-in engine: loading, chat templates, streaming detokenization.

Everything runs through the Hugging Face ``tokenizers`` library; nothing here imports
``transformers`` or touches the network.

Default tokenizer
    ``load_tokenizer(None)`` / ``default_tokenizer()`` give a byte-level BPE trained by the
    project on ``models/data/*.txt`` (sorted by name) with a target vocabulary of 4096.
    The corpus is small, so merges may run out before that (about 3.9k today): the real size is
    ``Tokenizer.vocab_size``. Ids 0..6 are the special tokens
    ``<|bos|> <|eos|> <|pad|> <|system|> <|user|> <|assistant|> <|end|>``; ids 7..262 are the
    256 byte symbols, so any text encodes and every id decodes. Generation ends on ``<|eos|>``
    or ``<|end|>`` (the latter closes every chat turn). Training is deterministic, and the
    result is cached as ``tokenizer-<key>.json`` in ``$INFERLAB_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/inferlab``, else ``~/.cache/inferlab``, where ``key`` is a hash of the
    corpus bytes and trainer settings. Special-token text inside user content (``"<|end|>"``)
    is encoded as that special token, as Hugging Face tokenizers do.

Chat templates
    Templates are Jinja, rendered in a bounded sandbox (models/chat_template.py: steps,
    sizes and output have limits) with ``trim_blocks``/``lstrip_blocks`` like
    ``transformers``, and get ``messages``, ``add_generation_prompt``, ``bos_token``,
    ``eos_token``, ``tools=None``, ``documents=None`` and ``raise_exception``. The default
    tokenizer (and any tokenizer holding its role tokens but no template) uses::

        {% for m in messages %}<|{{ m['role'] }}|>
        {{ m['content'] }}<|end|>
        {% endfor %}{% if add_generation_prompt %}<|assistant|>
        {% endif %}

    which allows only the roles system, user and assistant. Other tokenizers without a
    template get a plain one that needs no special tokens: ``"{role}: {content}\\n"`` per
    message, then ``"assistant: "`` as the generation prompt.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as _Backend
from tokenizers.decoders import DecodeStream

from models.cache import cache_dir, check_trusted, write_text_atomic
from models.chat_template import check_template, render_template
from models.files import SETTINGS, check_regular_file, check_size, read_input_text
from models.gguf import is_gguf, tokenizer_folder

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = (
    "<|bos|>",
    "<|eos|>",
    "<|pad|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
)
TARGET_VOCAB_SIZE = 4096
# Even pairs seen once in this small corpus are mostly common English/code fragments: merging
# them measured better compression on unseen text (3.6 vs 3.0 chars/token) than requiring two.
_MIN_FREQUENCY = 1
#: the shipped corpus: the default tokenizer's training text, and train-tiny's
CORPUS_DIR = Path(__file__).with_name("data")
_CHAT_ROLES = ("system", "user", "assistant")

DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
PLAIN_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)
# Tokens that commonly end generation; used only when no config names an EOS token.
_KNOWN_EOS = ("<|eos|>", "</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|im_end|>")
# Prompt ids the stream decodes for context: enough for SentencePiece-style leading-space
# rules, small enough that creating a stream stays O(1) for long prompts.
_STREAM_CONTEXT_IDS = 6


@dataclass(frozen=True)
class SpecialTokens:
    bos_id: int | None
    eos_ids: tuple[int, ...]  # every id that ends generation
    pad_id: int | None


class Tokenizer:
    """Text <-> token ids, chat templates, and streaming detokenization."""

    def __init__(
        self,
        backend: _Backend,
        *,
        name: str,
        special: SpecialTokens,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool | None = None,
    ) -> None:
        self._backend = backend
        self.name = name
        self.special = special
        added = backend.get_added_tokens_decoder()
        # Added tokens may sit above the model vocabulary with gaps; every id up to the
        # largest one must be decodable.
        self.vocab_size = max(
            [backend.get_vocab_size(with_added_tokens=True), *(i + 1 for i in added)]
        )
        self._special_ids = frozenset(i for i, t in added.items() if t.special) | {
            i for i in (special.bos_id, special.pad_id, *special.eos_ids) if i is not None
        }
        bos = special.bos_id
        self._bos_token = bos_token or (backend.id_to_token(bos) if bos is not None else None)
        eos = special.eos_ids[0] if special.eos_ids else None
        self._eos_token = eos_token or (backend.id_to_token(eos) if eos is not None else None)
        # tokenizer.json's post-processor decides BOS, unless the config says otherwise
        # (the way transformers rebuilds the post-processor from add_bos_token).
        pp_adds = bos is not None and _post_processor_bos(backend) == bos
        wants = pp_adds if add_bos_token is None else (add_bos_token and bos is not None)
        self._adds_bos = wants
        self._prepend_bos = wants and not pp_adds
        self._strip_bos = pp_adds and not wants
        if chat_template is None:
            roles = (*_CHAT_ROLES, "end")
            has_roles = all(backend.token_to_id(f"<|{r}|>") is not None for r in roles)
            chat_template = DEFAULT_CHAT_TEMPLATE if has_roles else PLAIN_CHAT_TEMPLATE
        self._chat_template = chat_template

    def __repr__(self) -> str:
        return f"Tokenizer(name={self.name!r}, vocab_size={self.vocab_size})"

    @property
    def chat_template(self) -> str:
        return self._chat_template

    @property
    def bos_token(self) -> str | None:
        """BOS as text (what a chat template writes for it), or None."""
        return self._bos_token

    @property
    def eos_token(self) -> str | None:
        """The first EOS as text, or None."""
        return self._eos_token

    @property
    def pad_token(self) -> str | None:
        pad = self.special.pad_id
        return None if pad is None else self._backend.id_to_token(pad)

    @property
    def adds_bos(self) -> bool:
        """Whether encode(text) starts with BOS (transformers' `add_bos_token`)."""
        return self._adds_bos

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each id's token as the vocabulary spells it (byte-level BPE: "Ġthe" for " the"),
        transformers' convert_ids_to_tokens; "" for an id the tokenizer does not know."""
        to_token = self._backend.id_to_token
        return [to_token(i) or "" for i in ids]

    @property
    def backend(self) -> _Backend:
        """The underlying ``tokenizers.Tokenizer`` (for batch encoding or inspection)."""
        return self._backend

    def save_pretrained(self, folder: str | os.PathLike[str]) -> Path:
        """A Hugging Face tokenizer folder (tokenizer.json, tokenizer_config.json), so that a
        client (guidellm, AIPerf, transformers) counts in this tokenizer's tokens offline."""
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(out / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self._bos_token,
            "eos_token": self._eos_token,
            "chat_template": self._chat_template,
        }
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
        return out

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = _encode_ids(self._backend, text, add_special_tokens)
        bos = self.special.bos_id
        if add_special_tokens and self._prepend_bos and bos is not None:
            ids.insert(0, bos)
        elif add_special_tokens and self._strip_bos and ids[:1] == [bos]:
            del ids[0]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids the tokenizer does not know decode to nothing (the ``tokenizers`` behaviour)."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of special tokens (added tokens marked special, plus BOS/EOS/pad)."""
        return self._special_ids

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template reads `tools` (Qwen2's does; SmolLM2's does not)."""
        return "tools" in self._chat_template

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        is_default = self._chat_template == DEFAULT_CHAT_TEMPLATE
        _validate_messages(messages, _CHAT_ROLES if is_default else None)
        return render_template(
            self._chat_template,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._bos_token or "",
            eos_token=self._eos_token or "",
            tools=tools,
            documents=None,
        )

    def encode_prompt(self, prompt: object) -> list[int]:
        """A request's prompt as token ids, the same way in every backend: text, a list of
        token ids as given, or chat messages through the chat template."""
        if isinstance(prompt, str):
            if not prompt:  # it would encode to BOS alone and generate from nothing
                raise ValueError("prompt: empty; allowed: a prompt with at least one token")
            return self.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            return self.encode_chat(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise ValueError(
            "prompt: expected a string, a list of token ids or a list of chat "
            f"messages, got {type(prompt).__name__}"
        )

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Render and encode a conversation; BOS appears once whether or not the template wrote it.

        Other post-processor additions (such as a trailing EOS) are never applied to chats.
        """
        text = self.apply_chat_template(messages, add_generation_prompt, tools)
        ids = _encode_ids(self._backend, text, False)
        bos, bos_text = self.special.bos_id, self._bos_token
        if self._adds_bos and bos is not None and not (bos_text and text.startswith(bos_text)):
            ids.insert(0, bos)
        return ids

    def new_stream(
        self, prompt_ids: Sequence[int] | None = None, skip_special_tokens: bool = True
    ) -> DetokenizerStream:
        return DetokenizerStream(self._backend, prompt_ids, skip_special_tokens)


class DetokenizerStream:
    """Incremental detokenization for one sequence: feed ids one at a time, get text deltas
    that never contain broken UTF-8 (a partial multi-byte character is held back until complete).

    Built on ``tokenizers.decoders.DecodeStream``, which holds text back while its decoding ends
    in U+FFFD; ``flush`` releases that tail, replacement characters included.
    """

    def __init__(
        self, backend: _Backend, prompt_ids: Sequence[int] | None, skip_special_tokens: bool
    ) -> None:
        self._backend = backend
        self._skip = skip_special_tokens
        tail = list(prompt_ids[-_STREAM_CONTEXT_IDS:]) if prompt_ids else []
        self._context = self._whole_chars(tail)
        self._ids: list[int] = []
        self._held = 0  # ids fed since the last non-empty delta
        self._parts: list[str] = []
        self._stream = self._new_decode_stream(self._context)

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of every delta)."""
        if len(self._parts) > 1:  # join lazily so step() stays O(1) amortised
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def step(self, token_id: int) -> str:
        self._ids.append(token_id)
        self._held += 1
        try:
            delta = self._stream.step(self._backend, token_id) or ""
        except Exception:
            # Raised when a decoder rewrites text it already produced (cleanup rules, or a
            # prompt tail ending mid-character); recover from a full decode instead.
            delta = self._release()
        return self._emit(delta)

    def flush(self) -> str:
        return self._emit(self._release()) if self._held else ""

    def _emit(self, delta: str) -> str:
        if delta:
            self._parts.append(delta)
            self._held = 0
        return delta

    def _release(self) -> str:
        """Text not yet emitted, from a full decode; restarts DecodeStream after it."""
        decode = functools.partial(self._backend.decode, skip_special_tokens=self._skip)
        full, base = decode(self._context + self._ids), decode(self._context)
        out = full[len(base) :] if full.startswith(base) else decode(self._ids)
        text = self.text
        delta = out[len(text) :] if out.startswith(text) else decode(self._ids[-self._held :])
        tail = (self._context + self._ids)[-_STREAM_CONTEXT_IDS:]
        self._stream = self._new_decode_stream(self._whole_chars(tail))
        return delta

    def _whole_chars(self, context: list[int]) -> list[int]:
        # DecodeStream re-emits its whole prefill when that decodes to text ending in U+FFFD
        # (say a prompt cut mid-character), so leave such a tail out of the context.
        while context and self._backend.decode(context, self._skip).endswith("\ufffd"):
            context = context[:-1]
        return context

    def _new_decode_stream(self, context: list[int]) -> DecodeStream:
        try:
            return DecodeStream(ids=context, skip_special_tokens=self._skip)
        except TypeError:  # tokenizers < 0.22 has no prefill; feed the context and drop its text
            stream = DecodeStream(skip_special_tokens=self._skip)
            for i in context:
                stream.step(self._backend, i)
            return stream


def load_tokenizer(path: str | os.PathLike[str] | None = None) -> Tokenizer:
    """Load a tokenizer: None -> the default project tokenizer; a ``tokenizer.json`` file; or a
    Hugging Face folder (``tokenizer.json`` plus optional ``tokenizer_config.json``,
    ``chat_template.jinja``, ``generation_config.json``, ``config.json``). Never downloads.

    A ``chat_template`` list in ``tokenizer_config.json`` uses the entry named "default" (else
    the first). Without any config, EOS is guessed from well-known token names.
    """
    if path is None:
        return _load_default()
    p = Path(path)
    if p.is_dir():
        folder, file = p, p / "tokenizer.json"
        if os.path.lexists(file):  # a FIFO, a folder or a dangling link: named, never opened
            check_regular_file(file)
        else:
            raise FileNotFoundError(
                f"tokenizer folder {str(p)!r} has no tokenizer.json (the Hugging Face fast-"
                "tokenizer file is required; a slow-only folder can be converted with "
                "transformers' AutoTokenizer(...).save_pretrained())"
            )
    elif os.path.lexists(p):
        check_regular_file(p)
        folder, file = None, p
    else:
        raise FileNotFoundError(
            f"tokenizer path {str(p)!r} does not exist (expected a tokenizer.json file or a "
            "folder containing tokenizer.json)"
        )
    check_size(file, file.stat().st_size, SETTINGS)  # `tokenizers` reads it whole
    try:
        backend = _Backend.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise ValueError(f"{str(file)!r} is not a valid tokenizer.json: {e}") from e

    cfg = _read_json(folder / "tokenizer_config.json") if folder else {}
    gen = _read_json(folder / "generation_config.json") if folder else {}
    model = _read_json(folder / "config.json") if folder else {}
    if isinstance(model.get("text_config"), dict):  # multimodal configs nest the LM's ids
        model = {**model["text_config"], **model}

    template = _configured_template(cfg.get("chat_template"), folder)
    if folder and (folder / "chat_template.jinja").is_file():
        template = read_input_text(folder / "chat_template.jinja", SETTINGS)
        check_template(template, folder / "chat_template.jinja")

    bos_token, eos_token, pad_token = (
        _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token")
    )
    bos_id = _first_int(
        _token_id(backend, bos_token), gen.get("bos_token_id"), model.get("bos_token_id")
    )
    if bos_id is None and not cfg:
        bos_id = _post_processor_bos(backend)
    eos_ids = [_token_id(backend, eos_token)]
    for source in (gen, model):
        value = source.get("eos_token_id")
        eos_ids += value if isinstance(value, list) else [value]
    eos = [i for i in dict.fromkeys(eos_ids) if isinstance(i, int)]
    if not eos:
        eos = [i for t in _KNOWN_EOS if (i := _token_id(backend, t)) is not None][:1]
    pad_id = _first_int(
        _token_id(backend, pad_token), gen.get("pad_token_id"), model.get("pad_token_id")
    )
    add_bos = cfg.get("add_bos_token")
    return Tokenizer(
        backend,
        name=os.fspath(path),
        special=SpecialTokens(bos_id, tuple(eos), pad_id),
        chat_template=template if isinstance(template, str) else None,
        bos_token=bos_token,
        eos_token=eos_token,
        add_bos_token=add_bos if isinstance(add_bos, bool) else None,
    )


def tokenizer_for_model(model: str, tokenizer: str | None = None) -> Tokenizer:
    """The tokenizer a model runs with: `tokenizer` when given, else the checkpoint folder's
    tokenizer.json (or the one a GGUF file's metadata holds), else the project's default BPE
    (every backend picks it the same way)."""
    if tokenizer:
        return load_tokenizer(tokenizer)
    if is_gguf(model):
        return load_tokenizer(tokenizer_folder(model))
    folder = Path(model)
    # lexists: a tokenizer.json that is there but is not a file is an error, not a fallback
    if folder.is_dir() and os.path.lexists(folder / "tokenizer.json"):
        return load_tokenizer(folder)
    return default_tokenizer()


@functools.cache
def default_tokenizer() -> Tokenizer:
    """The default project tokenizer, built or loaded once per process."""
    return load_tokenizer(None)


def _trainer_params() -> dict[str, Any]:
    return {
        "model": "bpe",
        "pre_tokenizer": "byte_level(add_prefix_space=False)",
        "vocab_size": TARGET_VOCAB_SIZE,
        "min_frequency": _MIN_FREQUENCY,
        "special_tokens": list(SPECIAL_TOKENS),
        "bos_post_processor": True,
    }


def train_default_tokenizer(corpus: Sequence[str]) -> str:
    """Train the default byte-level BPE on ``corpus`` (one text per file) -> tokenizer.json text."""
    backend = _Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB_SIZE,
        min_frequency=_MIN_FREQUENCY,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        # All 256 byte symbols up front, so text never seen in training still encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = (line for text in corpus for line in text.splitlines(keepends=True))
    backend.train_from_iterator(lines, trainer)
    bos = SPECIAL_TOKENS[0]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B:1", special_tokens=[(bos, 0)]
    )
    return backend.to_str()


def _load_default() -> Tokenizer:
    corpus = [p.read_bytes() for p in sorted(CORPUS_DIR.glob("*.txt"))]
    if not corpus:
        raise FileNotFoundError(
            f"no *.txt training corpus for the default tokenizer in {CORPUS_DIR}"
        )
    digest = hashlib.sha256(json.dumps(_trainer_params(), sort_keys=True).encode())
    for data in corpus:  # length-prefixed so moving bytes between files changes the key
        digest.update(len(data).to_bytes(8, "little") + data)
    key = digest.hexdigest()[:16]
    path = check_trusted(cache_dir() / f"tokenizer-{key}.json", "tokenizer cache")
    backend = None
    if path.is_file():
        try:
            backend = _Backend.from_file(str(path))
        except Exception:
            logger.warning("cached tokenizer %s is unreadable; retraining", path)
    if backend is None:
        text = train_default_tokenizer([data.decode("utf-8") for data in corpus])
        _write_atomic(path, text)
        backend = _Backend.from_str(text)
    ids = {t: backend.token_to_id(t) for t in SPECIAL_TOKENS}
    eos, end = ids["<|eos|>"], ids["<|end|>"]
    assert eos is not None and end is not None  # trained in as special tokens
    return Tokenizer(
        backend,
        name=f"inferlab-bpe-{key[:8]}",
        special=SpecialTokens(ids["<|bos|>"], (eos, end), ids["<|pad|>"]),
        chat_template=DEFAULT_CHAT_TEMPLATE,
    )


def _write_atomic(path: Path, text: str) -> None:
    try:
        write_text_atomic(path, text)
    except OSError as e:
        logger.warning("cannot cache tokenizer at %s (%s); using it from memory", path, e)


def _post_processor_bos(backend: _Backend) -> int | None:
    """The special id the post-processor puts in front of a text, if any."""
    try:
        with_special = backend.encode("a", add_special_tokens=True).ids
        plain = backend.encode("a", add_special_tokens=False).ids
    except Exception:  # e.g. a WordLevel vocabulary without "a" or an unk token
        return None
    if len(with_special) > len(plain) and with_special[:1] != plain[:1]:
        token = backend.get_added_tokens_decoder().get(with_special[0])
        return with_special[0] if token is not None and token.special else None
    return None


# `tokenizers`' single encode holds the GIL for the whole text, its batch encode releases it
# (same ids). Long texts take the batch call, so that other threads (a server's event loop)
# keep running while one is encoded; short ones keep the cheaper single call.
_RELEASE_GIL_CHARS = 16384


def _encode_ids(backend: _Backend, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) < _RELEASE_GIL_CHARS:
        return backend.encode(text, add_special_tokens=add_special_tokens).ids
    return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def _configured_template(value: object, folder: Path | None) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of {"name", "template"}
    whose "default" (else first) entry is used; anything else names the file."""
    where = f"{folder / 'tokenizer_config.json'}: chat_template" if folder else "chat_template"
    if value is None:
        return None
    if isinstance(value, list) and all(
        isinstance(t, dict) and isinstance(t.get("template"), str) for t in value
    ):
        named = {t.get("name"): t["template"] for t in value}
        value = named.get("default", value[0]["template"] if value else None)
    if value is not None and not isinstance(value, str):
        raise ValueError(
            f"{where}: {value!r:.80} is invalid; allowed: a Jinja template string or a list "
            'of {"name": ..., "template": "..."}'
        )
    if value is not None:
        check_template(value, where)
    return value


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(read_input_text(path, SETTINGS))
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(path)!r} is not valid JSON: {e}") from e
    except RecursionError:  # nested past Python's recursion limit
        raise ValueError(f"{str(path)!r} is not valid JSON: nested too deeply") from None
    return data if isinstance(data, dict) else {}


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):  # serialised AddedToken
        value = value.get("content")
    return value if isinstance(value, str) else None


def _first_int(*values: object) -> int | None:
    return next((v for v in values if isinstance(v, int) and not isinstance(v, bool)), None)


def _token_id(backend: _Backend, token: str | None) -> int | None:
    return backend.token_to_id(token) if token else None


def _validate_messages(messages: object, roles: tuple[str, ...] | None) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': str, 'content': str} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        for field in ("role", "content"):
            if not isinstance(m.get(field), str):
                got = type(m.get(field)).__name__ if field in m else "nothing"
                raise ValueError(f"messages[{i}][{field!r}] must be a str, got {got}")
        if roles is not None and m["role"] not in roles:
            raise ValueError(
                f"messages[{i}] has role {m['role']!r}; allowed roles: {', '.join(roles)}"
            )


def stream_step(stream: DetokenizerStream | None, token_id: int, vocab_size: int) -> str:
    """The text `token_id` adds to `stream`: none without a stream, nor for an id past the
    tokenizer's `vocab_size` (a model's embedding may have more rows than it has tokens)."""
    if stream is None or token_id >= vocab_size:
        return ""
    return stream.step(token_id)
