"""Tests for models.tokenizer: default BPE, HF folders, chat templates, streaming."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

import models.tokenizer as tkz
from models.tokenizer import (
    DEFAULT_CHAT_TEMPLATE,
    PLAIN_CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    SpecialTokens,
    Tokenizer,
    default_tokenizer,
    load_tokenizer,
    stream_step,
)

SAMPLES = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Emoji: 😀👍🏽🎉 and a family 👨‍👩‍👧‍👦 plus flags 🇫🇷🇯🇵",
    "中文测试：语言模型把文字看作一串数字。日本語のテキスト、한국어 텍스트",
    'def f(x: int) -> dict[str, int]:\n    return {"x": x ** 2}  # 0x7fff\n\tpass\n',
    "  leading and trailing spaces  \n\n\r\n\t",
    "Shall I compare thee to a summer's day?",
    "mixed: café naïve Ωμέγα — “quotes” … ½ ∑ \u0000 \u200b \U0010ffff",
    "",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tokenizer]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("INFERLAB_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield load_tokenizer(None)


def _byte_token_id(tok: Tokenizer, byte: int) -> int:
    """Id of the single-byte symbol for ``byte`` (GPT-2's byte -> unicode table)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]  # map to themselves
    others = [b for b in range(256) if b not in printable]  # map to chr(256), chr(257), ...
    char = chr(byte) if byte in printable else chr(256 + others.index(byte))
    token_id = tok.backend.token_to_id(char)
    assert token_id is not None
    return token_id


def _stream(tok: Tokenizer, ids: Sequence[int], **kwargs: object) -> list[str]:
    stream = tok.new_stream(**kwargs)  # type: ignore[arg-type]
    deltas = [stream.step(i) for i in ids]
    deltas.append(stream.flush())
    assert "".join(deltas) == stream.text
    return deltas


# ---------------------------------------------------------------- default tokenizer


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text)) == text  # BOS is skipped on decode


def test_bos_only_with_add_special_tokens(tok: Tokenizer) -> None:
    plain = tok.encode("hello there", add_special_tokens=False)
    assert plain and plain[0] != 0
    assert tok.encode("hello there") == [0, *plain]
    assert tok.encode("") == [0]
    assert tok.encode("", add_special_tokens=False) == []
    assert tok.decode([0, *plain], skip_special_tokens=False) == "<|bos|>hello there"


def test_special_tokens_layout(tok: Tokenizer) -> None:
    assert SPECIAL_TOKENS == (
        "<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
    )  # fmt: skip
    assert [tok.backend.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(7))
    assert tok.special == SpecialTokens(bos_id=0, eos_ids=(1, 6), pad_id=2)
    assert [tok.encode(t, add_special_tokens=False) for t in SPECIAL_TOKENS] == [
        [i] for i in range(7)
    ]
    assert all(tok.is_special(i) for i in range(7))
    assert tok.special_ids == frozenset(range(7))
    assert not any(tok.is_special(i) for i in range(7, tok.vocab_size))
    # The 256 byte symbols follow, so every byte string is representable.
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    assert {tok.backend.id_to_token(i) for i in range(7, 263)} == alphabet
    assert 263 < tok.vocab_size <= tkz.TARGET_VOCAB_SIZE
    assert tok.vocab_size == tok.backend.get_vocab_size(with_added_tokens=True)
    assert tok.name.startswith("inferlab-bpe-") and len(tok.name) == len("inferlab-bpe-") + 8


def test_every_id_decodes(tok: Tokenizer) -> None:
    for i in range(7, tok.vocab_size):
        assert isinstance(tok.decode([i]), str)
    assert tok.decode(range(7)) == ""
    assert tok.decode(range(7), skip_special_tokens=False) == "".join(SPECIAL_TOKENS)


def test_training_is_deterministic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = []
    for name in ("a", "b"):
        monkeypatch.setenv("INFERLAB_CACHE_DIR", str(tmp_path / name))
        first = load_tokenizer(None)
        (f,) = (tmp_path / name).glob("tokenizer-*.json")
        files.append(f)
    assert files[0].name == files[1].name
    assert files[0].read_bytes() == files[1].read_bytes()
    assert first.name == load_tokenizer(None).name
    # No stray temp files from the atomic write.
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [files[0].name]


def test_cache_is_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERLAB_CACHE_DIR", str(tmp_path))
    first = load_tokenizer(None)
    (cached,) = tmp_path.glob("tokenizer-*.json")
    stat = cached.stat()

    def no_training(corpus: Sequence[str]) -> str:
        raise AssertionError("retrained although the cache file exists")

    monkeypatch.setattr(tkz, "train_default_tokenizer", no_training)
    second = load_tokenizer(None)
    assert cached.stat().st_mtime_ns == stat.st_mtime_ns
    assert second.name == first.name
    assert second.encode("cache me") == first.encode("cache me")


def test_corrupt_cache_is_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERLAB_CACHE_DIR", str(tmp_path))
    good = load_tokenizer(None).encode("abc")
    (cached,) = tmp_path.glob("tokenizer-*.json")
    cached.write_text("{ not json")
    assert load_tokenizer(None).encode("abc") == good
    json.loads(cached.read_text())


def test_unwritable_cache_dir_trains_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder should go")
    monkeypatch.setenv("INFERLAB_CACHE_DIR", str(blocker / "cache"))
    tok = load_tokenizer(None)
    assert tok.decode(tok.encode("still works 😀")) == "still works 😀"


def test_cache_dir_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERLAB_CACHE_DIR", str(tmp_path / "explicit"))
    assert tkz.cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("INFERLAB_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tkz.cache_dir() == tmp_path / "xdg" / "inferlab"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert tkz.cache_dir() == Path.home() / ".cache" / "inferlab"


def test_default_tokenizer_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERLAB_CACHE_DIR", str(tmp_path))
    default_tokenizer.cache_clear()
    try:
        assert default_tokenizer() is default_tokenizer()
        assert default_tokenizer().name.startswith("inferlab-bpe-")
    finally:
        default_tokenizer.cache_clear()


# ---------------------------------------------------------------- streaming


@pytest.mark.parametrize("text", SAMPLES)
def test_stream_matches_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    deltas = _stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_stream_holds_back_split_characters(tok: Tokenizer) -> None:
    emoji = "😀".encode()  # four bytes, fed as four single-byte tokens
    ids = [_byte_token_id(tok, b) for b in b"a" + emoji + "中".encode()]
    assert tok.decode(ids) == "a😀中"
    assert _stream(tok, ids) == ["a", "", "", "", "😀", "", "", "中", ""]


def test_stream_flush_releases_invalid_tail(tok: Tokenizer) -> None:
    ids = [_byte_token_id(tok, b) for b in b"ok\xe4\xb8"]  # "中" cut after two of three bytes
    deltas = _stream(tok, ids)
    assert deltas[:4] == ["o", "k", "", ""]
    assert "".join(deltas) == tok.decode(ids) == "ok\ufffd"
    # Invalid bytes followed by valid text are released without waiting for flush.
    bad = [_byte_token_id(tok, 0xFF), *tok.encode("x", add_special_tokens=False)]
    assert "".join(_stream(tok, bad)[:-1]) == tok.decode(bad) == "\ufffdx"


def test_stream_special_tokens(tok: Tokenizer) -> None:
    ids = [0, *tok.encode("hi there", add_special_tokens=False), 6, 1]
    assert "".join(_stream(tok, ids)) == "hi there"
    shown = "".join(_stream(tok, ids, skip_special_tokens=False))
    assert shown == tok.decode(ids, skip_special_tokens=False) == "<|bos|>hi there<|end|><|eos|>"


def test_stream_with_prompt_context(tok: Tokenizer) -> None:
    prompt = tok.encode("Once upon a time")
    out = tok.encode(" there was 一个 🐉.", add_special_tokens=False)
    deltas = _stream(tok, out, prompt_ids=prompt)
    assert "".join(deltas) == " there was 一个 🐉."
    stream = tok.new_stream(prompt)
    assert stream.flush() == "" and stream.text == ""


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=60))
def test_stream_property(tok: Tokenizer, text: str) -> None:
    # Special-token text in content encodes as the special token, which decoding skips.
    assume(not any(special in text for special in SPECIAL_TOKENS))
    ids = tok.encode(text)
    deltas = _stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas) or "\ufffd" in text


def test_stream_prompt_cut_mid_character(tok: Tokenizer) -> None:
    # The prompt ends with two of the three bytes of "中"; its text must not leak into the output.
    prompt = [*tok.encode("abc"), _byte_token_id(tok, 0xE4), _byte_token_id(tok, 0xB8)]
    out = [_byte_token_id(tok, 0xAD), *tok.encode(" ok", add_special_tokens=False)]
    assert "".join(_stream(tok, out, prompt_ids=prompt)) == tok.decode(out) == "\ufffd ok"


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_stream_random_ids(tok: Tokenizer, data: st.DataObject) -> None:
    # Arbitrary ids, heavy on raw high bytes so that split and invalid UTF-8 is common.
    high_byte = st.integers(0x80, 0xFF).map(lambda b: _byte_token_id(tok, b))
    some_id = st.one_of(st.integers(0, tok.vocab_size - 1), high_byte)
    ids = data.draw(st.lists(some_id, max_size=30))
    prompt = data.draw(st.none() | st.lists(some_id, max_size=10))
    assert "".join(_stream(tok, ids, prompt_ids=prompt)) == tok.decode(ids)


# ---------------------------------------------------------------- chat templates


def test_default_chat_template_rendering(tok: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 😀"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    assert tok.chat_template == DEFAULT_CHAT_TEMPLATE
    expected = (
        "<|system|>\nBe brief.<|end|>\n<|user|>\nHi 😀<|end|>\n"
        "<|assistant|>\nHello.<|end|>\n<|user|>\nBye<|end|>\n"
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == expected
    assert tok.apply_chat_template(messages) == expected + "<|assistant|>\n"
    ids = tok.encode_chat(messages)
    assert ids == [0, *tok.encode(expected + "<|assistant|>\n", add_special_tokens=False)]
    assert ids.count(0) == 1
    assert ids[1] == 3 and ids[-2:] == [5, tok.encode("\n", add_special_tokens=False)[0]]
    assert tok.decode(ids, skip_special_tokens=False) == "<|bos|>" + expected + "<|assistant|>\n"


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        ([{"role": "tool", "content": "x"}], "'tool'"),
        ([], "non-empty"),
        ("hello", "non-empty"),
        ([{"role": "user", "content": "ok"}, "nope"], "messages[1]"),
        ([{"role": "user"}], "messages[0]['content']"),
        ([{"role": "user", "content": "a"}, {"role": 3, "content": "b"}], "messages[1]['role']"),
    ],
)
def test_bad_messages(tok: Tokenizer, messages: object, needle: str) -> None:
    with pytest.raises(ValueError) as err:
        tok.apply_chat_template(messages)  # type: ignore[arg-type]
    assert needle in str(err.value)
    if "tool" in needle:
        assert "system, user, assistant" in str(err.value)


def _small_backend() -> Backend:
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<pad>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(["hello world, this is a small test corpus"] * 20, trainer)
    return backend


def test_plain_fallback_template(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    _small_backend().save(str(path))
    tok = load_tokenizer(path)
    assert tok.name == str(path)
    assert tok.chat_template == PLAIN_CHAT_TEMPLATE
    messages = [{"role": "system", "content": "S"}, {"role": "tool", "content": "T"}]
    assert tok.apply_chat_template(messages) == "system: S\ntool: T\nassistant: "
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == "system: S\ntool: T\n"
    # No config: EOS guessed from a well-known name, no BOS since nothing adds one.
    assert tok.special == SpecialTokens(bos_id=None, eos_ids=(1,), pad_id=None)
    assert tok.encode("hello") == tok.encode("hello", add_special_tokens=False)
    assert tok.encode_chat(messages) == tok.encode("system: S\ntool: T\nassistant: ")


# ---------------------------------------------------------------- Hugging Face folders

HF_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
    "[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)


@pytest.fixture
def hf_folder(tmp_path: Path) -> tuple[Path, Any]:
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_small_backend(),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        add_bos_token=True,
    )
    hf.chat_template = HF_TEMPLATE
    hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    return tmp_path, hf


def test_load_transformers_folder(hf_folder: tuple[Path, Any]) -> None:
    folder, hf = hf_folder
    tok = load_tokenizer(folder)
    assert tok.name == str(folder)
    assert tok.chat_template == HF_TEMPLATE
    assert tok.special == SpecialTokens(bos_id=0, eos_ids=(1, 3), pad_id=2)
    assert tok.vocab_size == len(hf)
    for text in ["hello world", "this is a test", "中文 😀", ""]:
        assert tok.encode(text) == hf.encode(text)
        assert tok.encode(text, add_special_tokens=False) == hf.encode(
            text, add_special_tokens=False
        )
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("hello")[0] == 0

    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]
    rendered = tok.apply_chat_template(messages)
    assert rendered == "<s>[user] hello</s>\n[assistant] world</s>\n[assistant] "
    assert rendered == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode_chat(messages)
    assert ids.count(0) == 1  # the template wrote BOS; no second one
    hf_ids = hf.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert ids == list(hf_ids)
    with pytest.raises(ValueError, match="no bad roles"):
        tok.apply_chat_template([{"role": "bad", "content": "x"}])
    # Roles outside system/user/assistant are fine for a model's own template.
    assert "[tool] x" in tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_folder_config_variants(hf_folder: tuple[Path, Any]) -> None:
    folder, _ = hf_folder
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    (folder / "generation_config.json").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    config.update(
        chat_template=[
            {"name": "tool_use", "template": "TOOLS"},
            {
                "name": "default",
                "template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
            },
        ],
        bos_token={"__type": "AddedToken", "content": "<s>", "special": True},
        eos_token={"content": "<|im_end|>"},
        add_bos_token=False,
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 1, "bos_token_id": 0}))
    tok = load_tokenizer(folder)
    assert tok.apply_chat_template([{"role": "user", "content": "abc"}]) == "abc"
    assert tok.special.bos_id == 0
    assert tok.special.eos_ids == (3, 1)
    # add_bos_token=False wins over the post-processor that tokenizer.json still carries.
    assert tok.encode("hello") == tok.encode("hello", add_special_tokens=False)
    assert 0 not in tok.encode_chat([{"role": "user", "content": "hello"}])

    (folder / "chat_template.jinja").write_text("JINJA FILE WINS")
    assert load_tokenizer(folder).chat_template == "JINJA FILE WINS"


def test_add_bos_token_without_post_processor(tmp_path: Path) -> None:
    _small_backend().save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tmp_path)
    assert tok.encode("hello") == [0, *tok.encode("hello", add_special_tokens=False)]
    assert tok.encode_chat([{"role": "user", "content": "hi"}]) == tok.encode(
        "user: hi\nassistant: "
    )


def test_missing_paths(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError) as err:
        load_tokenizer(missing)
    assert str(missing) in str(err.value) and "tokenizer.json" in str(err.value)
    empty = tmp_path / "empty-model"
    empty.mkdir()
    with pytest.raises(FileNotFoundError) as err:
        load_tokenizer(os.fspath(empty))
    assert str(empty) in str(err.value) and "tokenizer.json" in str(err.value)


@pytest.mark.parametrize("kind", ["fifo", "folder", "dangling link"])
def test_a_tokenizer_json_that_is_not_a_file_is_named(tmp_path: Path, kind: str) -> None:
    """A checkpoint folder's tokenizer.json that is there but not a regular file: before, the
    run fell back to the project's tokenizer without a word (ids that mean nothing to the
    checkpoint); a FIFO given as the tokenizer itself was 'does not exist'."""
    file = tmp_path / "tokenizer.json"
    if kind == "fifo":
        os.mkfifo(file)
    elif kind == "folder":
        file.mkdir()
    else:
        file.symlink_to(tmp_path / "gone.json")
    says = rf"^{file}: (is a directory|is a FIFO|cannot open it)"
    with pytest.raises(ValueError, match=says):
        tkz.tokenizer_for_model(str(tmp_path))
    if kind != "folder":  # a folder named as the tokenizer is a tokenizer folder
        with pytest.raises(ValueError, match=says):
            tkz.tokenizer_for_model("tiny", str(file))


def test_invalid_tokenizer_file(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        load_tokenizer(bad)


def test_saved_folder_loads_in_transformers_with_the_same_ids(tmp_path: Path) -> None:
    """What guidellm and AIPerf load to size prompts in the served model's tokens."""
    from transformers import AutoTokenizer

    ours = default_tokenizer()
    folder = ours.save_pretrained(tmp_path / "tok")
    theirs = AutoTokenizer.from_pretrained(str(folder))
    text = "The quick brown fox jumps over the lazy dog, twice: 1, 2."
    assert theirs(text)["input_ids"] == ours.encode(text)
    assert theirs.eos_token_id == ours.special.eos_ids[0]


def test_stream_step_gives_no_text_past_the_vocabulary(tok: Tokenizer) -> None:
    """A model whose embedding has more rows than the tokenizer has tokens can sample such an
    id (the HF and llama.cpp backends): it adds no text, and the stream goes on unharmed."""
    ids = tok.encode("hello world", add_special_tokens=False)
    stream, vocab = tok.new_stream(), tok.vocab_size
    texts = [stream_step(stream, ids[0], vocab), stream_step(stream, vocab, vocab)]
    texts += [stream_step(stream, i, vocab) for i in ids[1:]]
    assert texts[1] == ""
    assert "".join(texts) + stream.flush() == tok.decode(ids)
    assert stream_step(None, ids[0], vocab) == ""
