"""Perplexity of a checkpoint on a corpus split at several context lengths (the model card's measurement).

    python scripts/eval_ppl.py checkpoints/kvjax-code-tiny --contexts 2048,16384 --windows 4 --split heldout

Windows of each context start at file boundaries of the split (`kvjax.data.corpus.long_prompts`, the benchmark
prompts' source); perplexity is over the last 512 tokens of each window (`kvjax.training.evaluate`). Prints one
JSON line per context.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import kvjax  # noqa: E402
from kvjax.training.evaluate import perplexity  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--contexts", default="2048,16384")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--split", default="heldout", choices=["train", "val", "heldout"])
    ap.add_argument("--all-files", action="store_true", help="windows over the dependencies' files too")
    args = ap.parse_args(argv)
    model = kvjax.load(args.checkpoint)
    for c in [int(x) for x in args.contexts.split(",") if x]:
        t0 = time.perf_counter()
        ppl = perplexity(model, model.tokenizer, c, args.windows, split=args.split, stdlib_only=not args.all_files)
        print(json.dumps(dict(checkpoint=os.path.basename(os.path.normpath(args.checkpoint)), split=args.split,
                              stdlib_only=not args.all_files, context=c, windows=args.windows, ppl=round(ppl, 3),
                              seconds=round(time.perf_counter() - t0, 1))), flush=True)


if __name__ == "__main__":
    main()
