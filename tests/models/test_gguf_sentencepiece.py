"""A GGUF file's SentencePiece vocabulary (tokenizer.ggml.model `llama`: Llama 2, Mistral,
Phi-3, Gemma) rebuilt by the engine encodes and decodes as transformers' own GGUF tokenizer
reads the same file: merges recovered from the scores (Gemma: from the pieces' order), the
space prefix per family, byte fallback, control and user-defined tokens kept whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from models.gguf import UnsupportedGGUFError, tokenizer_folder
from models.tokenizer import load_tokenizer

SPACE = "\u2581"
# pieces in merge order: a piece's two halves come before it (what SentencePiece's BPE learns)
MERGED = [
    f"{SPACE}t", "he", f"{SPACE}the", f"{SPACE}a", "an", f"{SPACE}and", "at", f"{SPACE}c",
    f"{SPACE}cat", "in", f"{SPACE}in", "er", f"{SPACE}s", "is", f"{SPACE}is", "on",
    f"{SPACE}on", SPACE * 2, SPACE * 3, "12", "ll", f"{SPACE}he", "hell", f"{SPACE}hell",
]  # fmt: skip
CHARS = list(f"{SPACE}abcdefghijklmnopqrstuvwxyzTHE.,!'0123456789")
TEXTS = [
    "the cat and hello",
    "  the  cat",  # leading and repeated spaces
    " x",
    "The THE 1234!",
    "é ok\nnew line",  # bytes for what the vocabulary lacks
    "hi<start_of_turn>in <think> on",  # a control and a user-defined token kept whole
    "",
]


def write_sentencepiece_gguf(path: Path, arch: str, space_prefix: bool | None) -> Path:
    """A vocabulary-only GGUF of `arch` as llama.cpp writes a SentencePiece one: control
    tokens, the 256 byte tokens, pieces with descending scores; Gemma's special ids and its
    pieces of spaces stored as spaces."""
    import gguf

    gemma = arch.startswith("gemma")
    special = ["<pad>", "<eos>", "<bos>", "<unk>"] if gemma else ["<unk>", "<s>", "</s>"]
    merged = [" " * len(t) if gemma and not t.strip(SPACE) else t for t in MERGED]
    tokens = [*special, *(f"<0x{b:02X}>" for b in range(256)), *CHARS, *merged]
    tokens += ["<start_of_turn>", "<think>"]
    unknown, control, normal, byte = (
        int(gguf.TokenType.UNKNOWN),
        int(gguf.TokenType.CONTROL),
        int(gguf.TokenType.NORMAL),
        int(gguf.TokenType.BYTE),
    )
    types = [unknown if t == "<unk>" else control for t in special] + [byte] * 256
    types += [normal] * (len(CHARS) + len(merged)) + [control, int(gguf.TokenType.USER_DEFINED)]
    scores = [0.0] * (len(special) + 256) + [-1000.0 - i for i in range(len(CHARS))]
    scores += [-float(i) for i in range(len(merged))] + [0.0, 0.0]
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_uint32(f"{arch}.block_count", 1)
    writer.add_string("tokenizer.ggml.model", "llama")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.scores", scores)
    writer.add_array("tokenizer.ggml.token_type", types)
    ids = {"bos": 2, "eos": 1, "unknown": 3} if gemma else {"bos": 1, "eos": 2, "unknown": 0}
    for name, index in ids.items():
        writer.add_uint32(f"tokenizer.ggml.{name}_token_id", index)
    if space_prefix is not None:
        writer.add_bool("tokenizer.ggml.add_space_prefix", space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("arch", "space_prefix"),
    [("llama", None), ("llama", True), ("phi3", None), ("gemma2", False), ("gemma3", False)],
)
def test_sentencepiece_vocabulary_encodes_as_transformers_reads_it(
    tmp_path: Path, arch: str, space_prefix: bool | None
) -> None:
    import transformers  # the dev extra's

    path = write_sentencepiece_gguf(tmp_path / f"{arch}.gguf", arch, space_prefix)
    ours = load_tokenizer(tokenizer_folder(path))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    # the recovered merges apply ("▁and" has no two halves in the vocabulary: never formed)
    pieces = theirs.convert_ids_to_tokens(ours.encode("the cat and hello", False))
    first = ["t", "he"] if arch.startswith("gemma") else [f"{SPACE}the"]
    assert pieces == [*first, *(SPACE + w for w in ("cat", "a")), "n", "d", f"{SPACE}hell", "o"]
    assert ours.special.bos_id == (2 if arch.startswith("gemma") else 1)


def test_a_vocabulary_without_the_space_prefix_adds_none(tmp_path: Path) -> None:
    """tokenizer.ggml.add_space_prefix = false, as llama.cpp reads it (transformers' GGUF reader
    adds the prefix whatever the file says)."""
    path = write_sentencepiece_gguf(tmp_path / "llama.gguf", "llama", False)
    ours = load_tokenizer(tokenizer_folder(path))
    vocab = {token: i for i, token in enumerate(load_vocabulary(path))}
    assert ours.encode("the cat", False) == [vocab["t"], vocab["he"], vocab[f"{SPACE}cat"]]
    for text in TEXTS:
        assert ours.decode(ours.encode(text)) == text.replace("<start_of_turn>", "")


def load_vocabulary(path: Path) -> list[str]:
    import gguf

    field = gguf.GGUFReader(str(path)).fields["tokenizer.ggml.tokens"]
    return [bytes(field.parts[i]).decode() for i in field.data]


def test_scores_that_do_not_match_the_tokens_are_refused(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_string("tokenizer.ggml.model", "llama")
    writer.add_array("tokenizer.ggml.tokens", ["<unk>", "a", "b"])
    writer.add_array("tokenizer.ggml.token_type", [2, 1, 1])
    writer.add_array("tokenizer.ggml.scores", [0.0, -1.0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(UnsupportedGGUFError, match=r"tokenizer.ggml.scores: 2 values for 3 tokens"):
        tokenizer_folder(path)
