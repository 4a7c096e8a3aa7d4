"""Per-request generation settings, shared by every backend (vLLM's names and meanings)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engines.structured_outputs import StructuredOutputsParams

#: The most top log-probabilities a position may ask for (vLLM's default max_logprobs, and
#: OpenAI's cap on top_logprobs)
MAX_LOGPROBS = 20

#: Fields that change which token is chosen beyond temperature, top-k and top-p: a backend
#: that cannot apply them refuses them rather than sample without them
LOGITS_FIELDS = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "best_of",
    "structured_outputs",
)

#: vLLM's (and OpenAI's) ranges for the penalties and biases
PENALTY_RANGE = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2]
LOGIT_BIAS_RANGE = 100.0  # logit_bias values lie in [-100, 100]


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
    # draw best_of samples and return the n whose summed log-probabilities (the raw logits',
    # as `logprobs` reports them) are highest, as vLLM 0.x did; None: n. They arrive at the end
    best_of: int | None = None
    # log-probabilities of each output token and of the `logprobs` most likely at its position
    # (0: the sampled token's only; None: none), from the model's raw logits as vLLM v1's
    # default (`logprobs_mode=raw_logprobs`): before temperature, top-k/top-p and masks
    logprobs: int | None = None
    # the same for every prompt token after the first (the first has nothing before it); a
    # request that asks computes its whole prompt, past any prefix-cache hit, as vLLM does
    prompt_logprobs: int | None = None
    # Penalties and masks on the logits before temperature, in vLLM's order and with its
    # definitions (docs/sampling.md, Penalties): presence/frequency as OpenAI defines them over
    # the output tokens; repetition as HF/vLLM over prompt and output tokens; 0 / 1 / None: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # after temperature: drop tokens less likely than min_p * the most likely one's
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # strings whose token sequences must not be completed
    # Beam search as HF's generate(num_beams=beam_width) defines it (docs/sampling.md, Beam
    # search): the `n` best of `beam_width` beams (None: n) are returned, ranked by their
    # summed log-probabilities / generated length ** length_penalty; early_stopping: True
    # (stop once beam_width beams have finished), False (HF's heuristic) or "never"
    use_beam_search: bool = False
    beam_width: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    # the output must match a JSON schema, a regex, a choice or a grammar (vLLM's
    # structured outputs; docs/structured_output.md)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def changed(self, names: tuple[str, ...]) -> list[str]:
        """Which of the fields `names` are set away from their defaults."""
        defaults = SamplingParams()
        return [name for name in names if getattr(self, name) != getattr(defaults, name)]

    @property
    def ranks_samples(self) -> bool:
        """Are more samples drawn than returned (best_of > n), so each is scored?"""
        return self.best_of is not None and self.best_of > self.n

    @property
    def num_sequences(self) -> int:
        """Sequences the request runs at once: its samples, or its beams."""
        return max(self.n, self.best_of or 1, self.num_beams)

    @property
    def num_beams(self) -> int:
        """Beams a beam search keeps (1 when the request does not search)."""
        if not self.use_beam_search:
            return 1
        return self.n if self.beam_width is None else self.beam_width

    @property
    def adjusts_logits(self) -> bool:
        """Does any penalty, bias or token mask change the logits before temperature (so
        that even a greedy row needs the sampler)?"""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.allowed_token_ids is not None
            or self.bad_words
        )

    def validate(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(
                f"SamplingParams.{name}: {getattr(self, name)!r} is invalid; allowed: {allowed}"
            )

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "an integer >= 1")
        # _number_in first: a string or None would make the comparison a TypeError
        if not _number_in(self.temperature, 0.0, math.inf) or self.temperature == math.inf:
            raise bad("temperature", "a number >= 0 (0 means greedy)")
        if not _number_in(self.top_p, 0.0, 1.0) or self.top_p == 0.0:
            raise bad("top_p", "a number in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "-1 or 0 (disabled) or an integer >= 1")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"an integer in [0, max_tokens={self.max_tokens}]")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1")
        best_of = self.best_of
        if best_of is not None and (
            not isinstance(best_of, int) or isinstance(best_of, bool) or best_of < self.n
        ):
            raise bad("best_of", f"null or an integer >= n={self.n}")
        # torch generators take seeds in [-2^63, 2^64); sample i of n (or best_of) is seeded
        # seed + i
        samples = max(self.n, self.best_of or 1)
        if self.seed is not None and (
            not isinstance(self.seed, int) or not -(2**63) <= self.seed <= 2**64 - samples
        ):
            raise bad("seed", f"null or an integer in [-2^63, 2^64 - {samples}] (one per sample)")
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
        self._validate_penalties()
        self._validate_beam_search()
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                f"SamplingParams.structured_outputs: {_short(self.structured_outputs)} is "
                "invalid; allowed: null or a StructuredOutputsParams"
            )

    def _validate_penalties(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(
                f"SamplingParams.{name}: {_short(getattr(self, name))} is invalid; "
                f"allowed: {allowed}"
            )

        for name in ("presence_penalty", "frequency_penalty"):
            if not _number_in(getattr(self, name), -PENALTY_RANGE, PENALTY_RANGE):
                raise bad(name, f"a number in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}] (0: off)")
        rep = self.repetition_penalty
        if not _number_in(rep, 0.0, math.inf) or rep == 0.0 or rep == math.inf:
            raise bad("repetition_penalty", "a finite number > 0 (1: off)")
        if not _number_in(self.min_p, 0.0, 1.0):
            raise bad("min_p", "a number in [0, 1] (0: off)")
        bias = self.logit_bias
        if bias is not None and (
            not isinstance(bias, dict)
            or not all(_token_id(k) for k in bias)
            or not all(_number_in(v, -LOGIT_BIAS_RANGE, LOGIT_BIAS_RANGE) for v in bias.values())
        ):
            raise bad(
                "logit_bias",
                f"null or a map of token ids (integers >= 0) to numbers in "
                f"[-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]",
            )
        allowed = self.allowed_token_ids
        if allowed is not None and (
            not isinstance(allowed, list) or not allowed or not all(map(_token_id, allowed))
        ):
            raise bad("allowed_token_ids", "null or a non-empty list of token ids (integers >= 0)")
        words = self.bad_words
        if words is not None and (
            not isinstance(words, list) or not all(isinstance(w, str) and w.strip() for w in words)
        ):
            raise bad("bad_words", "null or a list of strings with at least one non-space")

    def _validate_beam_search(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(
                f"SamplingParams.{name}: {_short(getattr(self, name))} is invalid; "
                f"allowed: {allowed}"
            )

        if not isinstance(self.use_beam_search, bool):
            raise bad("use_beam_search", "true or false")
        width = self.beam_width
        if width is not None:
            if not isinstance(width, int) or isinstance(width, bool) or width < 1:
                raise bad("beam_width", "null (n) or an integer >= 1")
            if not self.use_beam_search:
                raise bad("beam_width", "null unless use_beam_search is true")
            if width < self.n:
                raise bad("beam_width", f"null or an integer >= n={self.n} (n best beams return)")
        if not _number_in(self.length_penalty, -math.inf, math.inf) or not math.isfinite(
            self.length_penalty
        ):
            raise bad("length_penalty", "a finite number (1: HF's default; 0: no length penalty)")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise bad("early_stopping", 'true, false or "never" (HF\'s meanings)')
        if not self.use_beam_search:
            if self.length_penalty != 1.0:
                raise bad("length_penalty", "1 unless use_beam_search is true")
            if self.early_stopping is not False:
                raise bad("early_stopping", "false unless use_beam_search is true")
        conflicts = _beam_search_conflicts(self) if self.use_beam_search else []
        if conflicts:
            name, allowed = conflicts[0]
            raise bad(name, f"{allowed} with use_beam_search (it ranks beams by log-probability)")


def _beam_search_conflicts(params: SamplingParams) -> list[tuple[str, str]]:
    """(field, what it must be) for every field a beam search cannot honour: it ranks
    log-probabilities deterministically, so sampling's warpers mean nothing to it, and a beam's
    text is only decoded once it wins, so stop strings cannot end one."""
    conflicts = [
        ("top_k", "0 or -1") if params.top_k > 0 else None,
        ("top_p", "1") if params.top_p < 1.0 else None,
        ("min_p", "0") if params.min_p > 0.0 else None,
        ("stop", "[] (stop_token_ids do end beams)") if params.stop else None,
        ("logprobs", "null") if params.logprobs is not None else None,
        ("best_of", "null (beam_width is the width)") if params.best_of is not None else None,
        ("structured_outputs", "null") if params.structured_outputs is not None else None,
    ]
    return [c for c in conflicts if c is not None]


def _number_in(value: object, low: float, high: float) -> bool:
    """A real number (not a bool) in [low, high]; NaN is in no range."""
    return isinstance(value, int | float) and not isinstance(value, bool) and low <= value <= high


def _token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _short(value: object) -> str:
    """A bounded repr for an error message (a logit_bias may hold a whole vocabulary)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
