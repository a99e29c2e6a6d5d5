"""Ask a running ``vllm serve`` (OpenAI-compatible server, started with armkv's plugin, docs/serving.md)
RULER samples that ``armkv eval ruler`` scored, and check its answers against that folder's:

    python scripts/vllm_serve_check.py --url http://localhost:8000 --folder runs/ruler-vllm-noise --samples 1

Each sample is rebuilt from the folder's settings (armkv's seeded generator), sent to
``/v1/completions`` as the token ids the evals feed (context, then question and answer prefix,
as one prompt), greedy, as many tokens as the eval generated; an answer equal to the folder's
output word for word passes. Prints one line a sample and a final JSON line; exit status 1 if
any answer differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=3600) as response:
        return json.loads(response.read())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://localhost:8000")
    p.add_argument("--folder", type=Path, required=True, help="an `armkv eval ruler` output folder")
    p.add_argument("--samples", type=int, default=1, help="samples a (method, task, length) log to ask")
    p.add_argument("--haystack-file", default=None, help="the prose haystack of an essay folder")
    args = p.parse_args()

    from transformers import AutoTokenizer

    from armkv.evals import ruler
    from armkv.evals.common import SampleLog
    from armkv.tools.vllm_engine import encode, model_folder

    config = json.loads((args.folder / "config.json").read_text())
    model = model_folder(None if config["model"] == "default" else config["model"])
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    words = ruler.load_essay(args.haystack_file) if args.haystack_file else None
    override = None if config["haystack"] == "task" else config["haystack"]
    generator = ruler.RulerGenerator(tokenizer, config["seed"], words, None, haystack=override)
    with urllib.request.urlopen(f"{args.url}/v1/models", timeout=60) as response:
        served = json.loads(response.read())["data"][0]["id"]
    checked = []
    for path in sorted(args.folder.glob("*__*__*.jsonl")):
        for record in SampleLog(path).records[: args.samples]:
            task, length = record["task"], int(record["length"])
            index = int(record["id"].rsplit("-", 1)[1])
            sample = generator.samples(task, length, index + 1, config.get("depths"))[index]
            ids = encode(tokenizer, sample, config["chat"])
            limit = min(ruler.tokens_to_generate(task), config.get("max_new_tokens") or 10**9)
            start = time.perf_counter()
            answer = post(
                f"{args.url}/v1/completions",
                {"model": served, "prompt": ids, "max_tokens": limit, "temperature": 0},
            )["choices"][0]["text"]
            seconds = time.perf_counter() - start
            equal = answer == record["output"]
            checked.append(
                {"id": record["id"], "label": record["label"], "equal": equal, "served": answer, "seconds": seconds}
            )
            print(
                f"{record['label']} {record['id']} ({len(ids)} tokens, {seconds:.0f} s): served {answer!r}, "
                f"eval {record['output']!r}: {'equal' if equal else 'DIFFERENT'}"
            )
    print(json.dumps({"url": args.url, "model": served, "folder": str(args.folder), "checked": checked}))
    return 0 if checked and all(c["equal"] for c in checked) else 1


if __name__ == "__main__":
    sys.exit(main())
