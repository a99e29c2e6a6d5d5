"""docs/cli-errors.md, the table of bad inputs and what each gets, made from the CLI's own
behaviour on the default model: ``python tests/test_cli_errors_doc.py`` rewrites it, and the
real-model test below fails when the table no longer matches what the CLI says.

Each case runs ``armkv`` in this process (as the console script does) in a scratch folder
and records its exit code and the line it prints on stderr (the error or warning; the scratch
folder's path reads ``DIR``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "cli-errors.md"

GOOD = json.dumps({"id": "q1", "prompt": "The sky is blue."})
# `armkv generate` with the full cache on in.jsonl, the command of every bad-input-file case
GEN_FULL = ["generate", "--method", "full", "--max-new-tokens", "2", "--input", "in.jsonl", "--output", "o.jsonl"]

# (what the user did, argv, lines of in.jsonl); argv names files in the scratch folder: in.jsonl,
# folder/, plain.txt, utf16.jsonl (UTF-16), text.txt, done.jsonl (one result made at budget 64), binary.dat,
# r.jsonl.partial (requests), noweights/ (a config.json alone) and changed.jsonl (q1's result for another prompt)
CASES = [
    ("output is a folder", ["generate", "--method", "full", "--input", "in.jsonl", "--output", "folder"], [GOOD]),
    (
        "output under a file",
        ["generate", "--method", "full", "--input", "in.jsonl", "--output", "plain.txt/out.jsonl"],
        [GOOD],
    ),
    ("output is the input", ["generate", "--method", "full", "--input", "in.jsonl", "--output", "in.jsonl"], [GOOD]),
    (
        "rerun into an output made with another budget",
        ["generate", "--method", "sink", "--budget", "128", "--input", "in.jsonl", "--output", "done.jsonl"],
        [GOOD],
    ),
    (
        "budget far beyond the model (sink)",
        ["generate", "--method", "sink", "--budget", "1000000000", "--input", "in.jsonl", "--output", "o.jsonl"],
        [GOOD],
    ),
    (
        "budget far beyond the model (kivi)",
        ["generate", "--method", "kivi", "--budget", "1000000000", "--input", "in.jsonl", "--output", "o.jsonl"],
        [GOOD],
    ),
    (
        "budget far beyond the model (arm)",
        ["generate", "--method", "arm", "--budget", "1000000000", "--input", "in.jsonl", "--output", "o.jsonl"],
        [GOOD],
    ),
    (
        "budget too small",
        ["generate", "--method", "sink", "--budget", "3", "--input", "in.jsonl", "--output", "o.jsonl"],
        [GOOD],
    ),
    (
        "budget 0",
        ["generate", "--method", "sink", "--budget", "0", "--input", "in.jsonl", "--output", "o.jsonl"],
        [GOOD],
    ),
    (
        "budget given to full",
        [
            "generate",
            "--method",
            "full",
            "--budget",
            "64",
            "--max-new-tokens",
            "2",
            "--input",
            "in.jsonl",
            "--output",
            "o.jsonl",
        ],
        [GOOD],
    ),
    ("unknown method", ["generate", "--method", "nope", "--input", "in.jsonl", "--output", "o.jsonl"], [GOOD]),
    (
        "typo in an option key (arm)",
        [
            "generate",
            "--method",
            "arm",
            "--option",
            "arm.slot_formt=int8",
            "--input",
            "in.jsonl",
            "--output",
            "o.jsonl",
        ],
        [GOOD],
    ),
    (
        "typo in an option key (kivi)",
        ["generate", "--method", "kivi", "--option", "kivi.bitz=2", "--input", "in.jsonl", "--output", "o.jsonl"],
        [GOOD],
    ),
    (
        "bad option value",
        ["generate", "--method", "kivi", "--option", "kivi.bits=3", "--input", "in.jsonl", "--output", "o.jsonl"],
        [GOOD],
    ),
    (
        "option without its method",
        ["generate", "--method", "kivi", "--option", "bits=2", "--input", "in.jsonl", "--output", "o.jsonl"],
        [GOOD],
    ),
    (
        "another method's option",
        ["generate", "--method", "kivi", "--option", "sink.sinks=2", "--input", "in.jsonl", "--output", "o.jsonl"],
        [GOOD],
    ),
    (
        "adapter for a method without one",
        ["generate", "--method", "sink", "--adapter", "random", "--input", "in.jsonl", "--output", "o.jsonl"],
        [GOOD],
    ),
    (
        "adapter folder missing",
        ["generate", "--method", "arm", "--adapter", "no/such/adapter", "--input", "in.jsonl", "--output", "o.jsonl"],
        [GOOD],
    ),
    (
        "--chunk 0",
        ["generate", "--method", "full", "--chunk", "0", "--input", "in.jsonl", "--output", "o.jsonl"],
        [GOOD],
    ),
    (
        "--max-new-tokens 0",
        ["generate", "--method", "full", "--max-new-tokens", "0", "--input", "in.jsonl", "--output", "o.jsonl"],
        [GOOD],
    ),
    (
        "negative temperature",
        ["generate", "--method", "full", "--temperature", "-1", "--input", "in.jsonl", "--output", "o.jsonl"],
        [GOOD],
    ),
    (
        "top-p above 1",
        ["generate", "--method", "full", "--top-p", "1.5", "--input", "in.jsonl", "--output", "o.jsonl"],
        [GOOD],
    ),
    (
        "greedy with top-k",
        [
            "generate",
            "--method",
            "full",
            "--temperature",
            "0",
            "--top-k",
            "5",
            "--input",
            "in.jsonl",
            "--output",
            "o.jsonl",
        ],
        [GOOD],
    ),
    ("input missing", ["generate", "--method", "full", "--input", "missing.jsonl", "--output", "o.jsonl"], [GOOD]),
    ("input is a folder", ["generate", "--method", "full", "--input", "folder", "--output", "o.jsonl"], [GOOD]),
    (
        "input not UTF-8 (UTF-16)",
        ["generate", "--method", "full", "--input", "utf16.jsonl", "--output", "o.jsonl"],
        [GOOD],
    ),
    ("input holds no request", ["generate", "--method", "full", "--input", "in.jsonl", "--output", "o.jsonl"], []),
    ("line not JSON", GEN_FULL, ["{not json", GOOD]),
    ("line not an object", GEN_FULL, ["[1, 2, 3]", GOOD]),
    ("line without id", GEN_FULL, ['{"prompt": "hi"}', GOOD]),
    ("neither context nor prompt", GEN_FULL, ['{"id": 1}', GOOD]),
    ("a field not a string", GEN_FULL, ['{"id": 1, "prompt": 5}', GOOD]),
    ("empty prompt", GEN_FULL, ['{"id": 1, "prompt": ""}', GOOD]),
    ("duplicate id", GEN_FULL, [GOOD, GOOD]),
    (
        "prompt longer than the model's positions",
        GEN_FULL,
        [json.dumps({"id": "long", "prompt": "The grass is green. " * 2000})],
    ),
    (
        "output is a text file that holds no results",
        ["generate", "--method", "full", "--input", "in.jsonl", "--output", "plain.txt"],
        [GOOD],
    ),
    (
        "output is a binary file",
        ["generate", "--method", "full", "--input", "in.jsonl", "--output", "binary.dat"],
        [GOOD],
    ),
    (
        "output is a device (discards the results)",
        ["generate", "--method", "full", "--max-new-tokens", "2", "--input", "in.jsonl", "--output", "/dev/null"],
        [GOOD],
    ),
    (
        "output is a full device",
        ["generate", "--method", "full", "--max-new-tokens", "2", "--input", "in.jsonl", "--output", "/dev/full"],
        [GOOD],
    ),
    (
        "input is the output's partial file",
        ["generate", "--method", "full", "--input", "r.jsonl.partial", "--output", "r.jsonl", "--overwrite"],
        [GOOD],
    ),
    (
        "rerun after a prompt changed",
        [
            "generate",
            "--method",
            "sink",
            "--budget",
            "64",
            "--max-new-tokens",
            "2",
            "--input",
            "in.jsonl",
            "--output",
            "changed.jsonl",
        ],
        [GOOD],
    ),
    ("a lone surrogate in a prompt", GEN_FULL, ['{"id": 1, "prompt": "The sky \\ud800 is blue."}', GOOD]),
    ("NaN as an id", GEN_FULL, ['{"id": NaN, "prompt": "hi"}', GOOD]),
    ("a question beside a prompt", GEN_FULL, ['{"id": 1, "prompt": "hi", "question": "why?"}', GOOD]),
    ("a line nested 100,000 deep", GEN_FULL, ["[" * 100_000, GOOD]),
    (
        "an option that is --chunk",
        ["generate", "--method", "arm", "--option", "arm.chunk=64", "--input", "in.jsonl", "--output", "o.jsonl"],
        [GOOD],
    ),
    (
        "an integer option given text",
        ["generate", "--method", "arm", "--option", "arm.sinks=abc", "--input", "in.jsonl", "--output", "o.jsonl"],
        [GOOD],
    ),
    (
        "a negative count",
        ["generate", "--method", "sink", "--option", "sink.sinks=-1", "--input", "in.jsonl", "--output", "o.jsonl"],
        [GOOD],
    ),
    (
        "a fraction where a count goes",
        ["generate", "--method", "sink", "--option", "sink.sinks=2.5", "--input", "in.jsonl", "--output", "o.jsonl"],
        [GOOD],
    ),
    (
        "a switch given neither true nor false",
        [
            "generate",
            "--method",
            "arm",
            "--option",
            "arm.read_pages=maybe",
            "--input",
            "in.jsonl",
            "--output",
            "o.jsonl",
        ],
        [GOOD],
    ),
    (
        "an unknown preset",
        ["generate", "--method", "arm", "--option", "arm.read=fast", "--input", "in.jsonl", "--output", "o.jsonl"],
        [GOOD],
    ),
    (
        "temperature NaN",
        ["generate", "--method", "full", "--temperature", "nan", "--input", "in.jsonl", "--output", "o.jsonl"],
        [GOOD],
    ),
    (
        "temperature infinite",
        ["generate", "--method", "full", "--temperature", "inf", "--input", "in.jsonl", "--output", "o.jsonl"],
        [GOOD],
    ),
    (
        "seed beyond 64 bits",
        [
            "generate",
            "--method",
            "full",
            "--temperature",
            "1",
            "--seed",
            str(10**23),
            "--input",
            "in.jsonl",
            "--output",
            "o.jsonl",
        ],
        [GOOD],
    ),
    (
        "model folder without weights",
        ["generate", "--method", "full", "--model", "noweights", "--input", "in.jsonl", "--output", "o.jsonl"],
        [GOOD],
    ),
    ("eval ruler: output is a file", ["eval", "ruler", "--output", "plain.txt"], []),
    (
        "eval ppl: option without its method",
        ["eval", "ppl", "--method", "arm", "--option", "slot_format=int8", "--input", "text.txt"],
        [],
    ),
    (
        "eval ppl: typo in an option key",
        ["eval", "ppl", "--method", "kivi", "--option", "kivi.bitz=2", "--input", "text.txt"],
        [],
    ),
    ("eval ruler: budget far beyond the model", ["eval", "ruler", "--budget", "1000000000", "--output", "ruler"], []),
    (
        "bench decode: option of a method not run",
        ["bench", "decode", "--methods", "swa", "--option", "kivi.bits=2"],
        [],
    ),
    ("unknown command", ["frobnicate"], []),
]


def scratch(folder: Path, lines: list[str]) -> None:
    (folder / "in.jsonl").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    (folder / "folder").mkdir()
    (folder / "plain.txt").write_text("x\n")
    (folder / "utf16.jsonl").write_bytes((GOOD + "\n").encode("utf-16"))
    (folder / "text.txt").write_text("The grass is green. " * 20)
    done = {
        "id": "q0",
        "method": "sink",
        "output": "",
        "settings": {
            "model": "default",
            "method": "sink",
            "budget": 64,
            "chunk": 256,
            "chat": False,
            "max_new_tokens": 64,
            "options": {},
            "sampling": None,
        },
    }
    (folder / "done.jsonl").write_text(json.dumps(done) + "\n")
    (folder / "binary.dat").write_bytes(bytes(range(256)))
    (folder / "r.jsonl.partial").write_text(GOOD + "\n", encoding="utf-8")
    (folder / "noweights").mkdir()
    (folder / "noweights" / "config.json").write_text('{"model_type": "llama"}')
    from armkv.tools.output import request_hash

    settings = {**done["settings"], "max_new_tokens": 2}
    old = {"id": "q1", "prompt": "The sky was blue."}  # in.jsonl's q1 before its prompt changed
    made = {**done, "id": "q1", "settings": settings, "hash": request_hash(old, settings)}
    (folder / "changed.jsonl").write_text(json.dumps(made) + "\n")


def run_case(argv: list[str], lines: list[str]) -> tuple[int, str]:
    """(exit code, the first error or warning line on stderr, else its last line)."""
    from armkv.cli import main

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        scratch(folder, lines)
        err = io.StringIO()
        cwd = os.getcwd()
        os.chdir(folder)
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                try:
                    code = main(argv)
                except SystemExit as e:  # argparse's own errors
                    code = e.code
        finally:
            os.chdir(cwd)
        text = err.getvalue().replace(str(folder.resolve()), "DIR").replace(str(folder), "DIR")
    shown = [line for line in text.splitlines() if "error" in line or "warning" in line]
    last = text.strip().splitlines()[-1] if text.strip() else ""
    return int(code or 0), (shown[0] if shown else last)


def render() -> str:
    rows = ["| what was given | exit | what armkv says (stderr) |", "|---|---|---|"]
    for what, argv, lines in CASES:
        code, said = run_case(argv, lines)
        command = "armkv " + " ".join(argv)
        if lines != [GOOD]:  # the requests, where they are what is wrong
            command += " (in.jsonl: " + ", ".join(line if len(line) < 40 else line[:37] + "..." for line in lines) + ")"
        cell = lambda s: s.replace("|", "\\|")  # noqa: E731
        rows.append(f"| {cell(what)}: `{cell(command)}` | {code} | {cell(said)} |")
    head = (
        "# Bad input and what armkv says\n\n"
        "Every row was produced by running the command on the default model (SmolLM2-135M-Instruct,\n"
        "8192 positions) in a scratch folder `DIR`; regenerate with `python tests/test_cli_errors_doc.py`.\n"
        "Exit 2: nothing ran (all of these are found before the model loads, but the over-long prompt\n"
        "and the full device); exit 1: some requests were skipped or failed (the last line counts them),\n"
        "the others were answered; exit 0 with a warning: the run went on as the warning says.\n\n"
    )
    return head + "\n".join(rows) + "\n"


@pytest.mark.real_model
def test_doc_matches_the_cli():
    assert DOC.read_text(encoding="utf-8") == render(), (
        "docs/cli-errors.md is stale: python tests/test_cli_errors_doc.py"
    )


if __name__ == "__main__":
    DOC.write_text(render(), encoding="utf-8")
    print(f"wrote {DOC}", file=sys.stderr)
