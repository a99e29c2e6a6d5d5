"""``armkv generate``: answers for a JSONL file of requests with one cache method.

Input lines: ``{"id", "context", "question"?, "answer_prefix"?}`` or ``{"id", "prompt"}``.
Output lines: ``{"id", "method", "output", "prompt_tokens", "cache_bytes", "prefill_seconds",
"decode_seconds_per_token", "settings"}``. The evaluations and benchmarks call this contract;
keep it stable.

The output is written to ``OUTPUT.partial`` and renamed over ``OUTPUT`` when the run ends
(also when it is interrupted: every line in it is whole). A rerun into the same output
resumes: it keeps the results there, answers only the ids not yet in it, and refuses to
mix results made under other settings (``settings`` on every line).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from armkv.errors import ArmkvError, read_text
from armkv.options import options_for
from armkv.tools.preflight import DEFAULT_BUDGET, check_method, resolve_budget, warn
from armkv.tools.results import compare_settings, read_records

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
        help="results, one JSON object per line ('-': standard output). An existing file is resumed: "
        "ids already answered under the same settings are kept and skipped",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the results already in --output instead of resuming them (the output is "
        "replaced when the run has as many results)",
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
        help="a method option (repeatable), e.g. kivi.bits=4 or arm.slot_format=int8",
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
    g.add_argument("--seed", type=int, default=0, help="seed of each request's draws (sampling only)")
    parser.add_argument(
        "--compile", action="store_true", help="decode through the method's torch.compile'd step (bounded methods)"
    )


def read_requests(path: str) -> list[dict]:
    """Parse a JSONL file (``-``: standard input); a bad line, or a line repeating an earlier
    id, is reported with its number and skipped.

    Raises
    ------
    ArmkvError if the file is missing, not UTF-8, or holds no valid request.
    """
    from armkv.hf.runner import check_request

    name = "<stdin>" if path == "-" else path
    requests, seen = [], {}
    for number, line in enumerate(read_text(path, "--input").split("\n"), start=1):
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            check_request(request)
        except (json.JSONDecodeError, ArmkvError) as e:
            reason = f"not JSON ({e.msg})" if isinstance(e, json.JSONDecodeError) else str(e)
            print(f"armkv generate: warning: {name}:{number}: skipped, {reason}", file=sys.stderr)
            continue
        key = id_key(request["id"])
        if key in seen:
            print(
                f"armkv generate: warning: {name}:{number}: skipped, id {request['id']!r} repeats line {seen[key]}",
                file=sys.stderr,
            )
            continue
        seen[key] = number
        requests.append(request)
    if not requests:
        raise ArmkvError(f"{name} holds no request (one JSON object per line with 'id' and 'context' or 'prompt')")
    return requests


def id_key(request_id) -> str:
    """A request id as a hashable, type-exact key (1 and "1" differ)."""
    return json.dumps(request_id, sort_keys=True)


def sampling_of(args: argparse.Namespace) -> dict | None:
    """The sampling settings, or None for greedy decoding."""
    t, p, k = args.temperature, args.top_p, args.top_k
    if t is not None and t < 0:
        raise ArmkvError(f"--temperature {t} must be >= 0 (0: greedy)")
    if p is not None and not 0 < p <= 1:
        raise ArmkvError(f"--top-p {p} must be in (0, 1]")
    if k is not None and k < 1:
        raise ArmkvError(f"--top-k {k} must be >= 1")
    if t == 0:
        if p is not None or k is not None:
            raise ArmkvError(
                "--temperature 0 is greedy decoding: drop --top-p / --top-k, or give a temperature above 0"
            )
        return None
    if t is None and p is None and k is None:
        return None
    return {"temperature": t, "top_p": p, "top_k": k, "seed": args.seed}


class Output:
    """Where results go: standard output, or a file written through ``FILE.partial`` and
    renamed over it at the end, starting with the results the file already holds.

    Parameters
    ----------
    path : the --output path, or "-"
    settings : what every result was produced under (stored on each line)
    overwrite : replace the results the output holds (an interrupted --overwrite's own
        results, left in the .partial, are still resumed)
    input_path : the --input path (never written over)
    """

    def __init__(self, path: str, settings: dict, overwrite: bool, input_path: str):
        self.settings = settings
        self.stdout = path == "-"
        self.kept: list[dict] = []
        self.before = 0  # results the output held when the run started
        self.added = 0
        self.file = None
        if self.stdout:
            return
        self.path = Path(path)
        self.partial = self.path.with_name(self.path.name + ".partial")
        check_output_path(self.path, input_path)
        previous = read_records(self.path)
        self.before = len(previous)
        # A run that could not rename (killed, or an interrupted --overwrite) leaves its whole
        # lines in the .partial: resumed like the output, by --overwrite too where its settings match.
        by_id = {}
        for source in (self.path, self.partial):
            records = previous if source == self.path else read_records(source)
            if overwrite and (source == self.path or not all(r.get("settings") == settings for r in records)):
                continue
            for record in records:
                if "id" not in record:
                    raise ArmkvError(f"{source} holds a line without an 'id': not an armkv generate output")
                if "settings" not in record:
                    raise ArmkvError(
                        f"{source} holds results without the settings they were made under: pass another --output, "
                        "or --overwrite to replace them"
                    )
                compare_settings(
                    record.get("settings", {}),
                    settings,
                    str(source),
                    "pass another --output, or --overwrite to replace them",
                )
                by_id[id_key(record["id"])] = record
        self.kept = list(by_id.values())
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = self.partial.open(
                "w", encoding="utf-8"
            )  # before the model loads: a path we cannot write fails now
        except OSError as e:
            raise ArmkvError(f"--output {self.path}: cannot write there ({e.strerror})") from None
        for record in self.kept:
            self.file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.file.flush()

    @property
    def done(self) -> set[str]:
        return {id_key(r["id"]) for r in self.kept}

    def write(self, result: dict) -> None:
        line = json.dumps({**result, "settings": self.settings}, ensure_ascii=False) + "\n"
        if self.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
        else:
            self.file.write(line)
            self.file.flush()
        self.added += 1

    def close(self) -> bool:
        """Rename the partial file over the output unless that would hold fewer results than
        the output held before the run (an interrupted --overwrite); returns whether it did."""
        if self.stdout or self.file is None:
            return True
        self.file.close()
        self.file = None
        if len(self.kept) + self.added < self.before:
            return False
        if not self.kept and not self.added and not self.path.exists():
            self.partial.unlink()  # nothing was produced: no empty output
            return True
        os.replace(self.partial, self.path)
        return True


def check_output_path(output: Path, input_path: str) -> None:
    """One-line errors for an output that is a folder, lies under a file, or is the input."""
    if output.is_dir():
        raise ArmkvError(f"--output {output} is a folder; name a file in it, e.g. {output / 'results.jsonl'}")
    for parent in output.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ArmkvError(f"--output {output}: {parent} is a file, not a folder")
            break
    same = input_path != "-" and (
        Path(input_path).resolve() == output.resolve()
        or (output.exists() and Path(input_path).exists() and os.path.samefile(input_path, output))
    )
    if same:
        raise ArmkvError(f"--output {output} is the --input file: name another file (the requests would be lost)")


def main(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1:
        raise ArmkvError(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    sampling = sampling_of(args)
    options = options_for(args.method, args.option, args.adapter)
    budget = resolve_budget(args.method, args.budget, warn(TOOL))
    check_method(args.method, budget, args.chunk, options, args.model)
    requests = read_requests(args.input)
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
    output = Output(args.output, settings, args.overwrite, args.input)
    try:
        if args.engine == "vllm":
            from armkv.tools.vllm_engine import run as run_vllm

            return run_vllm(args, requests, output, budget, options, sampling)
        return run(args, requests, output, budget, options, sampling)
    finally:
        if not output.close():
            print(
                f"armkv generate: {output.path} keeps its {output.before} earlier results; the {output.added} new ones "
                f"are in {output.partial} (rerun with --overwrite to finish replacing them)",
                file=sys.stderr,
            )


def run(args, requests: list[dict], output: Output, budget, options: dict, sampling: dict | None) -> int:
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
        return 0
    model, tokenizer = load_model(args.model)
    runner = Runner(
        model, tokenizer, args.method, budget=budget, chunk=args.chunk, chat=args.chat, compile=args.compile, **options
    )
    sample = (
        {}
        if sampling is None
        else {
            "do_sample": True,
            "temperature": sampling["temperature"],
            "top_p": sampling["top_p"],
            "top_k": sampling["top_k"],
            "seed": sampling["seed"],
        }
    )
    failed = empty = 0
    with tqdm(total=len(todo), desc=args.method, unit="req", file=sys.stderr) as bar:
        for request in todo:
            try:
                (result,) = runner.generate([request], max_new_tokens=args.max_new_tokens, **sample)
            except ArmkvError as e:
                # One request the model cannot take (too long) does not stop the others.
                tqdm.write(f"armkv generate: error: {e}", file=sys.stderr)
                failed += 1
            else:
                output.write(result)
                empty += not result["output"].strip()
            bar.update(1)
    if empty and not args.chat:
        print(
            f"armkv generate: note: {empty} of {len(todo)} outputs are empty; an instruct model (the default one is) "
            "often answers only inside its chat template: try --chat, or give each request an answer_prefix",
            file=sys.stderr,
        )
    return 1 if failed else 0
