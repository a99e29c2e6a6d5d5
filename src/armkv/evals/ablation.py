"""The paper's Table 6 on our setup: what gated writes, the read policy's sparsity and our own rules buy.

Rows are ARM variants at the same budget, run through RULER's needle tasks with the same
protocol as ``armkv eval ruler``. The paper's rows are FIFO (slots overwritten oldest
first, every slot read), ARM with fixed sparsity M = N_b/2 and N_b/4 (the buckets ranked by
the tree's read routing, as the paper ranks them), and ARM with the policy's M (the shipped
policy reads every bucket); ours add M = N_b/8 with either ranking (``read_rank``), mean
writes, no empty-slot rule, no log-count bias, positions ``fixed`` instead of ``stored``, other slot formats and
ladders, eager merging, demotion to any bucket and even budget shares. Each row is
``(name, method, ARMConfig overrides)``: edit :data:`ROWS` to change the table.
"""

from __future__ import annotations

from armkv.config import buckets_of
from armkv.errors import ArmkvError
from armkv.evals import common, ruler

# (name, method, ARMConfig fields overridden at run time). ``m_fixed`` given as a fraction
# is a share of the adapter's N_b buckets, resolved once the adapter is known.
ROWS = [
    ("fifo", "fifo", {}),
    ("fixed-M-1/2", "arm", {"top_m": "fixed", "m_fixed": "1/2", "read_rank": "tree"}),
    ("fixed-M-1/4", "arm", {"top_m": "fixed", "m_fixed": "1/4", "read_rank": "tree"}),
    ("fixed-M-1/8", "arm", {"top_m": "fixed", "m_fixed": "1/8"}),
    ("tree-M-1/8", "arm", {"top_m": "fixed", "m_fixed": "1/8", "read_rank": "tree"}),
    ("policy-M", "arm", {"top_m": "adaptive"}),
    ("mean-writes", "arm", {"write": "mean"}),
    ("no-empty-slot-rule", "arm", {"empty_slot_rule": False}),
    ("no-log-count-bias", "arm", {"log_count_bias": False}),
    ("positions-fixed", "arm", {"position_mode": "fixed"}),
    ("positions-stored", "arm", {"position_mode": "stored"}),
    ("slots-model-dtype", "arm", {"slot_format": "model"}),
    ("slots-bfloat16", "arm", {"slot_format": "bfloat16"}),
    ("slots-int8", "arm", {"slot_format": "int8"}),
    ("slots-k8v4", "arm", {"slot_format": "k8v4"}),
    ("slots-k4v4", "arm", {"slot_format": "k4v4"}),
    ("slots-unmixed", "arm", {"slot_mixing": False}),
    ("no-ladder", "arm", {"slot_ladder": ""}),
    ("ladder-int8-k8v4", "arm", {"slot_ladder": "int8,k8v4"}),
    ("merge-eager", "arm", {"lazy_merge": False}),
    ("demote-any-bucket", "arm", {"demote_scope": "any"}),
    ("layers-even", "arm", {"layer_weights": "even"}),
]

# RULER's needle-in-a-haystack tasks; the ones on the essay haystack need --haystack-file.
NEEDLE_TASKS = [t for t, (gen, _) in ruler.TASKS.items() if gen == "niah"]


def resolve_rows(rows: list[tuple[str, str, dict]], num_buckets: int, options: dict[str, dict]) -> list[common.Row]:
    """Table rows with ``m_fixed`` fractions turned into bucket counts and the methods' ``--option`` values.

    Parameters
    ----------
    rows : ``(name, method, overrides)`` as in :data:`ROWS`
    num_buckets : N_b of the adapter the ARM rows run with
    options : ``{method: {key: value}}`` from ``--option``
    """
    out = []
    for name, method, overrides in rows:
        overrides = dict(overrides)
        if isinstance(overrides.get("m_fixed"), str):
            overrides["m_fixed"] = buckets_of(overrides["m_fixed"], num_buckets, "m_fixed")
        # every row is an ARM variant: the arm options (its adapter) apply to fifo too
        row_options = {**options.get("arm", {}), **options.get(method, {}), "arm_overrides": overrides}
        out.append(common.Row(name, method, row_options))
    return out


def describe(rows: list[common.Row]) -> str:
    """A markdown table of what each row changes."""
    lines = ["| Variant | Method | Overrides |", "|---|---|---|"]
    for row in rows:
        overrides = ", ".join(f"{k}={v}" for k, v in row.options["arm_overrides"].items()) or "-"
        lines.append(f"| {row.label} | {row.method} | {overrides} |")
    return "\n".join(lines) + "\n"


def num_buckets_of(info, budget: int, adapter) -> int:
    """N_b of the tree the ARM rows will use (the adapter's, or the random tree for this budget)."""
    from armkv.methods.adapters import resolve_arm

    arm_model, _ = resolve_arm(info, budget, adapter)
    return arm_model.config.num_buckets


def add_arguments(parser) -> None:
    parser.add_argument(
        "--rows",
        default=",".join(name for name, _, _ in ROWS),
        help="comma-separated variants (default: all: %(default)s)",
    )
    parser.add_argument(
        "--tasks",
        default=",".join(t for t in NEEDLE_TASKS if t in ruler.NO_FILE_TASKS),
        help="RULER needle tasks (default: those that need no data file: %(default)s)",
    )
    parser.add_argument("--lengths", default="4k", help="context lengths in tokens (default: %(default)s)")
    parser.add_argument(
        "--depths", default=None, help="needle depths in percent, cycled over samples (default: RULER's random depths)"
    )
    parser.add_argument("--haystack-file", default=None, help="essay haystack for the needle tasks on essays")
    parser.add_argument(
        "--max-new-tokens", type=int, default=None, help="cap on generated tokens (default: RULER's 128)"
    )
    parser.set_defaults(qa_file=None)
    common.add_common_arguments(parser, methods=None, samples=25)


def main(args) -> int:
    names = common.parse_list(args.rows, "rows")
    known = {name: (name, method, overrides) for name, method, overrides in ROWS}
    for name in names:
        if name not in known:
            raise ArmkvError(f"unknown ablation row {name!r}; choose from: {', '.join(known)}")
    tasks = ruler.parse_tasks(args.tasks)
    for task in tasks:
        if task not in NEEDLE_TASKS:
            raise ArmkvError(f"the ablation runs RULER's needle tasks; {task!r} is not one ({', '.join(NEEDLE_TASKS)})")
    options = common.method_options(args)
    settings = common.settings_of(
        args,
        "ablation",
        depths=common.parse_list(args.depths, "depths", float) or None,
        max_new_tokens=args.max_new_tokens,
    )
    generator, lengths, depths, info, model, tokenizer = ruler.prepare(args, tasks, settings)
    rows = resolve_rows(
        [known[name] for name in names],
        num_buckets_of(info, args.budget, options.get("arm", {}).get("adapter")),
        options,
    )
    ruler.evaluate(
        generator,
        rows,
        tasks,
        lengths,
        args.samples,
        args.output,
        common.runner_factory(
            model, tokenizer, budget=args.budget, chunk=args.chunk, chat=args.chat, compile=args.compile
        ),
        settings=settings,
        depths=depths,
        max_new_tokens=args.max_new_tokens,
        budget=args.budget,
        info=info,
        title="Ablation (the paper's Table 6)",
        notes="## Variants\n\n" + describe(rows),
    )
    return 0
