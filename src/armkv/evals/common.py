"""What every eval shares: the output folder, the rows it compares, and the tables.

An output folder holds one append-only JSONL of scored samples per (row, task, length),
``config.json`` (the settings its samples were produced under), ``summary.json`` as
``{row: {task: {length: score}}}`` (lengths as strings, scores 0-100) and the markdown
table. Running an eval again into the same folder skips the sample ids already scored,
so an interrupted run continues where it stopped.

Nothing here imports torch, transformers or a plotting library at module level: the
evals are tools around the library, imported only when ``armkv eval`` runs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from armkv.errors import ArmkvError
from armkv.options import parse_options, with_adapter
from armkv.tools.results import compare_settings


@dataclass(frozen=True)
class Row:
    """One row of a results table: a cache method with its options.

    ``label`` names the row (the method name, or an ablation variant's name);
    ``options`` are passed to the runner as method options (``arm_overrides`` for the
    ablation rows).
    """

    label: str
    method: str
    options: dict = field(default_factory=dict)


# (method, options) -> an object with the Runner contract:
# .generate(requests, max_new_tokens=..., do_sample=False) -> list of result dicts.
RunnerFactory = Callable[[str, dict], object]


def parse_list(text: str | None, what: str, cast: Callable = str) -> list:
    """Split a comma-separated option into a list, with a one-line error naming the option."""
    if text is None or not str(text).strip():
        return []
    values = []
    for item in (item.strip() for item in str(text).split(",")):
        if item:
            try:
                values.append(cast(item))
            except ValueError:
                raise ArmkvError(f"--{what} {text!r}: {item!r} is not a valid value") from None
    return values


def parse_length(text: str) -> int:
    """``4096``, ``4k`` or ``4K`` -> 4096 (RULER's lengths are powers of two of 1024)."""
    match = re.fullmatch(r"\s*(\d+)\s*([kK]?)\s*", text)
    if not match:
        raise ValueError(text)
    return int(match.group(1)) * (1024 if match.group(2) else 1)


def add_common_arguments(
    parser, *, methods: str | None, samples: int, samples_help: str = "samples per task and length"
) -> None:
    """The options every eval takes (``--output``, ``--methods``, ``--budget``, ...)."""
    parser.add_argument(
        "--output", required=True, type=Path, help="folder for per-sample JSONL, summary.json and the table (resumable)"
    )
    if methods is not None:
        parser.add_argument("--methods", default=methods, help=f"comma-separated cache methods (default: {methods})")
    parser.add_argument(
        "--budget",
        type=int,
        default=512,
        help="cache budget in token-equivalents per layer for the bounded methods (default: %(default)s)",
    )
    parser.add_argument(
        "--chunk",
        type=int,
        default=256,
        help="prefill chunk P: the budgeted chunked prefill's sync point (default: %(default)s)",
    )
    parser.add_argument("--samples", type=int, default=samples, help=samples_help + " (default: %(default)s)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="decode the bounded methods through their torch.compile'd step (full and offload run eagerly)",
    )
    parser.add_argument("--model", default=None, help="model folder (default: the packaged SmolLM2-135M-Instruct)")
    parser.add_argument(
        "--seed", type=int, default=42, help="seed of the generated samples (default: %(default)s, RULER's)"
    )
    parser.add_argument(
        "--adapter", default=None, help="arm and fifo: ARM parameters, a folder, 'calibrated' (the default) or 'random'"
    )
    parser.add_argument(
        "--option",
        action="append",
        metavar="METHOD.KEY=VALUE",
        help="a method option (repeatable), e.g. arm.slot_format=int8, kivi.bits=2 or arm.read=sparse (the "
        "measured sparse read's six options; an option given beside it overrides its value)",
    )


def method_rows(text: str, options: dict[str, dict] | None = None) -> list[Row]:
    """``--methods full,arm`` -> one row per method (checked against the registry), with its ``--option`` values."""
    from armkv.methods.base import get_method

    names = parse_list(text, "methods")
    if not names:
        raise ArmkvError("--methods is empty: name at least one cache method")
    for name in names:
        get_method(name)
    return [Row(name, name, dict((options or {}).get(name, {}))) for name in names]


def unbounded(rows: list[Row]) -> list[str]:
    """The rows whose method holds every token, so the budget does not apply to them."""
    from armkv.methods.base import get_method

    return [row.label for row in rows if not get_method(row.method).bounded]


def method_options(args) -> dict[str, dict]:
    """``{method: options}`` from ``--option METHOD.KEY=VALUE`` and ``--adapter`` (given to arm and
    fifo where --methods names them; the ablation's rows take arm's options)."""
    methods = parse_list(args.methods, "methods") if getattr(args, "methods", None) else ["arm"]
    return with_adapter(parse_options(args.option), getattr(args, "adapter", None), methods)


def settings_of(args, eval_name: str, **extra) -> dict:
    """What a folder's samples were produced under (see :func:`check_settings`)."""
    return {
        "eval": eval_name,
        "model": str(args.model) if args.model else "default",
        "budget": args.budget,
        "chunk": args.chunk,
        "chat": args.chat,
        "seed": args.seed,
        "options": method_options(args),
        **extra,
    }


def load(args, settings: dict | None = None):
    """``(model, tokenizer, info)`` for ``--model`` (default: the packaged model), after the
    checks that need no model: the output folder, the model folder, the budget, each method's
    options and, where ``settings`` are given, that the output folder's samples were made
    under them (:func:`check_settings` writes them once the model is loaded)."""
    from armkv.hf.attach import model_info
    from armkv.hf.model import load_model

    check_args(args, settings)
    model, tokenizer = load_model(args.model)
    return model, tokenizer, model_info(model)


def check_args(args, settings: dict | None = None) -> None:
    """:func:`load`'s checks, which need no model: the output folder (and, where ``settings`` are
    given, that its samples were made under them), the model folder, the budget, each method's options."""
    from armkv.tools.preflight import (
        check_budget,
        check_method,
        check_model_folder,
        check_output_folder,
        resolve_budget,
    )

    if getattr(args, "output", None) is not None:
        check_output_folder(args.output)
        if settings is not None:
            compare_folder_settings(args.output, settings)
    check_model_folder(args.model)
    check_budget(args.budget, args.model)
    if getattr(args, "methods", None):  # each method's options, values included, before the model loads
        options = method_options(args)
        for method in parse_list(args.methods, "methods"):
            check_method(method, resolve_budget(method, args.budget), args.chunk, options.get(method, {}), args.model)


def runner_factory(
    model, tokenizer, *, budget: int | None, chunk: int, chat: bool, compile: bool = False
) -> RunnerFactory:
    """Runners of :class:`armkv.hf.runner.Runner` for one model; the budget, and ``compile``
    (the compiled decode step), go to bounded methods only.

    A ``chat`` key in a row's options overrides ``chat`` for that runner (LongBench leaves
    some datasets without the chat template).
    """
    from armkv.hf.runner import Runner
    from armkv.methods.base import get_method

    def make(method: str, options: dict):
        options = dict(options)
        use_chat = options.pop("chat", chat)
        bounded = get_method(method).bounded
        return Runner(
            model,
            tokenizer,
            method,
            budget=budget if bounded else None,
            chunk=chunk,
            chat=use_chat,
            compile=compile and bounded,
            **options,
        )

    return make


# --------------------------------------------------------------------------- the folder


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=+-]+", "_", str(text))


def log_path(folder: Path, label: str, task: str, length: str) -> Path:
    """Where the samples of one (row, task, length) are logged."""
    return Path(folder) / f"{_slug(label)}__{_slug(task)}__{_slug(length)}.jsonl"


class SampleLog:
    """The append-only JSONL of one (row, task, length): one scored sample per line.

    A line cut short by an interrupted write is dropped on open, so the next append
    starts on a line of its own.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.records: list[dict] = []
        if self.path.exists():
            lines = self.path.read_text(encoding="utf-8").splitlines()
            kept = []
            for i, line in enumerate(lines):
                try:
                    self.records.append(json.loads(line))
                    kept.append(line)
                except json.JSONDecodeError:
                    if i != len(lines) - 1:
                        raise ArmkvError(
                            f"{self.path}: line {i + 1} is not JSON; remove the file to score it again"
                        ) from None
            if len(kept) != len(lines):
                self.path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")

    @property
    def done_ids(self) -> set:
        return {record["id"] for record in self.records}

    def append(self, record: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.records.append(record)


def compare_folder_settings(folder: Path, settings: dict) -> None:
    """Refuse, without writing anything, a folder whose samples were made under other settings."""
    path = Path(folder) / "config.json"
    if not path.exists():
        return
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        raise ArmkvError(f"{path} is not the settings file an eval writes (not JSON): name another --output") from None
    if not isinstance(old, dict):
        raise ArmkvError(f"{path} is not the settings file an eval writes (not a JSON object): name another --output")
    compare_settings(old, json.loads(json.dumps(settings)), str(folder))


def check_settings(folder: Path, settings: dict) -> None:
    """Write ``config.json``, or refuse a folder whose samples were made under other settings.

    ``settings`` holds what changes a sample's score (model, budget, chunk, chat, seed,
    method options, generation caps); rows, tasks, lengths and sample counts may grow
    from run to run.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    settings = json.loads(json.dumps(settings))  # normalise tuples and paths as JSON sees them
    compare_folder_settings(folder, settings)
    path.write_text(json.dumps(settings, indent=2, allow_nan=False) + "\n")


def collect_summary(folder: Path) -> dict:
    """``{row: {task: {length: score}}}`` from every sample log in the folder (mean score, 2 decimals)."""
    summary: dict = {}
    for path in sorted(Path(folder).glob("*__*__*.jsonl")):
        records = SampleLog(path).records
        if not records:
            continue
        first = records[0]
        mean = sum(r["score"] for r in records) / len(records)
        summary.setdefault(first["label"], {}).setdefault(first["task"], {})[str(first["length"])] = round(mean, 2)
    return summary


def write_summary(folder: Path, summary: dict) -> Path:
    path = Path(folder) / "summary.json"
    path.write_text(json.dumps(summary, indent=2, sort_keys=False) + "\n")
    return path


# --------------------------------------------------------------------------- tables


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def markdown_table(cells: dict, rows: list[str], columns: list[str], caption: str, first: str = "Method") -> str:
    """A table in the paper's layout: rows, then columns, then ``Avg.`` (over the columns).

    ``cells[row][column]`` is a score or missing; a row with a missing cell shows ``-``
    there and no average (an average over a subset would not compare with the others).
    """

    def fmt(value) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines = [f"| {first} | " + " | ".join(columns) + " | Avg. |", "|---|" + "---|" * (len(columns) + 1)]
    for row in rows:
        values = [cells.get(row, {}).get(col) for col in columns]
        avg = _mean(values) if values and all(v is not None for v in values) else None
        lines.append(f"| {row} | " + " | ".join(fmt(v) for v in values) + f" | {fmt(avg)} |")
    return "\n".join(lines) + f"\n\n{caption}\n"


def by_length(summary: dict, rows: list[str], lengths: list[str], tasks: list[str]) -> dict:
    """``{row: {length: mean over tasks}}``; a length lacking a task stays missing."""
    cells: dict = {}
    for row in rows:
        for length in lengths:
            scores = [summary.get(row, {}).get(task, {}).get(length) for task in tasks]
            if scores and all(s is not None for s in scores):
                cells.setdefault(row, {})[length] = _mean(scores)
    return cells


def by_task(summary: dict, rows: list[str], tasks: list[str], lengths: list[str]) -> dict:
    """``{row: {task: mean over lengths}}``; a task lacking a length stays missing."""
    cells: dict = {}
    for row in rows:
        for task in tasks:
            scores = [summary.get(row, {}).get(task, {}).get(length) for length in lengths]
            if scores and all(s is not None for s in scores):
                cells.setdefault(row, {})[task] = _mean(scores)
    return cells


def memory_cells(folder: Path, rows: list[str]) -> tuple[dict, dict]:
    """From the samples of memory methods (records with ``memory``, see
    ``Runner.memory_report``): ``({row: {length: share of the watched (needle) tokens
    still held exactly, in %}}, {row: {length: slots used, in %}})``, means over tasks and samples."""
    shares: dict = {}
    used: dict = {}
    for path in sorted(Path(folder).glob("*__*__*.jsonl")):
        for r in SampleLog(path).records:
            memory = r.get("memory")
            if not memory or r["label"] not in rows:
                continue
            key = str(r["length"])
            if "exact_share" in memory:
                shares.setdefault(r["label"], {}).setdefault(key, []).append(100 * memory["exact_share"])
            used.setdefault(r["label"], {}).setdefault(key, []).append(100 * memory["slots_used"] / memory["slots"])
    mean = lambda table: {row: {k: _mean(v) for k, v in cells.items()} for row, cells in table.items()}  # noqa: E731
    return mean(shares), mean(used)


def length_label(length: str) -> str:
    """``"4096"`` -> ``"4K"`` as the paper's columns read; other values unchanged."""
    if length.isdigit() and int(length) % 1024 == 0:
        return f"{int(length) // 1024}K"
    return length


def budget_caption(budget: int | None, info, measured: dict[str, int], unbounded: list[str]) -> str:
    """The caption every table carries: the budget in token-equivalents and bytes, and the bytes each row measured.

    Parameters
    ----------
    budget : token-equivalents per layer given to the bounded methods
    info : the model's :class:`armkv.methods.base.ModelInfo`, or None
    measured : row label -> largest ``cache_bytes`` a sample of that row reported
    unbounded : the rows whose method holds every token (the budget does not apply)
    """
    parts = []
    if budget is not None:
        text = f"Budget: {budget} token-equivalents per layer"
        if info is not None:
            per_layer = info.budget_bytes(budget)
            total = per_layer * info.num_layers
            text += f" = {per_layer:,} bytes per layer and sequence, {total:,} bytes over {info.num_layers} layers"
        if unbounded:
            text += f" ({', '.join(unbounded)}: not bounded)"
        parts.append(text + ".")
    if measured:
        parts.append(
            "Measured cache bytes (largest sample): " + ", ".join(f"{k} {v:,}" for k, v in measured.items()) + "."
        )
    return " ".join(parts)


def measured_bytes(folder: Path, rows: list[str]) -> dict[str, int]:
    """Row label -> the largest ``cache_bytes`` over its samples in the folder."""
    best: dict[str, int] = {}
    for path in Path(folder).glob("*__*__*.jsonl"):
        for record in SampleLog(path).records:
            if record.get("cache_bytes") is not None:
                label = record["label"]
                best[label] = max(best.get(label, 0), int(record["cache_bytes"]))
    return {row: best[row] for row in rows if row in best}


# --------------------------------------------------------------------------- running


def score_pending(
    folder: Path,
    rows: list[Row],
    jobs: list[tuple[str, str, list[dict]]],
    runner_factory: RunnerFactory,
    score: Callable[[str, dict], float],
    max_new_tokens: Callable[[str], int],
    desc: str,
) -> None:
    """Generate and score every sample not yet in the folder, appending each as it is scored.

    Parameters
    ----------
    folder : the output folder
    rows : the methods (or ablation variants) to run
    jobs : ``(task, length, samples)``; each sample has an ``id``, the runner's request fields
        (``context``/``question``/``answer_prefix`` or ``prompt``), ``answers`` and any extra
        fields to keep in the log
    runner_factory : ``(method, options) -> runner``; called once per row that has work
    score : ``(output, sample) -> score`` in 0-100
    max_new_tokens : task -> generation length
    desc : progress-bar label
    """
    from tqdm.auto import tqdm

    request_keys = ("id", "context", "question", "answer_prefix", "prompt", "watch")
    todo = []
    for row in rows:
        for task, length, samples in jobs:
            log = SampleLog(log_path(folder, row.label, task, length))
            done = log.done_ids
            pending = [s for s in samples if s["id"] not in done]
            if pending:
                todo.append((row, task, length, log, pending))
    total = sum(len(p) for *_, p in todo)
    if not total:
        return
    with tqdm(total=total, desc=desc, unit="sample") as bar:
        runner, runner_label = None, None
        for row, task, length, log, pending in todo:
            if runner_label != row.label:  # todo is grouped by row: one runner (and its cache) alive at a time
                runner, runner_label = None, row.label
                runner = runner_factory(row.method, dict(row.options))
            for sample in pending:
                request = {k: sample[k] for k in request_keys if k in sample}
                (result,) = runner.generate([request], max_new_tokens=max_new_tokens(task), do_sample=False)
                record = {k: v for k, v in sample.items() if k not in ("context", "question", "prompt")}
                record.update(
                    label=row.label,
                    method=row.method,
                    task=task,
                    length=length,
                    output=result["output"],
                    score=score(result["output"], sample),
                    **{
                        k: result.get(k)
                        for k in ("prompt_tokens", "cache_bytes", "prefill_seconds", "decode_seconds_per_token")
                    },
                )
                if "memory" in result:
                    record["memory"] = result["memory"]
                log.append(record)
                bar.update(1)


def finish(folder: Path, summary: dict, title: str, tables: list[str], print_fn=print) -> dict:
    """Write ``summary.json`` and ``table.md`` (the title and tables), print the tables, return the summary."""
    folder = Path(folder)
    write_summary(folder, summary)
    text = f"# {title}\n\n" + "\n".join(tables)
    (folder / "table.md").write_text(text)
    print_fn(text)
    return summary
