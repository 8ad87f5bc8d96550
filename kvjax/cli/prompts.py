"""Where `kvjax generate` gets its prompts: --prompt, --prompt-file, --long-prompt (held-out code) or a JSONL batch
(--prompts-file), each read with errors that name the file or flag at fault."""

from __future__ import annotations

import json

import numpy as np

from kvjax.cli.common import CliError


def read_text(path: str, flag: str) -> str:
    """A UTF-8 text file's content, or a one-line error naming the file and the flag."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise CliError(f"{flag} {path}: {e.strerror or e}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CliError(f"{flag} {path}: not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r})") from None


def encode(model, text: str, chat: bool) -> np.ndarray:
    tok = model.tokenizer
    if tok is None:
        raise CliError(f"model directory {model.path} has no tokenizer.json; pass token ids via --prompts-file "
                       f"(\"token_ids\") or the Python API")
    if chat:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    else:
        ids = tok.encode(text)
    if not ids:
        raise CliError("the prompt encodes to no tokens")
    return np.asarray(ids, np.int32)


def single_prompt(args, model) -> np.ndarray:
    """The one prompt of --prompt / --prompt-file / --long-prompt, as token ids."""
    if args.long_prompt:
        if model.tokenizer is None:
            raise CliError("--long-prompt needs a model directory with tokenizer.json")
        from kvjax.data import corpus

        return corpus.long_prompts(model.tokenizer, args.long_prompt, 1, seed=args.prompt_index or 0)[0]
    if args.prompt_file:
        return encode(model, read_text(args.prompt_file, "--prompt-file"), args.chat)
    return encode(model, args.prompt, args.chat)


def batch_prompts(args, model) -> list[np.ndarray]:
    """The prompts of --prompts-file: one JSON object per line, {"prompt": text} or {"token_ids": [ids]}."""
    lines = read_text(args.prompts_file, "--prompts-file").splitlines()
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise CliError(f"--prompts-file {args.prompts_file} line {n}: not JSON ({e.msg})") from None
        if not isinstance(item, dict) or ("prompt" in item) == ("token_ids" in item):
            raise CliError(f"--prompts-file {args.prompts_file} line {n}: expected an object with exactly one of "
                           f"\"prompt\" (text) or \"token_ids\" (a list of ids)")
        if "prompt" in item:
            if not isinstance(item["prompt"], str):
                raise CliError(f"--prompts-file {args.prompts_file} line {n}: \"prompt\" must be a string")
            out.append(encode(model, item["prompt"], args.chat))
        else:
            out.append(item["token_ids"])
    if not out:
        raise CliError(f"--prompts-file {args.prompts_file}: no prompts in it")
    return out
