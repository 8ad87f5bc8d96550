"""`kvjax generate --ratio / --max-kept / --draft-dtype / --draft-weights`: the drafter's budget, cache dtype and weights from the
command line; refused by name where they mean nothing or are out of range; output unchanged by them."""

from __future__ import annotations

import json

import pytest
from builders import BUNDLED, cli_error

import kvjax
from kvjax import cli
from pallas_kernels import native


@pytest.mark.parametrize("argv,needle", [
    (["--prompt", "x", "--ratio", "8"], "--ratio means nothing with --mode full"),
    (["--prompt", "x", "--draft-weights", "bfloat16"], "--draft-weights means nothing with --mode full"),
    (["--prompt", "x", "--mode", "vericache", "--ratio", "0.5"], "--ratio must be >= 1"),
    (["--prompt", "x", "--max-kept", "64"], "--max-kept means nothing with --mode full"),
    (["--prompt", "x", "--mode", "vericache", "--max-kept", "8"], "--max-kept must be >= 32"),
])
def test_drafter_flags_are_refused_by_name(capsys, argv, needle):
    assert cli.main(["generate", "--model", "/no/such/model", *argv]) == 2
    assert needle in cli_error(capsys)


@pytest.mark.skipif(not native.available(), reason="bf16 draft weights need the native kernel on CPU")
def test_a_bf16_8x_draft_gives_full_cache_decodings_tokens(capsys):
    prompt = "def parse(line):\n    " * 20
    assert cli.main(["generate", "--model", BUNDLED, "--prompt", prompt, "--mode", "vericache", "--draft-len", "4",
                     "--new-tokens", "8", "--ignore-eos", "--ratio", "8", "--max-kept", "32", "--draft-dtype", "bfloat16",
                     "--draft-weights", "bfloat16", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    model = kvjax.load(BUNDLED)
    full = kvjax.generate(model, model.tokenizer.encode(prompt), 8, ignore_eos=True)
    assert res["tokens"] == full.tolist()
