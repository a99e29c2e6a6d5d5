"""What a method's wrong answers on a RULER multi-needle task are: the samples are generated
again from the run's seed (the output folder's config.json) and each wrong answer's first
number is matched against the needles' values in its context. Prints, per method's JSONL in
FOLDER, the wrong answers, how many are 7-digit numbers and how many are another needle's value,
and (ARM) the mean share of the asked value's tokens still exact on right and on wrong answers.

    python scripts/needle_misses.py runs/prose-8k-mk1-arm30 --haystack-file heldout.txt
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from armkv.evals.ruler import RulerGenerator, load_essay
from armkv.hf.model import load_model

NEEDLE = re.compile(r"magic numbers? for \S+ is:? (\d+)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--haystack-file", default=None, help="the run's essay haystack (prose runs)")
    a = p.parse_args()
    config = json.loads((a.folder / "config.json").read_text())
    _, tokenizer = load_model()
    essay = load_essay(a.haystack_file) if a.haystack_file else None
    generator = RulerGenerator(tokenizer, config["seed"], essay, haystack=config.get("haystack"))
    for path in sorted(a.folder.glob("*__*__*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        task, length = rows[0]["task"], int(rows[0]["length"])
        samples = generator.samples(task, length, len(rows))
        wrong = seven = distractor = 0
        for sample, row in zip(samples, rows):
            if sample["answers"] != row["answers"]:
                raise SystemExit(f"{path}: sample {row['id']} does not match the regenerated one (another haystack file?)")
            if row["score"] > 0:
                continue
            wrong += 1
            found = re.search(r"\d+", row["output"])
            number = found.group(0) if found else ""
            seven += len(number) == 7
            distractor += number in set(NEEDLE.findall(sample["context"])) - set(row["answers"])
        line = f"{path.name}: {len(rows)} samples, {wrong} wrong, {seven} of them 7-digit numbers, {distractor} another needle's value"
        if all(isinstance(row.get("memory"), dict) for row in rows):
            for label, keep in (("right", lambda r: r["score"] > 0), ("wrong", lambda r: r["score"] == 0)):
                shares = [row["memory"]["exact_share"] for row in rows if keep(row)]
                if shares:
                    line += f"; exact share on {label} answers {sum(shares) / len(shares):.3f}"
        print(line)


if __name__ == "__main__":
    main()
