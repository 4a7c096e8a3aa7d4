"""Synthetic workloads: seeded, lengths as asked, valid prompts, clear errors."""

from __future__ import annotations

import pytest

from engines.builtin.tokenizer import default_tokenizer
from workloads import SyntheticWorkload


def test_random_id_prompts_have_exact_lengths_and_no_special_ids() -> None:
    tok = default_tokenizer()
    reqs = SyntheticWorkload(num_requests=20, input_len=[5, 40], output_len=[1, 9],
                             seed=3).build(tok)
    assert len(reqs) == 20 and len({r.request_id for r in reqs}) == 20
    for r in reqs:
        assert isinstance(r.request.prompt, list)
        assert len(r.request.prompt) == r.prompt_tokens_requested
        assert 5 <= len(r.request.prompt) <= 40 and 1 <= r.request.sampling.max_tokens <= 9
        assert not any(tok.is_special(t) for t in r.request.prompt)
        assert r.arrival_s == 0.0 and r.request.sampling.ignore_eos
    lengths = {len(r.request.prompt) for r in reqs}
    assert len(lengths) > 5  # a range really varies


def test_seed_reproduces_and_changes() -> None:
    tok = default_tokenizer()
    a = SyntheticWorkload(num_requests=5, input_len=[5, 40], seed=1).build(tok)
    b = SyntheticWorkload(num_requests=5, input_len=[5, 40], seed=1).build(tok)
    c = SyntheticWorkload(num_requests=5, input_len=[5, 40], seed=2).build(tok)
    assert [r.request.prompt for r in a] == [r.request.prompt for r in b]
    assert [r.request.prompt for r in a] != [r.request.prompt for r in c]


def test_text_prompts_come_from_the_corpus(tmp_path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 50)
    tok = default_tokenizer()
    reqs = SyntheticWorkload(num_requests=3, input_len=16, prompt="text",
                             corpus=str(corpus)).build(tok)
    for r in reqs:
        assert isinstance(r.request.prompt, str) and r.request.prompt
        words = {"the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog.", "dog"}
        assert set(r.request.prompt.split()) <= words
        assert abs(len(tok.encode(r.request.prompt, add_special_tokens=False)) - 16) <= 2


@pytest.mark.parametrize(("field", "value", "message"), [
    ("input_len", 0, "workload.input_len"),
    ("output_len", [9, 3], "workload.output_len"),
    ("input_len", "long", "workload.input_len"),
    ("prompt", "poetry", "workload.prompt"),
    ("num_requests", -1, "workload.num_requests"),
    ("corpus", "/no/such/file.txt", "workload.corpus"),
])
def test_bad_settings_name_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises((ValueError, FileNotFoundError), match=message.replace(".", r"\.")):
        SyntheticWorkload(**{field: value}).validate()
