"""Write the corpus manifest of the bundled code model and print split sizes.

    python scripts/build_corpus.py [--out checkpoints/kvjax-code-tiny]

Writes <out>/corpus_manifest.json (Python version, rules, per-split file lists with sha256, and per package — the
standard library and each runtime dependency — its version, licence and file counts; the "tokenizer" section
written by train_tokenizer.py is kept) and prints files / bytes / tokens / chars-per-token per split.
Token counts need <out>/tokenizer.json (run scripts/train_tokenizer.py first); the token streams are cached
under kvjax.data.corpus.cache_dir().
"""

from __future__ import annotations

import argparse
import os
import sys
import time

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)
from kvjax.data import corpus  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(REPO, "checkpoints", "kvjax-code-tiny"))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    m = corpus.write_manifest(os.path.join(args.out, "corpus_manifest.json"))
    tok = None
    if os.path.exists(os.path.join(args.out, "tokenizer.json")):
        from kvjax.tokenizer import Tokenizer
        tok = Tokenizer.from_dir(args.out)
    print(f"Python {m['python_version']}; stdlib at {corpus.stdlib_root()}; {len(m['packages']) - 1} dependency "
          f"distributions" + (f" (not installed: {', '.join(m['dependencies_not_installed'])})"
                              if m["dependencies_not_installed"] else ""))
    print(f"{'split':8s} {'files':>6s} {'MB':>8s} {'chars':>10s} {'tokens':>10s} {'chars/tok':>9s} {'s':>6s}")
    for name in corpus.SPLITS:
        s = m["splits"][name]
        chars = len(corpus.read_text(name))
        n_tok, cpt, secs = "-", "-", 0.0
        if tok is not None:
            t0 = time.perf_counter()
            n = corpus.token_stream(tok, name).size
            secs = time.perf_counter() - t0
            n_tok, cpt = str(n), f"{chars / n:.3f}"
        print(f"{name:8s} {s['n_files']:6d} {s['bytes'] / 1e6:8.3f} {chars:10d} {n_tok:>10s} {cpt:>9s} {secs:6.1f}")


if __name__ == "__main__":
    main()
