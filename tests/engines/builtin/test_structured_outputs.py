"""SamplingParams.structured_outputs in the built-in engine (xgrammar): every output that ends
is valid for its constraint (jsonschema for schemas); the masked greedy token is the argmax of
the raw logits over the tokens the grammar allows; a guided row gives the same tokens alone,
in a batch beside free rows, in every KV mode, with chunked prefill; parallel samples fork
their matchers; logprobs stay the raw logits'; compilations are cached; what cannot be
enforced is refused naming the field."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest

from engines.base import Finished, StepRecord
from engines.builtin import LLM, SamplingParams
from engines.structured_outputs import StructuredOutputsParams as Constraint

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "colour": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "colour", "ok"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json": Constraint(json=SCHEMA),
    "json_object": Constraint(json_object=True),
    "regex": Constraint(regex=r"[0-9]{3}-[a-z]{2}"),
    "choice": Constraint(choice=["yes", "no", "maybe not"]),
    "grammar": Constraint(grammar='root ::= "(" item item? item? ")"\nitem ::= "ab" | "c"'),
}
PROMPTS = ["The quick brown fox", "Hello there", "A B C D E F G", "Once upon a time, in"]


def valid(kind: str, text: str) -> bool:
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "json_object":
        try:
            return isinstance(json.loads(text), dict)
        except ValueError:
            return False
    if kind == "regex":
        return re.fullmatch(r"[0-9]{3}-[a-z]{2}", text) is not None
    if kind == "choice":
        return text in ("yes", "no", "maybe not")
    return re.fullmatch(r"\((ab|c){1,3}\)", text) is not None


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM("tiny", dtype="float32", kv_cache="paged", max_model_len=256) as engine:
        yield engine


def guided(kind: str, **fields: object) -> SamplingParams:
    defaults: dict[str, object] = {"max_tokens": 120, "temperature": 0.0}
    return SamplingParams(**{**defaults, **fields, "structured_outputs": CONSTRAINTS[kind]})


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_finished_output_is_valid(llm: LLM, kind: str, temperature: float) -> None:
    outs = llm.generate(PROMPTS, guided(kind, temperature=temperature, seed=3))
    finished = [o for o in outs if o.finish_reason == "stop"]
    for out in finished:
        assert valid(kind, out.text), out.text
    if kind != "json_object":  # a free object's strings may run on to max_tokens
        assert len(finished) == len(outs), [o.text for o in outs]


def test_the_masked_greedy_token_is_the_best_allowed_one(llm: LLM) -> None:
    """The first token of a choice is the raw argmax over the tokens that start a choice."""
    out = llm.generate(PROMPTS[0], guided("choice", logprobs=20, max_tokens=3))[0]
    first = out.outputs[0].logprobs[0]  # type: ignore[index]
    allowed = {t for c in ("yes", "no", "maybe not") for t in llm.tokenizer.encode(c)[:1]}
    allowed |= {llm.tokenizer.encode(c, add_special_tokens=False)[0] for c in ("yes", "no")}
    ranked = [token for token, _ in first.top]
    best_allowed = next((t for t in ranked if t in allowed), None)
    if best_allowed is not None:
        assert first.token_id == best_allowed


def test_logprobs_stay_the_raw_logits(llm: LLM) -> None:
    """A forced token's logprob is its raw log-softmax value (what the same tokens score as a
    prompt), not the masked distribution's."""
    out = llm.generate(PROMPTS[1], guided("regex", logprobs=0))[0]
    sample = out.outputs[0]
    prompt = llm.engine.tokenize(PROMPTS[1])
    teacher = llm.generate(
        [prompt + sample.token_ids],
        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
    )[0]
    assert teacher.prompt_logprobs is not None and sample.logprobs is not None
    expected = [lp.logprob for lp in teacher.prompt_logprobs[len(prompt) :] if lp is not None]
    assert [lp.logprob for lp in sample.logprobs] == pytest.approx(expected, abs=1e-4)
    assert max(expected) < 0  # forced tokens are not the raw distribution's certainty


@pytest.mark.parametrize(
    "options",
    [
        {"kv_cache": "none"},
        {"kv_cache": "contiguous"},
        {"kv_cache": "paged", "enable_chunked_prefill": True, "max_num_batched_tokens": 4},
        {"kv_cache": "paged", "enable_prefix_caching": True, "block_size": 4},
    ],
)
def test_guided_rows_alone_or_beside_free_rows_in_every_kv_mode(
    llm: LLM, options: dict[str, object]
) -> None:
    kinds = ["json", "regex", "choice", "grammar"]
    alone = [llm.generate(p, guided(k))[0].token_ids for p, k in zip(PROMPTS, kinds, strict=True)]
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = [o.token_ids for o in llm.generate(PROMPTS, free)]
    with LLM("tiny", dtype="float32", max_model_len=256, **options) as other:
        mixed = other.generate(PROMPTS * 2, [guided(k) for k in kinds] + [free] * 4)
    assert [o.token_ids for o in mixed[:4]] == alone
    assert [o.token_ids for o in mixed[4:]] == plain


def test_parallel_samples_fork_their_matchers(llm: LLM) -> None:
    """n=4 samples each keep their own place in the grammar from their first token (one
    shared matcher would refuse the others' tokens): all valid, not all alike, the same again
    with the same seed."""
    params = guided("regex", temperature=1.5, n=4, seed=9)
    first = llm.generate(PROMPTS[2], params)[0].outputs
    assert all(o.finish_reason == "stop" and valid("regex", o.text) for o in first)
    assert len({o.text for o in first}) > 1
    again = llm.generate(PROMPTS[2], params)[0].outputs
    assert [o.token_ids for o in again] == [o.token_ids for o in first]


def test_a_finished_grammar_ends_the_output_even_with_ignore_eos(llm: LLM) -> None:
    out = llm.generate(PROMPTS[0], guided("choice", ignore_eos=True, max_tokens=50))[0]
    assert out.finish_reason == "stop" and valid("choice", out.text)


def test_compilations_are_cached_by_constraint(llm: LLM) -> None:
    manager = llm.engine.structured
    assert manager is not None
    llm.generate(PROMPTS[0], guided("regex"))
    compiles, hits = manager.num_compiles, manager.cache_hits
    llm.generate(PROMPTS[:2], guided("regex"))
    assert manager.num_compiles == compiles and manager.cache_hits >= hits + 2
    fresh = Constraint(regex=r"[a-z]{5}!")
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=20, structured_outputs=fresh))
    assert manager.num_compiles == compiles + 1 and manager.compile_ns > 0


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (Constraint(regex="(unclosed"), "structured_outputs.regex: xgrammar cannot compile"),
        (Constraint(json={"type": "nosuchtype"}), "structured_outputs.json: xgrammar cannot"),
        (Constraint(grammar="root ::= undefined_rule"), "structured_outputs.grammar: xgrammar"),
    ],
)
def test_what_cannot_compile_is_refused_naming_the_field(
    llm: LLM, constraint: Constraint, message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate(PROMPTS[0], SamplingParams(structured_outputs=constraint))
    assert not llm.engine.sequences


def test_a_backend_of_none_refuses_constraints() -> None:
    with (
        LLM("tiny", structured_output_backend="none") as llm,
        pytest.raises(ValueError, match=r"structured_outputs: .*structured_output_backend is none"),
    ):
        llm.generate("x", guided("regex"))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculative_decoding_under_a_grammar(llm: LLM, temperature: float) -> None:
    """n-gram drafts are checked against the grammar (each draft's row masked as if the drafts
    before it were kept, the matcher rolled back after): greedy tokens equal decoding without
    drafts, some drafts are kept, every output is valid."""
    loop = Constraint(regex=r"(ab|cd|ef){2,30}!")
    params = SamplingParams(max_tokens=48, temperature=temperature, seed=5, structured_outputs=loop)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    with LLM("tiny", dtype="float32", max_model_len=256, speculative_config=spec) as drafted:
        outs = drafted.generate(PROMPTS, params)
    assert sum(o.metrics.spec_accepted_tokens for o in outs) > 0
    for out in outs:
        assert out.finish_reason in ("stop", "length")
        text = out.text
        if out.finish_reason == "stop":
            assert re.fullmatch(r"(ab|cd|ef){2,30}!", text), text
        else:
            assert re.fullmatch(r"(ab|cd|ef)*(a|c|e)?", text), text
    if temperature == 0.0:
        assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "0 constraints given"),
        ({"regex": "a", "choice": ["b"]}, "2 constraints given (regex, choice)"),
        ({"choice": []}, "structured_outputs.choice: [] is invalid"),
        ({"json": "{not json"}, "structured_outputs.json: '{not json' is invalid"),
        ({"regex": ""}, "structured_outputs.regex: '' is invalid"),
    ],
)
def test_bad_constraints_name_the_field(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Constraint(**fields)


def test_beam_search_refuses_a_constraint() -> None:
    with pytest.raises(ValueError, match=r"SamplingParams\.structured_outputs"):
        SamplingParams(use_beam_search=True, structured_outputs=CONSTRAINTS["regex"])


def test_steps_record_the_masked_rows_and_the_mask_time(llm: LLM) -> None:
    engine = llm.engine
    records: list[StepRecord] = []
    engine.step_observers.append(records.append)
    try:
        engine.add_request("g", PROMPTS[0], guided("json"))
        engine.add_request("f", PROMPTS[1], SamplingParams(max_tokens=3))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.step_observers.remove(records.append)
    assert records[0].structured_rows == 1 and records[0].structured_mask_ns > 0
    assert all(r.structured_mask_ns < r.forward_ns for r in records)


def test_tensor_parallel_ranks_give_the_same_guided_tokens(llm: LLM) -> None:
    """Rank 0 masks and samples from the gathered logits: two ranks, the tokens of one."""
    params = [guided(kind) for kind in ("json", "regex", "choice", "grammar")]
    one = [o.token_ids for o in llm.generate(PROMPTS, params)]
    with LLM(
        "tiny",
        dtype="float32",
        max_model_len=256,
        kv_cache="paged",
        tensor_parallel_size=2,
        num_threads=1,
    ) as two:
        assert [o.token_ids for o in two.generate(PROMPTS, params)] == one


def test_objects_follow_the_schemas_key_order(llm: LLM) -> None:
    """The schema is compiled as written (its canonical sorted form is not what it says)."""
    schema = {
        "type": "object",
        "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "boolean"}},
        "required": ["zeta", "alpha"],
        "additionalProperties": False,
    }
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0.0,
                       structured_outputs=Constraint(json=schema)))[0]  # fmt: skip
    assert out.finish_reason == "stop" and list(json.loads(out.text)) == ["zeta", "alpha"]


def test_a_choice_outside_ascii_comes_out_whole(llm: LLM) -> None:
    choices = ["emoji 🎉", "café", 'quote " and \\ slash']
    for seed in range(3):
        params = SamplingParams(max_tokens=20, temperature=1.0, seed=seed,
                                structured_outputs=Constraint(choice=choices))  # fmt: skip
        assert llm.generate(PROMPTS[1], params)[0].text in choices


def test_min_tokens_does_not_hold_a_finished_grammar_open(llm: LLM) -> None:
    """min_tokens past every valid output masked the grammar's stop tokens, leaving the row
    nothing to sample (token 0 came out): the grammar decides where the output ends."""
    params = SamplingParams(
        max_tokens=20, temperature=0.0, min_tokens=10, structured_outputs=CONSTRAINTS["choice"]
    )
    out = llm.generate(PROMPTS[0], params)[0]
    assert out.finish_reason == "stop" and out.text in ("yes", "no", "maybe not")
    assert out.token_ids[-1] in llm.engine.eos_ids  # its stop token, not token 0


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "allOf (at /)"),
        ({"type": "array", "uniqueItems": True}, "uniqueItems (at /)"),
        ({"type": "object", "properties": {"a": {"not": {}}}}, "not (at /properties/a)"),
        ({"$ref": "http://example.com/s.json"}, "is outside it"),
    ],
)
def test_keywords_xgrammar_would_not_enforce_are_refused(
    llm: LLM, schema: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate("x", SamplingParams(structured_outputs=Constraint(json=schema)))


def test_a_schema_nested_too_deep_is_refused_before_compiling() -> None:
    deep = '{"type":"array","items":' * 2000 + "{}" + "}" * 2000
    with pytest.raises(ValueError, match="nested at most 64 levels"):
        Constraint(json=deep)
    nested: dict = {}
    for _ in range(80):
        nested = {"type": "array", "items": nested}
    with pytest.raises(ValueError, match="nested at most 64 levels"):
        Constraint(json=nested)


def test_the_compile_cache_is_bounded(llm: LLM) -> None:
    from engines.builtin.structured.manager import COMPILE_CACHE_SIZE

    manager = llm.engine.structured
    assert manager is not None
    for i in range(COMPILE_CACHE_SIZE + 20):
        manager.compile(Constraint(regex=f"[a-z]{{{i + 1}}}"))
    assert len(manager._compiled) == COMPILE_CACHE_SIZE


def test_each_request_reports_the_compile_time_it_paid(llm: LLM) -> None:
    """The first request of a constraint paid its compilation; the next hit the cache."""
    engine = llm.engine
    fresh = Constraint(regex=r"[0-9]{2}-fresh-[a-z]")
    for request_id in ("first", "second"):
        engine.add_request(request_id, PROMPTS[0], SamplingParams(structured_outputs=fresh))
    finished = {}
    while engine.has_unfinished_requests():
        for event in engine.step():
            if isinstance(event, Finished):
                finished[event.request_id] = event
    first, second = finished["first"], finished["second"]
    assert first.structured_compile_ns and first.structured_compile_ns > 0
    assert first.structured_cache_hit is False
    assert (second.structured_compile_ns, second.structured_cache_hit) == (0, True)


def test_static_batching_masks_its_rows_too(llm: LLM) -> None:
    """A static batch (padding rows, members that finish early and keep their slot) gives each
    guided row the tokens it gets under continuous batching."""
    kinds = ["json", "regex", "choice", "grammar"]
    params = [guided(kind) for kind in kinds]
    expected = [o.token_ids for o in llm.generate(PROMPTS, params)]
    with LLM("tiny", dtype="float32", max_model_len=256, batching="static") as static:
        assert [o.token_ids for o in static.generate(PROMPTS, params)] == expected


def test_jump_forward_appends_forced_tokens_and_saves_steps(llm: LLM) -> None:
    """engine.structured_output_jump_forward: the tokens a grammar forces (a schema's keys and
    punctuation) are appended unsampled and computed together in the next step: fewer steps
    for as many tokens, every output still valid, the forced count reported."""

    def run(engine_llm: LLM) -> tuple[list[Finished], int]:
        engine = engine_llm.engine
        before = engine.step_counter
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"j{i}", prompt, guided("json"))
        finished = []
        while engine.has_unfinished_requests():
            finished += [e for e in engine.step() if isinstance(e, Finished)]
        return sorted(finished, key=lambda e: e.request_id), engine.step_counter - before

    plain, plain_steps = run(llm)
    with LLM(
        "tiny",
        dtype="float32",
        kv_cache="paged",
        max_model_len=256,
        structured_output_jump_forward=True,
    ) as jumping:
        jumped, jumped_steps = run(jumping)
    assert all(e.structured_forced_tokens == 0 for e in plain)
    assert all((e.structured_forced_tokens or 0) > 0 for e in jumped)
    for event in jumped:
        assert event.finish_reason == "stop" and valid("json", event.text), event.text
    assert jumped_steps < plain_steps
