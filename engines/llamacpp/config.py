"""Options of `engine=llamacpp`, validated once at the edge like the other backends'."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from engines.base import ConfigError
from models.location import model_location

FLASH_ATTN = ("auto", "on", "off")
# the model file's tensors re-encoded first (`inferlab convert`, cached): an equal-precision
# llama.cpp row (f32/f16/bf16) or another of its formats on the same weights
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1")


@dataclass
class LlamaCppConfig:
    # the model group fills these three: a GGUF file (model=smollm2-135m, or model=hf
    # model.path=FILE.gguf); llama.cpp reads its own config and weights from the file
    model: str = "smollm2-135m"
    model_overrides: dict[str, Any] = field(default_factory=dict)
    tokenizer: str | None = None
    # null: run the file as it is; else one of GGUF_TYPES: its tensors re-encoded to that type
    # (dequantized from the file, so the same weights), converted once into the cache
    gguf_type: str | None = None
    # None: torch's thread count, the one the built-in engine runs with by default, so the two
    # compute with the same number of cores
    num_threads: int | None = None
    num_threads_batch: int | None = None  # prompt processing; None: num_threads
    # sequences decoded together (continuous batching over llama.cpp's per-sequence KV); each
    # holds max_model_len KV cells of its own
    max_num_seqs: int = 8
    max_model_len: int | None = None  # None: min(the model's training context, 2048)
    # tokens per llama_decode call (prompts longer than what is left go in chunks), and
    # llama.cpp's n_batch = n_ubatch; at least max_num_seqs
    max_num_batched_tokens: int = 512
    flash_attn: str = "auto"  # llama.cpp's own default (auto: on for the CPU)
    seed: int = 0  # sampling seed of requests that set none (SamplingParams.seed)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> LlamaCppConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"engine (backend=llamacpp): unknown option(s) {unknown}; known options: "
                f"{sorted(known)}"
            )
        return cls(**values).validate()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def validate(self) -> LlamaCppConfig:
        def bad(name: str, allowed: str) -> ConfigError:
            return ConfigError(
                f"engine.{name}: {getattr(self, name)!r} is invalid; allowed: {allowed}"
            )

        self.model = model_location(self.model)  # a trained or packaged model's location
        if self.flash_attn not in FLASH_ATTN:
            raise bad("flash_attn", "|".join(FLASH_ATTN))
        if self.gguf_type is not None and self.gguf_type not in GGUF_TYPES:
            raise bad("gguf_type", "null|" + "|".join(GGUF_TYPES))
        for name, low, optional in (
            ("num_threads", 1, True),
            ("num_threads_batch", 1, True),
            ("max_num_seqs", 1, False),
            ("max_model_len", 2, True),
            ("max_num_batched_tokens", 1, False),
            ("seed", None, False),
        ):
            value = getattr(self, name)
            if value is None and optional:
                continue
            # bool is an int to Python; "abc" < 2 would be a TypeError naming nothing
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or (low is not None and value < low)
            ):
                prefix = "null or " if optional else ""
                raise bad(name, f"{prefix}an integer" + (f" >= {low}" if low else ""))
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise bad(
                "max_num_batched_tokens",
                f"an integer >= max_num_seqs={self.max_num_seqs} (one decode token per sequence)",
            )
        if self.model_overrides:
            raise ConfigError(
                f"model.overrides: {self.model_overrides!r} is invalid with engine=llamacpp; "
                "allowed: {} (llama.cpp reads the model's config from the GGUF file)"
            )
        if self.tokenizer is not None:
            raise ConfigError(
                f"model.tokenizer: {self.tokenizer!r} is invalid with engine=llamacpp; allowed: "
                "null (the GGUF file's own tokenizer)"
            )
        return self
