"""``armkv generate``: answers for a JSONL file of requests with one cache method.

Input lines: ``{"id", "context", "question"?, "answer_prefix"?}`` or ``{"id", "prompt"}``.
Output lines: ``{"id", "method", "output", "prompt_tokens", "cache_bytes", "prefill_seconds",
"decode_seconds_per_token"}``. The evaluations and benchmarks call this contract; keep it stable.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from armkv.errors import ArmkvError, read_text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", required=True, help="cache method (full, swa, sink, kivi, offload, arm, ...)")
    parser.add_argument("--budget", type=int, default=None, help="token-equivalents of KV memory per layer")
    parser.add_argument("--model", default=None, help="local transformers model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--adapter", default=None, help="ARM parameters: a folder, 'calibrated' (the default), 'trained' or 'random'")
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk P (the sync point)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--chat", action="store_true", help="wrap context + question in the chat template")
    parser.add_argument("--compile", action="store_true", help="decode through the method's torch.compile'd step (bounded methods)")
    parser.add_argument("--input", required=True, help="requests, one JSON object per line")
    parser.add_argument("--output", required=True, help="results, one JSON object per line")


def read_requests(path: Path) -> list[dict]:
    """Parse a JSONL file; a bad line is reported with its number and skipped.

    Raises
    ------
    ArmkvError if the file is missing, not UTF-8, or holds no valid request.
    """
    from armkv.hf.runner import check_request

    requests = []
    for number, line in enumerate(read_text(path, "--input").split("\n"), start=1):
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            check_request(request)
        except (json.JSONDecodeError, ArmkvError) as e:
            reason = f"not JSON ({e.msg})" if isinstance(e, json.JSONDecodeError) else str(e)
            print(f"armkv generate: warning: {path}:{number}: skipped, {reason}", file=sys.stderr)
            continue
        requests.append(request)
    if not requests:
        raise ArmkvError(f"{path} holds no request (one JSON object per line with 'id' and 'context' or 'prompt')")
    return requests


def main(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from armkv.hf.model import load_model
    from armkv.hf.runner import Runner

    requests = read_requests(Path(args.input))
    if args.max_new_tokens < 1:
        raise ArmkvError(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    model, tokenizer = load_model(args.model)
    options = {"adapter": args.adapter} if args.adapter is not None else {}
    runner = Runner(model, tokenizer, args.method, budget=args.budget, chunk=args.chunk, chat=args.chat, compile=args.compile, **options)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    failed = 0
    with output.open("w", encoding="utf-8") as out, tqdm(total=len(requests), desc=args.method, unit="req") as bar:
        for request in requests:
            try:
                (result,) = runner.generate([request], max_new_tokens=args.max_new_tokens)
            except ArmkvError as e:
                # One request the model cannot take (too long) does not stop the others.
                tqdm.write(f"armkv generate: error: {e}", file=sys.stderr)
                failed += 1
            else:
                out.write(json.dumps(result) + "\n")
                out.flush()
            bar.update(1)
    return 1 if failed else 0
