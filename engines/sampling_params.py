"""Per-request generation settings, shared by every backend (vLLM's names and meanings)."""

from __future__ import annotations

from dataclasses import dataclass, field

#: The most top log-probabilities a position may ask for (vLLM's default max_logprobs, and
#: OpenAI's cap on top_logprobs)
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How one request is decoded and when it stops.

    `temperature=0` means greedy. `top_k=0` or `-1` disables top-k; `top_p=1` disables top-p.
    `ignore_eos` keeps generating past EOS (benchmarks need exact output lengths);
    `min_tokens` suppresses EOS and stop tokens until that many tokens exist.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_tokens: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True
    n: int = 1
    # log-probabilities of each output token and of the `logprobs` most likely at its position
    # (0: the sampled token's only; None: none), from the model's raw logits as vLLM v1's
    # default (`logprobs_mode=raw_logprobs`): before temperature, top-k/top-p and masks
    logprobs: int | None = None
    # the same for every prompt token after the first (the first has nothing before it); a
    # request that asks computes its whole prompt, past any prefix-cache hit, as vLLM does
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(
                f"SamplingParams.{name}: {getattr(self, name)!r} is invalid; allowed: {allowed}"
            )

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "an integer >= 1")
        if not 0 <= self.temperature < float("inf"):  # also refuses NaN
            raise bad("temperature", "a number >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "a number in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "-1 or 0 (disabled) or an integer >= 1")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"an integer in [0, max_tokens={self.max_tokens}]")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1")
        # torch generators take seeds in [-2^63, 2^64); sample i of n is seeded seed + i
        if self.seed is not None and (
            not isinstance(self.seed, int) or not -(2**63) <= self.seed <= 2**64 - self.n
        ):
            raise bad("seed", f"null or an integer in [-2^63, 2^64 - n] (n={self.n})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative token ids")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int)
                or isinstance(value, bool)
                or not 0 <= value <= MAX_LOGPROBS
            ):
                raise bad(name, f"null or an integer in [0, {MAX_LOGPROBS}]")
