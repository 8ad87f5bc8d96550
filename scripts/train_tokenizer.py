"""Train the byte-level BPE tokenizer of the bundled code model on the corpus's train split.

    python scripts/train_tokenizer.py [--out checkpoints/kvjax-code-tiny] [--vocab-size 4096] [--max-mb 20]

Writes tokenizer.json and tokenizer_config.json (ChatML chat template, loadable by
`transformers.AutoTokenizer.from_pretrained`) and records what it trained on under the "tokenizer" key of
corpus_manifest.json. Deterministic for a given corpus: the BPE trainer breaks ties by pair order, not at random.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)
from kvjax.data import corpus  # noqa: E402

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
# The pre-tokenizer split of Qwen2 / GPT-4 style tokenizers: words with one leading non-letter, single digits,
# punctuation runs with their trailing newlines, newline runs with their indentation before them, other spaces.
# Single digits keep numbers compositional; whitespace runs let BPE learn indentation tokens.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build(vocab_size: int) -> tuple[Tokenizer, trainers.BpeTrainer]:
    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # No normalizer and no post-processor: text round-trips byte for byte and nothing is added to encodings.
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    return tok, trainer


def training_texts(max_bytes: int) -> tuple[list[str], list[str]]:
    """Train-split file pieces in path order until `max_bytes` of UTF-8 text; returns (texts, relpaths)."""
    texts, used, total = [], [], 0
    # The shipped tokenizer was trained on the standard library alone; keep it reproducible.
    for relpath, text in corpus.pieces("train", stdlib_only=True):
        if total >= max_bytes:
            break
        texts.append(text)
        used.append(relpath)
        total += len(text.encode("utf-8"))
    return texts, used


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(REPO, "checkpoints", "kvjax-code-tiny"))
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--max-mb", type=float, default=20.0, help="train on at most this much of the train split")
    args = ap.parse_args(argv)

    texts, used = training_texts(int(args.max_mb * 1e6))
    tok, trainer = build(args.vocab_size)
    t0 = time.perf_counter()
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    seconds = time.perf_counter() - t0
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))

    os.makedirs(args.out, exist_ok=True)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    config = dict(
        tokenizer_class="PreTrainedTokenizerFast",
        bos_token=None,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS[1:],
        add_bos_token=False,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        model_max_length=131072,
        chat_template=CHAT_TEMPLATE,
    )
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")

    record = dict(
        vocab_size=tok.get_vocab_size(),
        special_tokens=SPECIAL_TOKENS,
        trained_on="train split pieces (separator line + file text), in path order, until max_bytes",
        max_bytes=int(args.max_mb * 1e6),
        n_files=len(used),
        bytes=sum(len(t.encode("utf-8")) for t in texts),
        train_seconds=round(seconds, 2),
        min_frequency=2,
        pre_tokenizer="Split(Qwen2-style regex, isolated) + ByteLevel(use_regex=False)",
    )
    mpath = os.path.join(args.out, "corpus_manifest.json")
    m = {}
    if os.path.exists(mpath):
        with open(mpath) as f:
            m = json.load(f)
    m["tokenizer"] = record
    with open(mpath, "w") as f:
        json.dump(m, f, indent=1)
        f.write("\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
