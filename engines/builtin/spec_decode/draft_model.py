"""A draft model's proposals (vLLM's `draft_model` method): a smaller model sharing the
target's tokenizer, run by the same engine machinery with its own KV cache, decodes k tokens
a step itself; their distributions go to the rejection sampler with them.

Kept in step with the target, per sequence, before each proposal: the draft's cache is cut
back to the longest prefix it computed on tokens the target kept (the rollback after
rejections), the tokens it has not computed go through in one pass (the prompt the first
time; afterwards the target's own last token and any kept draft the draft did not compute),
and k single-token steps draw the drafts with the request's temperature / top-k / top-p.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import torch

from engines.base import ConfigError
from engines.builtin.sampler import SamplingBatch
from engines.builtin.scheduler import ScheduledSequence, StepPlan
from engines.builtin.sequence import Sequence
from engines.builtin.spec_decode.config import SpeculativeConfig
from engines.builtin.spec_decode.proposer import PROPOSERS, Proposal, Proposer, ProposerContext

# text whose encoding must be the same under both tokenizers (words, digits, quotes, accents,
# code, whitespace): a cheap check that the draft shares the target's tokenizer
_PROBE = 'The quick brown fox said "naïve" 42 times.\n\tdef f(x):\n        return x ** 2 # ok'


@PROPOSERS.register("draft_model")
class DraftModelProposer(Proposer):
    name = "draft_model"

    def __init__(self, config: SpeculativeConfig, context: ProposerContext) -> None:
        super().__init__(config, context)
        overrides: dict[str, Any] = {
            "model": config.model,
            "model_overrides": {},
            "speculative_config": None,
            "enable_prefix_caching": False,  # its cache holds drafts the target may reject
            "kv_host_tier_bytes": 0,  # and so keeps no evicted prefix blocks
            "kv_disk_tier_bytes": 0,
            "kv_cache_prefault": False,
            # its own cache in the target's layout; contiguous where the target keeps none
            "kv_cache": context.kv_cache if context.kv_cache_kind.retains_kv else "contiguous",
            "max_model_len": context.max_model_len,
            "tensor_parallel_size": 1,  # a small draft runs on rank 0 alone (vLLM's default)
        }
        if config.dtype is not None:
            overrides["dtype"] = config.dtype
        if config.quantization is not None:
            overrides.update(
                quantization=config.quantization,
                quantization_activations="float",
                quantize_lm_head=False,
                lm_head_quantization="same",
            )
        self.model = config.model
        try:
            self.engine = context.build_engine(overrides)
        except ValueError as error:  # ConfigError too: name the draft, not the target
            raise ConfigError(_draft_error(config, str(error))) from error
        try:
            self._check_draft(config, context)
        except BaseException:
            self.engine.close()
            raise
        engine = self.engine
        self.runner, self.kv = engine.runner, engine.kv
        self.max_batched = engine.limits.max_num_batched_tokens
        self.mirrors: dict[int, Sequence] = {}  # target seq_id -> the draft's copy

    def _check_draft(self, config: SpeculativeConfig, context: ProposerContext) -> None:
        engine = self.engine
        if engine.runner.ring:
            raise ConfigError(
                f"engine.speculative_config.model: {config.model!r} has a sliding window, whose "
                "contiguous ring cannot roll back rejected drafts; use engine.kv_cache=paged"
            )
        draft_ids = engine.tokenizer.encode(_PROBE, add_special_tokens=False)
        if (
            engine.runner.sample_vocab_size != context.sample_vocab_size
            or draft_ids != context.encode(_PROBE)
        ):
            raise ConfigError(
                f"engine.speculative_config.model: {config.model!r} does not share the target's "
                f"tokenizer ({engine.tokenizer.name}, {engine.runner.sample_vocab_size} ids, vs "
                f"{context.sample_vocab_size} ids); a draft must propose the target's token ids"
            )
        if engine.model_config.vocab_size > context.model_vocab_size:
            raise ConfigError(
                f"engine.speculative_config.model: {config.model!r} has vocab_size="
                f"{engine.model_config.vocab_size}, larger than the target's "
                f"{context.model_vocab_size}; allowed: at most the target's"
            )

    def close(self) -> None:
        """Close the draft model's engine and let go of its model and KV cache."""
        self.engine.close()
        self.mirrors.clear()
        self.__dict__.pop("runner", None)
        self.__dict__.pop("kv", None)

    def describe(self) -> dict[str, object]:
        facts = self.engine.describe()
        keys = ("model", "dtype", "quantization", "kv_cache", "num_parameters", "weight_bytes")
        return {f"draft_{key}": facts.get(key) for key in keys}

    def release(self, seq: Sequence) -> None:
        mirror = self.mirrors.pop(seq.seq_id, None)
        if mirror is not None:
            self.kv.free(mirror.seq_id)

    def propose(self, seqs: Seq[Sequence], limits: Seq[int]) -> list[Proposal]:
        counts = [min(self.k, limit) for limit in limits]
        mirrors = {i: self._sync(seq) for i, seq in enumerate(seqs) if counts[i] > 0}
        last = self._catch_up(mirrors)  # index -> logits after the sequence's last token
        drafts: list[list[int]] = [[] for _ in seqs]
        dists: list[list[torch.Tensor]] = [[] for _ in seqs]
        rows = [i for i in mirrors if i in last]
        logits = torch.stack([last[i] for i in rows]) if rows else None
        while rows and logits is not None:
            tokens, q = self._draw(logits, [seqs[i] for i in rows], len(drafts[rows[0]]))
            for row, i in enumerate(rows):
                drafts[i].append(tokens[row])
                if q is not None:
                    dists[i].append(q[row])
            rows = [i for i in rows if len(drafts[i]) < counts[i]]
            for i in rows:
                mirrors[i].token_ids.append(drafts[i][-1])
            ran = self._run(
                {i: ScheduledSequence(mirrors[i], 1, mirrors[i].num_computed_tokens) for i in rows}
            )
            rows = list(ran)  # a row whose cache could not grow stops drafting
            logits = torch.stack(list(ran.values())) if ran else None
        return [
            Proposal(d, torch.stack(q) if q and len(q) == len(d) else None)
            for d, q in zip(drafts, dists, strict=True)
        ]

    # ---- keeping the draft's cache in step ---------------------------------------------------

    def _sync(self, seq: Sequence) -> Sequence:
        """The draft's copy of `seq`, its cache cut back to the prefix it computed on the
        sequence's tokens (never the last one, whose logits the drafts start from)."""
        mirror = self.mirrors.get(seq.seq_id)
        if mirror is None:
            mirror = Sequence(seq.request_id, seq.prompt_token_ids, seq.sampling, seq.arrival_ns)
            self.mirrors[seq.seq_id] = mirror
        valid = 0
        limit = min(mirror.num_computed_tokens, seq.num_tokens - 1)
        ours, theirs = mirror.token_ids, seq.token_ids
        while valid < limit and ours[valid] == theirs[valid]:
            valid += 1
        if valid < mirror.num_computed_tokens:
            self.kv.commit(mirror.seq_id, valid)
            self.kv.truncate(mirror.seq_id, valid)
        mirror.num_computed_tokens = valid
        mirror.token_ids = list(theirs)
        return mirror

    def _catch_up(self, mirrors: dict[int, Sequence]) -> dict[int, torch.Tensor]:
        """Compute every token the draft has not seen; index -> the logits after the sequence's
        last token (a sequence whose cache cannot grow is left out: no drafts for it this
        step). A few tokens past the prompt (the target's own token, and the last draft when
        every draft was kept) go through as one-token decode steps, which take the decode
        kernels and the decode program; a 2-token chunk would take the prefill path, measured
        4.6 ms against 1 ms a decode step for tiny-trained-draft. The rest (the prompt) goes in
        passes of at most the token budget."""
        short = {
            i: m
            for i, m in mirrors.items()
            if m.num_computed_tokens >= m.num_prompt_tokens
            and m.num_tokens - m.num_computed_tokens <= self.k + 1
        }
        out = self._catch_up_as_decodes(short)
        out.update(self._catch_up_in_chunks({i: m for i, m in mirrors.items() if i not in short}))
        return out

    def _catch_up_as_decodes(self, mirrors: dict[int, Sequence]) -> dict[int, torch.Tensor]:
        out: dict[int, torch.Tensor] = {}
        pending = {i: m for i, m in mirrors.items() if m.num_tokens > m.num_computed_tokens}
        while pending:
            ran = {i: ScheduledSequence(m, 1, m.num_computed_tokens) for i, m in pending.items()}
            out.update(self._run(ran))
            # a row whose cache could not grow did not advance: it drafts nothing this step
            pending = {
                i: m
                for i, m in pending.items()
                if m.num_computed_tokens > ran[i].num_computed_before
                and m.num_tokens > m.num_computed_tokens
            }
        return out

    def _catch_up_in_chunks(self, mirrors: dict[int, Sequence]) -> dict[int, torch.Tensor]:
        out: dict[int, torch.Tensor] = {}
        pending = list(mirrors)
        while pending:
            budget, items = self.max_batched, {}
            for i in pending:
                mirror = mirrors[i]
                take = min(mirror.num_tokens - mirror.num_computed_tokens, budget)
                if take == 0:
                    break
                items[i] = ScheduledSequence(mirror, take, mirror.num_computed_tokens)
                budget -= take
            out.update(self._run(items))
            # left: rows the budget did not reach and rows partly computed; a row whose cache
            # could not grow did not advance and is dropped
            pending = [
                i
                for i in pending
                if i not in out
                and (
                    i not in items or mirrors[i].num_computed_tokens > items[i].num_computed_before
                )
            ]
        return out

    def _run(self, items: dict[int, ScheduledSequence]) -> dict[int, torch.Tensor]:
        """One step of the draft over the rows whose cache can grow (allocated in order, so
        that each sees what the earlier ones took); index -> logits for those that sample."""
        fitting = {}
        for i, item in items.items():
            total = item.num_computed_before + item.num_new_tokens
            if self.kv.can_allocate(item.seq.seq_id, total):
                self.kv.allocate(item.seq.seq_id, total)
                fitting[i] = item
        if not fitting:
            return {}
        order = sorted(fitting, key=lambda i: not fitting[i].is_decode)  # decodes first
        plan = StepPlan(step=0, scheduled=[fitting[i] for i in order])
        logits = self.runner.execute_logits(plan, self.kv)
        for item in fitting.values():
            computed = item.num_computed_before + item.num_new_tokens
            self.kv.commit(item.seq.seq_id, computed)
            item.seq.num_computed_tokens = computed
        sampled = [i for i in order if fitting[i].samples]
        return dict(zip(sampled, logits, strict=True))

    def _draw(
        self, logits: torch.Tensor, seqs: Seq[Sequence], ahead: int
    ) -> tuple[list[int], torch.Tensor | None]:
        """A draft per row, with each request's sampling parameters (`ahead`: drafts already
        drawn, for min_tokens); their distributions, or None when every row is greedy (a
        greedy draft is the argmax: q is one-hot)."""
        sampler = self.runner.sampler
        batch = SamplingBatch.from_sequences(
            seqs, self.runner.eos_ids, logits.device, [ahead] * len(seqs)
        )
        if batch.all_greedy:
            return sampler.masked(logits, batch).argmax(-1).tolist(), None
        q = sampler.distributions(logits, batch)
        return sampler.race(q, [s.generator for s in seqs]).tolist(), q


def _draft_error(config: SpeculativeConfig, message: str) -> str:
    """The draft engine's refusal under the key the user wrote: its `engine.dtype` is
    `engine.speculative_config.dtype` when that set it (the target's own dtype is fine)."""
    for key in ("dtype", "quantization"):
        if getattr(config, key) is not None and message.startswith(f"engine.{key}:"):
            return "engine.speculative_config." + message.removeprefix("engine.")
    return f"engine.speculative_config.model: {config.model!r} cannot be the draft: {message}"
