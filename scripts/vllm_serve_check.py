"""Ask a running ``vllm serve`` (OpenAI-compatible server, started with armkv's plugin, docs/serving.md)
RULER samples that ``armkv eval ruler`` scored, and check its answers against that folder's:

    python scripts/vllm_serve_check.py --url http://localhost:8000 --folder runs/ruler-vllm-noise --samples 1

Each sample is rebuilt from the folder's settings (armkv's seeded generator), sent to
``/v1/completions`` as the token ids the evals feed (context, then question and answer prefix,
as one prompt), greedy, as many tokens as the eval generated; it passes where the answer's
tokens, decoded as the eval decodes them, equal the folder's output word for word. ``--label``
keeps the logs of one method (the one the server runs) where the folder holds several;
``--folder`` may be given more than once (``--haystack-file`` gives the prose folders' text);
``--output`` also writes the final JSON to a file (atomically). Prints one line a sample and a
final JSON line; exit status 1 if any answer differs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from pathlib import Path


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=3600) as response:
        return json.loads(response.read())


def check_folder(
    url: str, served: str, folder: Path, config: dict, samples: int, haystack_file, label: str | None = None
) -> list[dict]:
    """Ask the server the first ``samples`` samples of each log of one eval folder (of ``label``'s logs)."""
    from transformers import AutoTokenizer

    from armkv.evals import ruler
    from armkv.evals.common import SampleLog
    from armkv.tools.vllm_engine import encode, model_folder

    model = model_folder(None if config["model"] == "default" else config["model"])
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    words = ruler.load_essay(haystack_file) if config["haystack"] == "essay" else None
    override = None if config["haystack"] == "task" else config["haystack"]
    generator = ruler.RulerGenerator(tokenizer, config["seed"], words, None, haystack=override)
    checked = []
    for path in sorted(folder.glob(f"{label or '*'}__*__*.jsonl")):
        for record in SampleLog(path).records[:samples]:
            task, length = record["task"], int(record["length"])
            index = int(record["id"].rsplit("-", 1)[1])
            sample = generator.samples(task, length, index + 1, config.get("depths"))[index]
            ids = encode(tokenizer, sample, config["chat"])
            limit = min(ruler.tokens_to_generate(task), config.get("max_new_tokens") or 10**9)
            start = time.perf_counter()
            body = {"model": served, "prompt": ids, "max_tokens": limit, "temperature": 0, "return_token_ids": True}
            choice = post(f"{url}/v1/completions", body)["choices"][0]
            seconds = time.perf_counter() - start
            # the tokens decoded as the eval decodes them (the server's text holds back the bytes
            # of a character its last tokens leave incomplete)
            answer = tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
            equal = answer == record["output"]
            checked.append(
                {
                    "folder": str(folder),
                    "haystack": config["haystack"],
                    "id": record["id"],
                    "label": record["label"],
                    "tokens": len(ids),
                    "equal": equal,
                    "served": answer,
                    "served_text": choice["text"],
                    "eval": record["output"],
                    "seconds": round(seconds, 2),
                }
            )
            print(
                f"{config['haystack']} {record['label']} {record['id']} ({len(ids)} tokens, {seconds:.0f} s): "
                f"served {answer!r}, eval {record['output']!r}: {'equal' if equal else 'DIFFERENT'}",
                flush=True,
            )
    return checked


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://localhost:8000")
    p.add_argument(
        "--folder", type=Path, action="append", required=True, help="an `armkv eval ruler` output folder (repeatable)"
    )
    p.add_argument("--samples", type=int, default=1, help="samples a (method, task, length) log to ask")
    p.add_argument("--haystack-file", default=None, help="the prose haystack of the essay folders")
    p.add_argument("--label", default=None, help="only this method's logs (its label in the folder, e.g. arm)")
    p.add_argument("--output", type=Path, default=None, help="also write the final JSON here")
    args = p.parse_args()
    configs = {}
    for folder in args.folder:
        if not (folder / "config.json").is_file():
            p.error(f"{folder} holds no config.json: give an `armkv eval ruler` output folder")
        configs[folder] = json.loads((folder / "config.json").read_text())
        if configs[folder]["haystack"] == "essay" and not args.haystack_file:
            p.error(f"{folder} was scored on the prose haystack: give its text with --haystack-file")

    with urllib.request.urlopen(f"{args.url}/v1/models", timeout=60) as response:
        served = json.loads(response.read())["data"][0]["id"]
    checked = []
    for folder, config in configs.items():
        checked += check_folder(args.url, served, folder, config, args.samples, args.haystack_file, args.label)
    result = {"url": args.url, "model": served, "folders": [str(f) for f in args.folder], "checked": checked}
    print(json.dumps(result))
    if args.output:
        tmp = args.output.with_name(args.output.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        os.replace(tmp, args.output)
    return 0 if checked and all(c["equal"] for c in checked) else 1


if __name__ == "__main__":
    sys.exit(main())
