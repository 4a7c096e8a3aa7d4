"""The SentencePiece vocabulary of a GGUF file (tokenizer.ggml.model `llama`: Llama 2, Mistral,
Phi-3, Gemma) as a `tokenizers` BPE with byte fallback.

A file keeps the pieces, a score each and their types, not SentencePiece's merge rules; the
merges are recovered from the vocabulary (every split of a piece into two pieces that are
also in it), ranked by the piece's score (Gemma: by its place in the file, which its scores do
not follow), as transformers' GGUF reader does, the reference the tests compare with. How the
text is cut before the BPE depends on the family, which the file does not say:

- a space prefix (`tokenizer.ggml.add_space_prefix`, default true) and spaces as "▁" by
  SentencePiece's Metaspace, for Llama and Mistral;
- the same through a normalizer for Phi-3 (text starting with spaces keeps each of them);
- no prefix for Gemma, whose tokens of several spaces the file stores as real spaces.
"""

from __future__ import annotations

from typing import Any

SPACE = "\u2581"  # SentencePiece's visible space
#: llama.cpp's token types kept whole: unknown and control (special), user-defined (not)
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4


def sentencepiece_tokenizer(
    arch: str, tokens: list[str], types: list[int], scores: list[float], space_prefix: bool
) -> Any:
    """The `tokenizers.Tokenizer` of the file's vocabulary for a model of `arch`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    gemma = arch.startswith("gemma")
    if gemma:  # a token of spaces only is stored with spaces, and looked up with "▁"
        tokens = [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
        ranks = [-float(i) for i in range(len(tokens))]
    else:
        ranks = list(scores)
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_merges(tokens, vocab, ranks),
            fuse_unk=True,
            byte_fallback=True,
            unk_token="<unk>" if gemma and "<unk>" in vocab else None,
        )
    )
    decode = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        backend.normalizer = normalizers.Replace(" ", SPACE)
    elif arch == "phi3":
        backend.normalizer = normalizers.Sequence(
            [normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)]
        )
        if space_prefix:
            decode.append(decoders.Strip(content=" ", left=1))
    else:
        scheme = "first" if space_prefix else "never"
        backend.pre_tokenizer = pre_tokenizers.Metaspace(SPACE, scheme, split=False)
        if space_prefix:
            decode.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(decode)
    kinds = list(zip(tokens, types, strict=True))
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, ty in kinds
            if ty in (_UNKNOWN, _CONTROL)
        ]
    )
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, ty in kinds if ty == _USER_DEFINED]
    )
    return backend


def _merges(tokens: list[str], vocab: dict[str, int], ranks: list[float]) -> list[tuple[str, str]]:
    """Every (left, right) whose concatenation is a piece, best-ranked piece first; the splits
    of one piece by the ids of their halves, then by the halves' lengths."""
    found = []
    for piece, rank in zip(tokens, ranks, strict=True):
        splits = [
            (piece[:i], piece[i:])
            for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        found += [(left, right, rank) for left, right in splits]
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]
