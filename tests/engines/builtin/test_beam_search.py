"""Beam search (SamplingParams.use_beam_search): the same sequences and scores as Hugging
Face's generate(num_beams=k) token for token (fp32; k = 2, 4; with and without length penalty
and early stopping; beams that end on a stop id mid-way), in every KV mode, with chunked
prefill and prefix caching, beside other requests, under memory pressure; and every KV block
comes back when the searches end or are aborted."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from checkpoints import random_hf_llama

from engines.base import Finished, StepRecord, Tokens
from engines.builtin import LLM, SamplingParams
from engines.builtin.llm import RequestOutput

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

transformers = pytest.importorskip("transformers")

VOCAB = 512
EOS = 2  # random_hf_llama's
MAX_TOKENS = 10
PROMPT_LENS = (5, 9, 14)
STOP_AT = (1, 3, 6)  # per prompt: the output position of the token made its stop id
SEARCHES = [  # (beam width, length_penalty, early_stopping)
    (2, 1.0, False),
    (4, 1.0, False),
    (4, 0.0, "never"),
    (4, 2.0, True),
    (2, -1.0, "never"),
]


class Reference:
    """HF's beam search on the test checkpoint, each search computed once."""

    def __init__(self, model: torch.nn.Module, folder: Path) -> None:
        self.model = model
        self.folder = folder

    @functools.cache  # noqa: B019 (one instance per module)
    def beams(
        self, prompt: tuple[int, ...], width: int, penalty: float, early: bool | str, stop: int
    ) -> tuple[list[list[int]], list[float]]:
        """HF's k best hypotheses (output tokens, padding cut) and their scores."""
        with torch.inference_mode():
            out = self.model.generate(
                torch.tensor([prompt]),
                num_beams=width,
                num_return_sequences=width,
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                length_penalty=penalty,
                early_stopping=early,
                eos_token_id=[EOS, stop],
                pad_token_id=0,
                return_dict_in_generate=True,
                output_scores=True,
            )
        sequences = []
        for row in out.sequences[:, len(prompt) :].tolist():
            ends = [i for i, token in enumerate(row) if token in (EOS, stop)]
            sequences.append(row[: ends[0] + 1] if ends else row)
        return sequences, out.sequences_scores.tolist()

    def stops(self, width: int, penalty: float, early: bool | str) -> list[int]:
        """A stop id per prompt that some beam reaches mid-way: the token at STOP_AT of HF's
        second-best hypothesis without one (so hypotheses finish at different steps)."""
        return [
            self.beams(tuple(prompt), width, penalty, early, EOS)[0][1][at]
            for prompt, at in zip(prompts(), STOP_AT, strict=True)
        ]

    def check(
        self, outs: list[RequestOutput], width: int, penalty: float, early: bool | str
    ) -> None:
        """Every request's outputs are HF's hypotheses, scores and finish reasons."""
        stops = self.stops(width, penalty, early)
        for prompt, stop, out in zip(prompts(), stops, outs, strict=True):
            sequences, scores = self.beams(tuple(prompt), width, penalty, early, stop)
            assert [o.token_ids for o in out.outputs] == sequences
            for sample, score in zip(out.outputs, scores, strict=True):
                assert sample.cumulative_logprob is not None
                ours = sample.cumulative_logprob / len(sample.token_ids) ** penalty
                assert ours == pytest.approx(score, rel=1e-5, abs=1e-5)
                ended = sample.token_ids[-1] == stop
                assert sample.finish_reason == ("stop" if ended else "length")

    def searches(self, width: int, penalty: float, early: bool | str) -> list[SamplingParams]:
        return [search(width, penalty, early, stop) for stop in self.stops(width, penalty, early)]

    def llm(self, **options: object) -> LLM:
        return LLM(model=str(self.folder), dtype="float32", max_model_len=128, **options)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    folder = tmp_path_factory.mktemp("beam_llama")
    return Reference(random_hf_llama(folder, VOCAB, 7), folder)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(7, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def search(width: int, penalty: float, early: bool | str, stop: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=MAX_TOKENS,
        use_beam_search=True,
        beam_width=width,
        n=width,
        length_penalty=penalty,
        early_stopping=early,
        stop_token_ids=[stop],
    )


def assert_all_memory_back(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.beam_search.groups and not engine.sequences
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.kv.num_live == 0 and engine.kv.bytes_reserved() == 0
    pool = getattr(engine.kv, "pool", None)
    if pool is not None:
        assert all(count == 0 for count in pool.ref_counts)


@pytest.mark.parametrize(("width", "penalty", "early"), SEARCHES)
@pytest.mark.parametrize("kv_cache", ["paged", "contiguous", "none"])
def test_beams_equal_hf_generate(
    reference: Reference, kv_cache: str, width: int, penalty: float, early: bool | str
) -> None:
    with reference.llm(kv_cache=kv_cache, block_size=4) as llm:
        outs = llm.generate(prompts(), reference.searches(width, penalty, early))
        reference.check(outs, width, penalty, early)
        assert_all_memory_back(llm)


def test_tensor_parallel_ranks_search_the_same_beams(reference: Reference) -> None:
    """Rank 0 picks the beams from the gathered logits; every rank forks and copies the same
    blocks, as the step plans they receive say."""
    with reference.llm(
        kv_cache="paged", block_size=4, tensor_parallel_size=2, num_threads=1
    ) as llm:
        outs = llm.generate(prompts(), reference.searches(4, 1.0, False))
        reference.check(outs, 4, 1.0, False)
        assert_all_memory_back(llm)


def test_beams_share_blocks_and_copy_only_partial_ones(reference: Reference) -> None:
    """Paged KV: a fork shares its parent's blocks (ref counts > 1 while the search runs) and
    copies only a partly filled last block, on the child's first write."""
    with reference.llm(kv_cache="paged", block_size=4) as llm:
        engine = llm.engine
        records: list[StepRecord] = []
        engine.step_observers.append(records.append)
        engine.add_request("r", prompts()[2], reference.searches(4, 1.0, False)[2])
        while engine.has_unfinished_requests():
            engine.step()
        shared_peak = max(r.kv_blocks_shared for r in records)
        block_bytes = 4 * engine.kv.layout.bytes_per_token
        copies = sum(r.kv_bytes_copied for r in records) // block_bytes
        assert shared_peak >= 3  # the 14-token prompt's full blocks, shared by every beam
        # a fork copies at most the one partly filled block it writes into, per new beam
        assert 0 < copies <= sum(r.num_seqs for r in records)
        assert_all_memory_back(llm)


def test_chunked_prefill_prefix_caching_and_other_requests_change_nothing(
    reference: Reference,
) -> None:
    """Beams beside greedy requests, over 8-token prompt chunks and a prefix cache (the second
    call hits it): the beams equal HF's, the greedy requests their plain outputs."""
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with reference.llm() as plain:
        expected = [o.token_ids for o in plain.generate(prompts(), greedy)]
    with reference.llm(
        kv_cache="paged",
        block_size=4,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=8,
    ) as llm:
        for _ in range(2):
            outs = llm.generate(prompts() * 2, reference.searches(4, 1.0, False) + [greedy] * 3)
            reference.check(outs[:3], 4, 1.0, False)
            assert [o.token_ids for o in outs[3:]] == expected
        assert llm.engine.scheduler.prefix_cache_hits > 0
        assert_all_memory_back(llm)


def test_memory_pressure_preempts_beams_and_changes_nothing(reference: Reference) -> None:
    """A pool too small for every beam of three searches at once, and fewer seats than
    beams: beams are preempted (idle ones too, to let their siblings in) and recomputed, forks
    wait in the queue; the results are still HF's."""
    block_bytes = 4 * 2 * 2 * 2 * 16 * 4  # 4 tokens x 2 layers x K, V x 2 heads x 16 x fp32
    with reference.llm(
        kv_cache="paged", block_size=4, max_num_seqs=5, kv_cache_memory_bytes=14 * block_bytes
    ) as llm:
        outs = llm.generate(prompts(), reference.searches(4, 1.0, False))
        reference.check(outs, 4, 1.0, False)
        assert llm.engine.scheduler.num_preemptions > 0
        assert_all_memory_back(llm)


def test_abort_ends_every_beam_and_reports_n_outputs(reference: Reference) -> None:
    with reference.llm(kv_cache="paged", block_size=4) as llm:
        engine = llm.engine
        params = SamplingParams(max_tokens=20, use_beam_search=True, beam_width=4, n=3)
        engine.add_request("r", prompts()[1], params)
        for _ in range(4):
            engine.step()
        assert len(engine.sequences) == 4  # the beams, forked
        engine.abort_request("r")
        events = engine.step() if engine.has_unfinished_requests() else engine._pending_events
        finished = [e for e in events if isinstance(e, Finished)]
        assert sorted(e.index for e in finished) == [0, 1, 2]
        assert {e.finish_reason for e in finished} == {"abort"}
        assert not any(isinstance(e, Tokens) for e in events)
        assert_all_memory_back(llm)


def test_outputs_arrive_at_the_end_with_their_text(reference: Reference) -> None:
    with reference.llm() as llm:
        engine = llm.engine
        engine.add_request(
            "r", prompts()[0], SamplingParams(max_tokens=6, use_beam_search=True, n=2)
        )
        events = []
        while engine.has_unfinished_requests():
            events.append(engine.step())
        assert all(not any(isinstance(e, Tokens) for e in step) for step in events[:-1])
        last = events[-1]
        tokens = [e for e in last if isinstance(e, Tokens)]
        assert [e.index for e in tokens] == [0, 1] and all(len(e.token_ids) == 6 for e in tokens)
        for event in tokens:
            assert event.text == llm.tokenizer.decode(list(event.token_ids))


@pytest.mark.parametrize("penalty", [2000.0, -2000.0])
def test_an_extreme_length_penalty_scores_without_overflow(
    reference: Reference, penalty: float
) -> None:
    """length ** 2000 overflows a float: the score saturates (to 0 or -inf) as a float32
    tensor's would, and the search ends normally (it raised OverflowError out of the step,
    leaving the group's KV behind and the next call hanging)."""
    with reference.llm(kv_cache="paged", block_size=4) as llm:
        params = SamplingParams(
            max_tokens=6, use_beam_search=True, beam_width=2, length_penalty=penalty
        )
        out = llm.generate(prompts()[0], params)[0]
        assert out.error is None and all(o.token_ids and o.finish_reason for o in out.outputs)
        assert_all_memory_back(llm)
        assert llm.generate(prompts()[1], SamplingParams(max_tokens=2))[0].finished


@pytest.mark.parametrize("kv_cache", ["none", "contiguous", "paged"])
def test_more_beams_than_seats_finish_in_every_kv_mode(reference: Reference, kv_cache: str) -> None:
    """Two searches of width 2 and a plain request under max_num_seqs=2: idle beams give
    their seats to their waiting siblings (without a KV cache too, where an idle beam's count
    restarts at 0 every step and it was recomputed instead, holding its seat for ever)."""
    with reference.llm(kv_cache=kv_cache, block_size=4, max_num_seqs=2) as llm:
        beams = SamplingParams(max_tokens=8, use_beam_search=True, beam_width=2)
        plain = SamplingParams(max_tokens=8, temperature=0.0)
        outs = llm.generate(prompts(), [beams, beams, plain])
        assert all(o.error is None and o.finished for o in outs)
        with reference.llm(kv_cache=kv_cache, block_size=4) as roomy:
            assert [o.outputs[0].token_ids for o in outs] == [
                o.outputs[0].token_ids for o in roomy.generate(prompts(), [beams, beams, plain])
            ]
        assert_all_memory_back(llm)


def test_a_tight_pool_recomputes_beams_rather_than_failing_them(reference: Reference) -> None:
    """Memory for about one beam's context at a time: the request was failed as "does not fit
    even alone" in the step where the last idle beam gave its memory up."""
    block_bytes = 4 * 2 * 2 * 2 * 16 * 4
    with reference.llm(
        kv_cache="paged", block_size=4, kv_cache_memory_bytes=9 * block_bytes
    ) as llm:
        params = SamplingParams(max_tokens=16, use_beam_search=True, beam_width=4, n=2)
        out = llm.generate(prompts()[1], params)[0]
        assert out.error is None and [len(o.token_ids) for o in out.outputs] == [16, 16]
        assert llm.engine.scheduler.num_preemptions > 0
        assert_all_memory_back(llm)


@pytest.mark.parametrize(
    ("options", "params", "field"),
    [
        ({"batching": "static"}, {}, "use_beam_search"),
        ({"batching": "static"}, {"beam_width": 4}, "use_beam_search"),
        ({"max_num_seqs": 2}, {"beam_width": 4}, "beam_width"),
        (
            {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
            {},
            "use_beam_search",
        ),
    ],
)
def test_what_the_engine_cannot_search_is_refused_naming_the_field(
    reference: Reference, options: dict, params: dict, field: str
) -> None:
    with reference.llm(**options) as llm:
        with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
            llm.generate([prompts()[0]], SamplingParams(use_beam_search=True, **params))
        assert not llm.engine.sequences


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"top_p": 0.9}, "top_p"),
        ({"top_k": 5}, "top_k"),
        ({"min_p": 0.1}, "min_p"),
        ({"stop": ["x"]}, "stop"),
        ({"logprobs": 2}, "logprobs"),
        ({"beam_width": 1, "n": 2}, "beam_width"),
        ({"beam_width": 0}, "beam_width"),
        ({"length_penalty": float("nan")}, "length_penalty"),
        ({"early_stopping": "always"}, "early_stopping"),
        ({"use_beam_search": False, "length_penalty": 2.0}, "length_penalty"),
        ({"use_beam_search": False, "early_stopping": "never"}, "early_stopping"),
    ],
)
def test_bad_beam_parameters_name_the_field(params: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{"use_beam_search": True, **params})


def test_beam_width_without_beam_search_is_refused() -> None:
    with pytest.raises(ValueError, match=r"SamplingParams.beam_width: 2 .* use_beam_search"):
        SamplingParams(beam_width=2)
