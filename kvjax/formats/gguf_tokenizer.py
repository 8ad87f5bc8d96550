"""A GGUF file's tokenizer (`tokenizer.ggml.*` metadata) as a `kvjax.tokenizer.Tokenizer`, built with `tokenizers`.

Byte-level BPE (`tokenizer.ggml.model = gpt2`) only: the vocabulary and merges from the metadata, control tokens
(token type 3) added as special tokens and user-defined ones (type 4) as added tokens, so each stays whole in text;
the pre-tokenizer (how text is split before merging) chosen by `tokenizer.ggml.pre`, with the split rules llama.cpp
applies for that name (`llama-vocab.cpp`); BOS, EOS, UNK, PAD from their ids and the chat template from
`tokenizer.chat_template`. A tokenizer model or pre-tokenizer name not in the tables below raises an error naming it.
"""

from __future__ import annotations

import functools

from kvjax.errors import UnsupportedConfigError
from kvjax.tokenizer import Tokenizer

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types

# Llama 3's split: contractions case-insensitive, letters with one leading non-letter, numbers of up to 3 digits
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's: the same with single digits
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _pre_tokenizer(name: str, path: str):
    from tokenizers import Regex, pre_tokenizers as pt  # noqa: PLC0415

    gpt2 = pt.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's own split, built into ByteLevel
    if name in ("gpt2", "default"):
        return gpt2
    if name == "smollm":  # StarCoder-style: every digit alone, then GPT-2's split
        return pt.Sequence([pt.Digits(individual_digits=True), gpt2])
    regex = {"llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3, "qwen2": _QWEN2}.get(name)
    if regex is None:
        raise UnsupportedConfigError(f"{path}: tokenizer.ggml.pre={name!r}; kvjax knows gpt2, default, smollm, "
                                     f"llama-bpe (llama3), qwen2")
    return pt.Sequence([pt.Split(Regex(regex), behavior="isolated"),
                        pt.ByteLevel(add_prefix_space=False, use_regex=False)])


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (the alphabet byte-level vocabularies are spelled in)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def gguf_tokenizer(meta: dict, path: str) -> Tokenizer:
    """The tokenizer a GGUF file's metadata describes.

    Raises:
        UnsupportedConfigError: a tokenizer model other than `gpt2` (byte-level BPE), or an unknown pre-tokenizer.
    """
    from tokenizers import AddedToken, Tokenizer as Backend, decoders, models, processors  # noqa: PLC0415

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedConfigError(f"{path}: tokenizer.ggml.model={kind!r}; kvjax reads byte-level BPE ('gpt2') "
                                     f"tokenizers from GGUF")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        if key not in meta:
            raise UnsupportedConfigError(f"{path}: metadata key {key} is missing")
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type")
    types = [1] * len(tokens) if types is None else [int(t) for t in types]
    if len(types) != len(tokens):
        raise UnsupportedConfigError(f"{path}: {len(types)} token types for {len(tokens)} tokens")
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # a token written in plain UTF-8 rather than the byte alphabet is respelled byte by byte, so BPE can reach it
    vocab = {t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    merges = []
    for m in meta["tokenizer.ggml.merges"]:
        a, sep, b = m.partition(" ")
        if not sep:
            raise UnsupportedConfigError(f"{path}: merge {m!r} is not two tokens separated by a space")
        merges.append((a, b))
    backend = Backend(models.BPE(vocab, merges))
    backend.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"), path)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, k in zip(tokens, types) if k == CONTROL])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, k in zip(tokens, types) if k == USER_DEFINED])

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bos = token("bos_token_id")
    if bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None:
        bos_id = int(meta["tokenizer.ggml.bos_token_id"])
        backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                               special_tokens=[(bos, bos_id)])
    config = {"bos_token": bos, "eos_token": token("eos_token_id"), "unk_token": token("unknown_token_id"),
              "pad_token": token("padding_token_id")}
    return Tokenizer(backend, config, meta.get("tokenizer.chat_template"), path=path)
