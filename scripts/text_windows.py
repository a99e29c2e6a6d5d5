"""Cut a text into consecutive windows of N tokens of the default model's tokenizer, each
written as text (N + 64 tokens, decoded) so that `armkv eval ppl --max-tokens N` scores
window k: tokens [k*N, (k+1)*N) of the file. Perplexity over every window of a text tells
whether a difference at its first N tokens holds elsewhere.

    python scripts/text_windows.py heldout.txt --tokens 8192 --out windows/   # w0.txt ... w5.txt
    for w in windows/w*.txt; do armkv eval ppl --method arm --budget 512 --input $w --max-tokens 8192 --json; done
"""

from __future__ import annotations

import argparse
from pathlib import Path

from armkv.errors import read_text
from armkv.hf.compat import transformers
from armkv.hf.model import default_model_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("input", type=Path)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(default_model_dir()), local_files_only=True)
    ids = tokenizer(read_text(a.input, "input"))["input_ids"]
    a.out.mkdir(parents=True, exist_ok=True)
    for k in range(len(ids) // a.tokens):
        text = tokenizer.decode(ids[k * a.tokens : (k + 1) * a.tokens + 64])
        (a.out / f"w{k}.txt").write_text(text)
        print(f"w{k}.txt: tokens {k * a.tokens}-{(k + 1) * a.tokens - 1}, {text[:50]!r}")


if __name__ == "__main__":
    main()
