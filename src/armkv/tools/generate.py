"""``armkv generate``: answers for a JSONL file of requests with one cache method.

Input lines: ``{"id", "context", "question"?, "answer_prefix"?}`` or ``{"id", "prompt"}``.
Output lines: ``{"id", "method", "output", "prompt_tokens", "cache_bytes", "prefill_seconds",
"decode_seconds_per_token", "settings", "hash"}`` (``hash``: of the request and the settings).
The evaluations and benchmarks call this contract; keep it stable.

Everything the command line says is checked before the model loads (settings, option
values, sampling, the input, the output and its lock). The output is written through
``OUTPUT.partial`` and resumed by a rerun (``armkv.tools.output``). A request the model
cannot take is reported and skipped; the exit code is then 1, with the count.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from armkv.errors import ArmkvError, read_text
from armkv.options import options_for
from armkv.tools.output import Output, OutputClosed, id_key
from armkv.tools.preflight import DEFAULT_BUDGET, check_method, check_model_folder, resolve_budget, warn

TOOL = "generate"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", required=True, help="cache method (full, swa, sink, kivi, offload, arm, fifo)")
    parser.add_argument(
        "--budget",
        type=int,
        default=None,
        help=f"token-equivalents of KV memory per layer for a bounded method (default: {DEFAULT_BUDGET}; "
        "full and offload keep every token and take none)",
    )
    parser.add_argument("--input", required=True, help="requests, one JSON object per line ('-': standard input)")
    parser.add_argument(
        "--output",
        required=True,
        help="results, one JSON object per line ('-': standard output; a device or FIFO is written to as it is). "
        "An existing file is locked while the run lasts and resumed: requests already answered under the same "
        "settings are kept and skipped, a changed request is answered again",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the results already in --output with exactly this run's (the output is replaced once the "
        "run has gone through its requests; an interrupted one leaves it as it was)",
    )
    parser.add_argument(
        "--model", default=None, help="local transformers model folder (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument(
        "--adapter", default=None, help="arm and fifo: ARM parameters, a folder, 'calibrated' (the default) or 'random'"
    )
    parser.add_argument(
        "--option",
        action="append",
        metavar="METHOD.KEY=VALUE",
        help="a method option (repeatable), e.g. kivi.bits=4 or arm.slot_format=int8; arm.read=sparse is the "
        "measured sparse read (slot_mixing=false, top_m=fixed, m_fixed=1/8, read_rank=partial, read_pages=true, "
        "read_summaries=true; an option given beside it overrides its value), arm.read=dense the default",
    )
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk P (the sync point)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="most tokens generated per request")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="wrap context + question in the model's chat template (instruct models answer better so)",
    )
    parser.add_argument(
        "--engine",
        choices=("hf", "vllm"),
        default="hf",
        help="hf: armkv's own loop over transformers; vllm: vLLM with armkv's plugin (arm, fifo, full; "
        "docs/serving.md)",
    )
    g = parser.add_argument_group("sampling (default: greedy)")
    g.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sample with this temperature (0: greedy); unset sampling options come from the model's generation config",
    )
    g.add_argument(
        "--top-p", type=float, default=None, help="sample from the smallest set of tokens with this probability"
    )
    g.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens")
    g.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the draws (sampling only; 0 to 2**64 - 1): each request draws from a stream seeded by it and "
        "the request's id",
    )
    parser.add_argument(
        "--compile", action="store_true", help="decode through the method's torch.compile'd step (bounded methods)"
    )


def read_requests(path: str) -> tuple[list[dict], int]:
    """Parse a JSONL file (``-``: standard input): ``(requests, lines skipped)``. A line that is
    not a request (not strict JSON, too deeply nested, a lone surrogate in a string, a field
    missing or out of place), or repeats an earlier id, is reported with its number and
    skipped.

    Raises
    ------
    ArmkvError if the file is missing, not UTF-8, or holds no valid request.
    """
    from armkv.hf.runner import check_request

    name = "<stdin>" if path == "-" else path
    requests, seen, skipped = [], {}, 0
    for number, line in enumerate(read_text(path, "--input").split("\n"), start=1):
        if not line.strip():
            continue
        try:
            request = json.loads(line, parse_constant=_not_json)
            check_request(request)
            check_text(request)
        except (ValueError, RecursionError) as e:
            if isinstance(e, json.JSONDecodeError):
                reason = f"not JSON ({e.msg})"
            elif isinstance(e, RecursionError):
                reason = "not JSON (nested too deeply)"
            else:
                reason = str(e)
            print(f"armkv generate: warning: {name}:{number}: skipped, {reason}", file=sys.stderr)
            skipped += 1
            continue
        key = id_key(request["id"])
        if key in seen:
            print(
                f"armkv generate: warning: {name}:{number}: skipped, id {request['id']!r} repeats line {seen[key]}",
                file=sys.stderr,
            )
            skipped += 1
            continue
        seen[key] = number
        requests.append(request)
    if not requests:
        raise ArmkvError(f"{name} holds no request (one JSON object per line with 'id' and 'context' or 'prompt')")
    return requests, skipped


def _not_json(name: str):
    raise ArmkvError(f"not JSON ({name} is not a JSON number)")


def check_text(value, where: str = "") -> None:
    """Raise ArmkvError for a string, anywhere in a request, that holds a lone UTF-16 surrogate
    (JSON's \\ud800 escapes allow it; it is no text and cannot be tokenized or written)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ArmkvError(
                f"{where or 'a string'} holds a lone surrogate (\\u{ord(value[e.start]):04x}), not text"
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(key, "a key")
            check_text(item, repr(key))
    elif isinstance(value, list):
        for item in value:
            check_text(item, where)


def sampling_of(args: argparse.Namespace) -> dict | None:
    """The sampling settings, or None for greedy decoding; a one-line error for a value out of
    range (temperature and top-p finite, the seed a 64-bit unsigned integer)."""
    t, p, k, seed = args.temperature, args.top_p, args.top_k, args.seed
    if t is not None and not (math.isfinite(t) and t >= 0):
        raise ArmkvError(f"--temperature {t} must be a finite number >= 0 (0: greedy)")
    if p is not None and not 0 < p <= 1:  # false for NaN too
        raise ArmkvError(f"--top-p {p} must be in (0, 1]")
    if k is not None and k < 1:
        raise ArmkvError(f"--top-k {k} must be >= 1")
    if not 0 <= seed < 2**64:
        raise ArmkvError(f"--seed {seed} must be in [0, 2**64)")
    if t == 0:
        if p is not None or k is not None:
            raise ArmkvError(
                "--temperature 0 is greedy decoding: drop --top-p / --top-k, or give a temperature above 0"
            )
        return None
    if t is None and p is None and k is None:
        return None
    return {"temperature": t, "top_p": p, "top_k": k, "seed": seed}


def settings_of(args: argparse.Namespace) -> tuple[dict, dict]:
    """``(settings, options)``: what every result is made under (stored on each line), checked
    as far as it can be without the model (method, budget, option values, sampling, model folder)."""
    if args.max_new_tokens < 1:
        raise ArmkvError(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    sampling = sampling_of(args)
    options = options_for(args.method, args.option, args.adapter)
    budget = resolve_budget(args.method, args.budget, warn(TOOL))
    check_model_folder(args.model)
    check_method(args.method, budget, args.chunk, options, args.model)
    settings = {
        "model": str(args.model) if args.model else "default",
        "method": args.method,
        "budget": budget,
        "chunk": args.chunk,
        "chat": args.chat,
        "max_new_tokens": args.max_new_tokens,
        "options": options,
        "sampling": sampling,
    }
    if args.engine != "hf":
        settings["engine"] = args.engine
    return settings, options


def main(args: argparse.Namespace) -> int:
    settings, options = settings_of(args)
    requests, skipped = read_requests(args.input)
    output = Output(args.output, settings, args.overwrite, args.input, requests)
    complete = False
    try:
        if args.engine == "vllm":
            from armkv.tools.vllm_engine import run as run_engine
        else:
            run_engine = run
        failed, complete = run_engine(args, requests, output, settings["budget"], options, settings["sampling"])
    finally:
        note = output.close(complete)
        if note:
            print(f"armkv generate: {note}", file=sys.stderr)
    if not complete:
        print(
            f"armkv generate: error: standard output was closed after {output.added} results (e.g. by | head); "
            "the other requests were not answered",
            file=sys.stderr,
        )
        return 1
    if failed or skipped:
        parts = [f"{n} {what}" for n, what in ((skipped, "skipped in the input"), (failed, "failed")) if n]
        print(
            f"armkv generate: {' and '.join(parts)} of {len(requests) + skipped} requests (see the lines above); "
            f"the others are in {args.output}",
            file=sys.stderr,
        )
        return 1
    return 0


def run(args, requests: list[dict], output: Output, budget, options: dict, sampling: dict | None) -> tuple[int, bool]:
    """Answer the requests not yet in ``output``: ``(requests failed, whether the run went through
    them all)``. A request the model cannot take (too long) is reported and skipped."""
    from tqdm import tqdm

    from armkv.hf.model import load_model
    from armkv.hf.runner import Runner

    done = output.done
    todo = [r for r in requests if id_key(r["id"]) not in done]
    if len(todo) < len(requests):
        print(
            f"armkv generate: {len(requests) - len(todo)} of {len(requests)} requests already in {args.output}, "
            "skipped",
            file=sys.stderr,
        )
    if not todo:
        return 0, True
    model, tokenizer = load_model(args.model)
    runner = Runner(
        model, tokenizer, args.method, budget=budget, chunk=args.chunk, chat=args.chat, compile=args.compile, **options
    )
    sample = {} if sampling is None else {"do_sample": True, **sampling}
    failed = empty = 0
    with tqdm(total=len(todo), desc=args.method, unit="req", file=sys.stderr) as bar:
        for request in todo:
            try:
                (result,) = runner.generate([request], max_new_tokens=args.max_new_tokens, **sample)
            except (ArmkvError, UnicodeError) as e:
                # One request the model cannot take (too long) does not stop the others.
                tqdm.write(f"armkv generate: error: {e}", file=sys.stderr)
                failed += 1
            else:
                try:
                    output.write(result, request)
                except OutputClosed:
                    return failed, False
                empty += not result["output"].strip()
            bar.update(1)
    if empty and not args.chat:
        print(
            f"armkv generate: note: {empty} of {len(todo)} outputs are empty; an instruct model (the default one is) "
            "often answers only inside its chat template: try --chat, or give each request an answer_prefix",
            file=sys.stderr,
        )
    return failed, True
