"""Perplexity of a shipped checkpoint on held-out code at a given context length, through the decode engine.

A window is `context + 1` tokens of a split starting at a file boundary (`corpus.long_prompts`, the benchmark
prompts' source); the model prefills the first `context` tokens in chunks (so 32K-token windows fit in memory) and
the perplexity is over the last `scored` positions, each predicted with the full context before it. Evaluating
the loaded checkpoint, not the training params, measures exactly what ships (bf16 weights, the shipped rope).

`perplexity` at different contexts scores different tokens (the end of a longer window lies further into the
split), so it mixes how hard the text is with how far the model can see. `perplexity_by_context` scores the same
tokens with only the last `c` tokens before them kept, for each `c`: the measure of whether longer context helps.
"""

from __future__ import annotations

import math

import numpy as np


def window_nll(model, window: np.ndarray, scored: int) -> tuple[float, int]:
    """(summed nll, count) of the last `scored` next-token predictions of `window` i32[context + 1]."""
    from kvjax import api

    logits = np.asarray(api.logits(model, window[:-1]), np.float64)[-scored:]
    target = window[-scored:]
    m = logits.max(-1, keepdims=True)
    logz = m[:, 0] + np.log(np.exp(logits - m).sum(-1))
    return float((logz - logits[np.arange(scored), target]).sum()), scored


def perplexity(model, tokenizer, context: int, windows: int, *, split: str = "heldout", scored: int = 512,
               seed: int = 1234, stdlib_only: bool = True) -> float:
    """exp(mean nll) over the last `scored` tokens of `windows` windows of `context` tokens of `split` (its stdlib
    files unless `stdlib_only=False`)."""
    return perplexity_by_context(model, tokenizer, [context], windows, split=split, scored=scored, seed=seed,
                                 stdlib_only=stdlib_only)[context]


def perplexity_by_context(model, tokenizer, contexts: list[int], windows: int, *, split: str = "heldout",
                          scored: int = 512, seed: int = 1234, stdlib_only: bool = True) -> dict[int, float]:
    """{c: perplexity} of the same scored tokens (the last `scored` of `windows` windows of max(contexts) + 1
    tokens of `split`), each window truncated to its last c + 1 tokens before scoring."""
    from kvjax.data import corpus

    if not contexts or min(contexts) < 1:
        raise ValueError(f"contexts must be positive token counts, got {contexts}")
    longest = max(contexts)
    scored = min(scored, min(contexts))
    sums = {c: 0.0 for c in contexts}
    count = 0
    for w in corpus.long_prompts(tokenizer, longest + 1, windows, seed, split_name=split,
                                   stdlib_only=stdlib_only):
        for c in contexts:
            sums[c] += window_nll(model, w[-(c + 1):], scored)[0]
        count += scored
    return {c: math.exp(sums[c] / count) for c in contexts}
