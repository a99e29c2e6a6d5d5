"""``armkv eval reads``: how much of the full read's attention a sparse read would skip.

At M < N_b, ARM reads the slots of each query's best buckets (or, with ``read_pages``, pages
of them) and renormalises its softmax over those: what the skipped slots would have drawn is
lost. This eval measures that share directly, on RULER needle samples, without generating:
each sample's context is prefilled through an ARM cache that reads every bucket, then its
question and its gold answer are fed one token at a time (decode steps, the answer
teacher-forced). At each step, in each layer, the full read's attention (one softmax per
query head over every slot, the exact entries and the token itself) is compared with the
slots that each setting's sparse read would take from the same state: M = N_b / ``--fraction``
buckets' worth of pages of 1 / ``page_split`` of the mean bucket (``read_pages``), ranked as
``read_rank`` ranks them (``partial``: the query's largest ``partial_share`` of key-code rows;
``best``: every key whole), or (``tree``) the M whole buckets the tree's read routing of the
pre-RoPE query reaches (the routers of the shipped adapter or of ``--adapter``). A query
head's missed mass is the share of its full attention on slots the setting skips. The slots
are unmixed (``slot_mixing=false``, as ``partial`` requires).

Beside the missed share it measures what the read outputs: each query head's attention output
against the full read's, |o - o_full| / |o_full|, for the sparse read as it is and with
``read_summaries`` (each page it skips joins its softmax as one entry, ``read.unit_summaries``).

The same samples, prompts and budget as ``armkv eval ruler`` with the same ``--seed``,
``--haystack``, ``--chat`` and lengths. A RULER cell's paired difference between two settings
has a standard error of 5-9 points over 20 samples; this share's mean moves by a fraction of a
point, so settings can be told apart here before RULER is run on them.

Output: one JSONL line per sample (``reads.jsonl``: per setting, the mean over layers, KV
heads' query heads and steps, its 90th percentile, the share of reads that miss more than 10%,
the share of occupied slots read, the mean per layer, and the output errors without and with
summaries, overall and per layer, and the bytes one layer reads for one token,
``armkv.evals.read_cost``; a re-run resumes), ``table.md``
and ``reads.png`` (missed mass per layer, one line per setting).

    armkv eval reads --tasks niah_multivalue --lengths 4k --haystack essay --haystack-file prose.txt \\
        --budget 4096 --samples 8 --page-split 1,2,4,8 --output reads
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from armkv.errors import ArmkvError
from armkv.evals import common

NEEDLE_TASKS = "niah_single_1,niah_multikey_1,niah_multivalue,niah_multiquery"
RANKS = ("partial", "best", "tree")


def add_arguments(parser) -> None:
    parser.add_argument(
        "--tasks", default=NEEDLE_TASKS, help="comma-separated RULER needle tasks (default: %(default)s)"
    )
    parser.add_argument("--lengths", default="4k", help="context lengths in tokens, e.g. 4k,8k (default: %(default)s)")
    parser.add_argument(
        "--haystack",
        choices=("noise", "essay"),
        default="noise",
        help="the needle tasks' haystack (essay needs --haystack-file)",
    )
    parser.add_argument(
        "--haystack-file", default=None, help="prose for the essay haystack: a .txt or RULER's PaulGrahamEssays.json"
    )
    parser.add_argument(
        "--fraction", type=int, default=8, help="the sparse reads' M = N_b / this (default: %(default)s)"
    )
    parser.add_argument(
        "--ranks", default="partial", help=f"bucket rankings to compare, of {', '.join(RANKS)} (default: %(default)s)"
    )
    parser.add_argument(
        "--page-split", default="1,4", help="pages per mean bucket to compare (page_split; default: %(default)s)"
    )
    parser.add_argument(
        "--partial-share",
        default="0.25",
        help="with partial: shares of the key-code rows to compare (default: %(default)s)",
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    common.add_common_arguments(parser, methods=None, samples=8)


def settings_from(args) -> list[dict]:
    """The settings compared: every rank x page_split (x partial_share for partial), checked."""
    ranks = common.parse_list(args.ranks, "ranks")
    unknown = [r for r in ranks if r not in RANKS]
    if unknown or not ranks:
        raise ArmkvError(f"--ranks {args.ranks!r}: choose from {', '.join(RANKS)}")
    try:
        splits = common.parse_list(args.page_split, "page-split", int)
        shares = common.parse_list(args.partial_share, "partial-share", float)
    except ValueError:
        raise ArmkvError(
            "--page-split takes whole numbers and --partial-share fractions, comma-separated, e.g. 1,4 and 0.25"
        ) from None
    if not splits or min(splits) < 1:
        raise ArmkvError(f"--page-split {args.page_split!r}: give pages per mean bucket of at least 1, e.g. 1,4")
    if not shares or not all(0 < s <= 1 for s in shares):
        raise ArmkvError(f"--partial-share {args.partial_share!r}: give shares in (0, 1], e.g. 0.125,0.25")
    out = []
    for rank in ranks:
        if rank == "tree":  # (the tree routes to whole buckets: no pages)
            out.append({"name": "tree", "rank": rank, "page_split": None, "partial_share": None})
            continue
        for split in splits:
            for share in shares if rank == "partial" else [None]:
                name = f"{rank}, pages/{split}" + (f", rows {share:g}" if share is not None else "")
                out.append({"name": name, "rank": rank, "page_split": split, "partial_share": share})
    return out


def _sparse_choices(
    layer, query, key, valid, scaling: float, exact_k, exact_valid, settings: list[dict], m: int, position=None
):
    """What :func:`missed_mass` and :func:`output_errors` share for one decode step of a layer
    that reads every bucket: the full read's logits over [slots | exact entries | the token]
    ([G, R, S + L + 1] float32) and, per setting, the slots its sparse read takes [G, S] with
    its units (the unit of each slot [G, S], their number). ``position`` [B, 1]: the token's
    position (the tree routes its pre-RoPE query)."""
    import torch

    from armkv.evals.read_cost import tree_taken
    from armkv.memory.read import paged_index, partial_row_count, partial_rows, slot_units, top_unit_slots

    index = layer.reader.bucket_index()  # (its first build may re-lay the pool: before the slots are read)
    st = layer.reader.readable()
    if st.mixed:
        raise ArmkvError("eval reads needs unmixed slots (arm.slot_mixing=false)")
    B, Hq, _, d = query.shape
    H = key.shape[1]
    G, R, S = B * H, Hq // H, st.slots
    q = query.reshape(G, R, d).float()
    bias = layer.reader.bias().reshape(G, 1, S).float()
    full = st.key_scores(q).float() * scaling + bias  # [G, R, S]
    exact = torch.matmul(q, exact_k.reshape(G, -1, d).float().transpose(1, 2)) * scaling
    exact = exact.masked_fill(~exact_valid.repeat_interleave(H, 0).unsqueeze(1), float("-inf"))
    own = (q * key.reshape(G, 1, d).float()).sum(-1, keepdim=True) * scaling
    own = own.masked_fill(~valid.repeat_interleave(H, 0).view(G, 1, 1), float("-inf"))
    num_buckets = layer.memory.router.num_buckets
    units, scores, chosen = {}, {}, {}
    for s in settings:
        if s["rank"] == "tree":
            if "tree" not in units:
                units["tree"] = (slot_units(index), num_buckets)
            unit = units["tree"][0]
            q_pre = layer.rotary.unrotate(query, position.unsqueeze(1))
            chosen[s["name"]] = (tree_taken(layer.memory.router, q_pre, unit, m), unit, num_buckets)
            continue
        split = s["page_split"]
        if split not in units:
            pages = paged_index(index, num_buckets * split)
            units[split] = (slot_units(pages), pages.size.shape[1])
        key_ = (s["rank"], s["partial_share"])
        if key_ not in scores:
            if s["rank"] == "best":
                scores[key_] = full.amax(1)
            else:
                rows = partial_rows(q, partial_row_count(s["partial_share"], d))
                scores[key_] = (st.partial_key_scores(q, rows).float() * scaling + bias).amax(1)
        unit, num_units = units[split]
        chosen[s["name"]] = (top_unit_slots(scores[key_], unit, num_units, m * split), unit, num_units)
    return torch.cat([full, exact, own], -1), chosen


def read_cost(layer, setting: dict, taken, head_dim: int, m: int) -> float:
    """Bytes the setting's read of one token reads from one layer (``read_cost.bytes_read``)."""
    from armkv.evals.read_cost import bytes_read
    from armkv.memory.read import partial_row_count

    rows = partial_row_count(setting["partial_share"], head_dim) if setting["rank"] == "partial" else 0
    return bytes_read(layer.reader.readable(), setting["rank"], taken, head_dim, layer.memory.router, m, rows)


def missed_mass(
    layer, query, key, valid, scaling: float, exact_k, exact_valid, settings: list[dict], m: int, choices=None
) -> dict:
    """For one decode step of one ARM layer that reads every bucket: per setting, each query
    head's share of the full read's attention on the slots the setting's sparse read skips,
    and the share of occupied slots it reads -> {name: (missed [B * Hq], read share)}.
    query [B, Hq, 1, d] post-RoPE; key [B, H, 1, d]; valid [B, 1]; exact_k [B, H, L, d];
    exact_valid [B, L]; ``choices``: :func:`_sparse_choices` of the same arguments, where the
    caller has it."""
    logits, chosen = choices or _sparse_choices(layer, query, key, valid, scaling, exact_k, exact_valid, settings, m)
    st = layer.reader.readable()
    S = st.slots
    p = logits.softmax(-1)[..., :S]
    occupied = (st.count.reshape(-1, S) > 0).sum().clamp_min(1)
    return {
        name: ((p * ~taken.unsqueeze(1)).sum(-1).flatten(), float(taken.sum() / occupied))
        for name, (taken, _, _) in chosen.items()
    }


def output_errors(
    layer,
    query,
    key,
    value,
    valid,
    scaling: float,
    exact_k,
    exact_v,
    exact_valid,
    settings: list[dict],
    m: int,
    choices=None,
) -> dict:
    """For the same step: per setting, each query head's attention output error against the
    full read's, |o - o_full| / |o_full|, of the sparse read as it is and of the sparse read
    with ``read_summaries`` (each skipped unit one entry, ``read.unit_summaries``) ->
    {name: (error [B * Hq], error with summaries [B * Hq])}. value [B, H, 1, d],
    exact_v [B, H, L, d], the rest as :func:`missed_mass`."""
    import torch

    from armkv.memory.read import unit_summaries, units_read

    logits, chosen = choices or _sparse_choices(layer, query, key, valid, scaling, exact_k, exact_valid, settings, m)
    st = layer.reader.readable()
    G, R, S, d = logits.shape[0], logits.shape[1], st.slots, query.shape[-1]
    slot_k, slot_v = (t.reshape(G, S, d).float() for t in st.kv(torch.float32, unmix=False))
    values = torch.cat([slot_v, exact_v.reshape(G, -1, d).float(), value.reshape(G, 1, d).float()], 1)
    full = logits.softmax(-1) @ values  # [G, R, d]
    q = query.reshape(G, R, d).float()
    bias = layer.reader.bias().reshape(G, S).float()
    norm = full.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
    out, built = {}, {}
    for name, (taken, unit, num_units) in chosen.items():
        sparse = logits.clone()
        sparse[..., :S].masked_fill_(~taken.unsqueeze(1), float("-inf"))
        plain = sparse.softmax(-1) @ values
        if id(unit) not in built:
            built[id(unit)] = unit_summaries(slot_k, slot_v, bias, unit.reshape(G, S), num_units)
        unit_k, unit_v, log_weight, at = built[id(unit)]
        skipped = (q @ unit_k.transpose(1, 2)) * scaling + log_weight.unsqueeze(1)  # [G, R, U]
        skipped = skipped.masked_fill(units_read(taken.unsqueeze(1), at, num_units), float("-inf"))
        summarised = torch.cat([sparse, skipped], -1).softmax(-1) @ torch.cat([values, unit_v], 1)
        out[name] = (
            ((plain - full).norm(dim=-1) / norm).flatten(),
            ((summarised - full).norm(dim=-1) / norm).flatten(),
        )
    return out


def measure_sample(
    model,
    tokenizer,
    sample: dict,
    budget: int,
    chunk: int,
    settings: list[dict],
    fraction: int,
    options: dict,
    chat: bool = False,
) -> dict:
    """One sample: its context prefilled, its question and gold answer fed a token at a time,
    each decode step of each layer measured (:func:`missed_mass`). Returns the sample's record."""
    import torch

    from armkv.hf.compat import cache_arg
    from armkv.hf.runner import Runner

    answer = tokenizer(" " + ", ".join(sample["answers"]), add_special_tokens=False)["input_ids"]
    runner = Runner(model, tokenizer, "arm", budget, chunk, chat=chat, **options)
    stages = runner.encode(sample)
    context, fed = stages[0], sum(stages[1:], []) + answer
    cache = runner.new_cache(horizon=len(context) + len(fed))
    layers = cache.layers
    taken = {s["name"]: [[] for _ in layers] for s in settings}
    errors = {s["name"]: ([[] for _ in layers], [[] for _ in layers]) for s in settings}
    shares = {s["name"]: [] for s in settings}
    costs = {s["name"]: [] for s in settings}  # bytes read, per layer and step
    m = None
    at = {}  # the decoded token's position

    def hook(i, read):
        layer = layers[i]

        def run(query, key, value, valid, scaling, exact_k, exact_v, exact_valid, fused=True):
            # (the full read's logits and each setting's slots, once for both measures)
            position = torch.full((query.shape[0], 1), at["position"], device=query.device)
            choices = _sparse_choices(layer, query, key, valid, scaling, exact_k, exact_valid, settings, m, position)
            for s in settings:
                costs[s["name"]].append(read_cost(layer, s, choices[1][s["name"]][0], query.shape[-1], m))
            for name, (missed, share) in missed_mass(
                layer, query, key, valid, scaling, exact_k, exact_valid, settings, m, choices
            ).items():
                taken[name][i].append(missed)
                shares[name].append(share)
            for name, pair in output_errors(
                layer, query, key, value, valid, scaling, exact_k, exact_v, exact_valid, settings, m, choices
            ).items():
                for kept, error in zip(errors[name], pair):
                    kept[i].append(error)
            return read(query, key, value, valid, scaling, exact_k, exact_v, exact_valid, fused)

        return run

    with torch.inference_mode(), contextlib.ExitStack() as hooks:
        ids = torch.tensor([context], device=model.device)
        model(
            input_ids=ids,
            position_ids=torch.arange(len(context), device=model.device)[None],
            **cache_arg(cache),
            use_cache=True,
        )
        num_buckets = layers[0].memory.router.num_buckets
        if not all(layer.reader.reads_all for layer in layers):
            raise ArmkvError("eval reads measures a cache that reads every bucket: drop the top_m / m_fixed options")
        m = max(1, num_buckets // fraction)
        for i, layer in enumerate(layers):  # (each dense read measured, then made)
            hooks.enter_context(layer.reader.hooks(dense=lambda read, i=i: hook(i, read)))
        for step, token in enumerate(fed):
            position = at["position"] = len(context) + step
            model(
                input_ids=torch.tensor([[token]], device=model.device),
                position_ids=torch.tensor([[position]], device=model.device),
                **cache_arg(cache),
                use_cache=True,
            )
    record = {
        "id": sample["id"],
        "task": sample["task"],
        "length": sample["length"],
        "tokens": len(context) + len(fed),
        "steps": len(fed),
        "m": m,
        "num_buckets": num_buckets,
        # occupied slots per KV head, mean over layers (against "tokens": how much merged)
        "slots": sum(
            float((layer.reader.readable().count > 0).sum()) / layer.reader.readable().groups for layer in layers
        )
        / len(layers),
        "missed": {},
    }
    for name, per_layer in taken.items():
        every = torch.cat([torch.cat(x) for x in per_layer])
        record["missed"][name] = {
            "mean": float(every.mean()),
            "p90": float(every.quantile(0.9)),
            "over_10pct": float((every > 0.1).float().mean()),
            "read_share": sum(shares[name]) / len(shares[name]),
            "per_layer": [float(torch.cat(x).mean()) for x in per_layer],
            "bytes_per_token": sum(costs[name]) / max(1, len(costs[name])),
        }
        for field, kept in zip(("error", "error_summaries"), errors[name]):
            record["missed"][name][field] = float(torch.cat([torch.cat(x) for x in kept]).mean())
            record["missed"][name][f"{field}_per_layer"] = [float(torch.cat(x).mean()) for x in kept]
    return record


def summarise(records: list[dict], settings: list[dict]) -> dict:
    """Means over samples: per setting, per task and length and over all, and per layer."""
    out = {}
    for s in settings:
        rows = [r["missed"][s["name"]] for r in records]
        cells: dict = {}
        for r in records:
            cells.setdefault(f"{r['task']} {common.length_label(str(r['length']))}", []).append(
                r["missed"][s["name"]]["mean"]
            )
        out[s["name"]] = {
            "mean": sum(x["mean"] for x in rows) / len(rows),
            "p90": sum(x["p90"] for x in rows) / len(rows),
            "over_10pct": sum(x["over_10pct"] for x in rows) / len(rows),
            "read_share": sum(x["read_share"] for x in rows) / len(rows),
            "bytes_per_token": sum(x.get("bytes_per_token", float("nan")) for x in rows) / len(rows),
            "cells": {k: sum(v) / len(v) for k, v in cells.items()},
            "per_layer": [sum(x["per_layer"][i] for x in rows) / len(rows) for i in range(len(rows[0]["per_layer"]))],
        }
        for field in ("error", "error_summaries"):  # (records written before these were measured have none)
            measured = [x for x in rows if field in x]
            if measured:
                out[s["name"]][field] = sum(x[field] for x in measured) / len(measured)
                out[s["name"]][f"{field}_per_layer"] = [
                    sum(x[f"{field}_per_layer"][i] for x in measured) / len(measured)
                    for i in range(len(measured[0][f"{field}_per_layer"]))
                ]
    return out


def markdown(summary: dict, caption: str) -> str:
    cells = list(next(iter(summary.values()))["cells"])
    lines = [
        "| setting | slots read | bytes/token | "
        + " | ".join(cells)
        + " | all | p90 | reads missing > 10% | output error | with summaries |",
        "|---|---:|---:|" + "---:|" * (len(cells) + 5),
    ]
    for name, row in summary.items():
        error = " | ".join(f"{row[f]:.3f}" if f in row else "-" for f in ("error", "error_summaries"))
        lines.append(
            f"| {name} | {100 * row['read_share']:.1f}% | {row.get('bytes_per_token', float('nan')):,.0f} | "
            + " | ".join(f"{100 * row['cells'][c]:.1f}%" for c in cells)
            + f" | {100 * row['mean']:.1f}% | {100 * row['p90']:.1f}% | {100 * row['over_10pct']:.1f}% | {error} |"
        )
    return caption + "\n\n" + "\n".join(lines) + "\n"


def plot(summary: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, row in summary.items():
        ax.plot(range(len(row["per_layer"])), [100 * v for v in row["per_layer"]], marker="o", markersize=3, label=name)
    ax.set_xlabel("layer")
    ax.set_ylabel("full read's attention skipped (%)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args) -> int:
    from tqdm.auto import tqdm

    from armkv.evals.ruler import RulerGenerator, chat_template_tokens, check_lengths, load_essay, parse_tasks
    from armkv.options import options_for

    settings = settings_from(args)
    tasks = parse_tasks(args.tasks)
    lengths = common.parse_list(args.lengths, "lengths", common.parse_length)
    if args.samples < 1:
        raise ArmkvError(f"--samples {args.samples}: give at least 1 sample per task and length")
    if args.fraction < 1:
        raise ArmkvError(f"--fraction {args.fraction}: give at least 1 (M = N_b / fraction)")
    if args.haystack == "essay" and not args.haystack_file:
        raise ArmkvError("--haystack essay needs --haystack-file (a .txt of prose)")
    options = options_for("arm", args.option, args.adapter)
    if {"top_m", "m_fixed", "slot_mixing", "read_pages", "page_split", "read_rank", "partial_share"} & set(options):
        raise ArmkvError(
            "eval reads sets how the cache reads (every bucket, unmixed slots): drop --option arm.top_m / m_fixed / "
            "slot_mixing / read_pages / page_split / read_rank / partial_share, and compare them with --ranks, "
            "--page-split, --partial-share"
        )
    options.update(slot_mixing=False)
    haystack = load_essay(args.haystack_file) if args.haystack_file else None
    unchecked = RulerGenerator(None, args.seed, haystack, haystack=args.haystack)
    for task in tasks:
        unchecked.check(task)
    check_lengths(lengths, None)
    output = Path(args.output)
    common.check_settings(
        output,
        {
            **common.settings_of(args, "reads"),
            "haystack": args.haystack,
            "fraction": args.fraction,
            "settings": [s["name"] for s in settings],
            "options": {"arm": options},
        },
    )
    model, tokenizer, info = common.load(args)
    check_lengths(lengths, info.max_positions)
    extra = (
        chat_template_tokens(tokenizer) if args.chat else 0
    )  # (counted in a sample's length, as eval ruler counts it)
    generator = RulerGenerator(tokenizer, args.seed, haystack, extra_tokens=extra, haystack=args.haystack)
    log = common.SampleLog(output / "reads.jsonl")
    todo = [
        s
        for task in tasks
        for length in lengths
        for s in generator.samples(task, length, args.samples)
        if s["id"] not in log.done_ids
    ]
    for sample in tqdm(todo, desc="eval reads", unit="sample"):
        log.append(
            measure_sample(
                model, tokenizer, sample, args.budget, args.chunk, settings, args.fraction, options, args.chat
            )
        )
    wanted = {f"{t}-{n}" for t in tasks for n in lengths}
    records = [r for r in log.records if f"{r['task']}-{r['length']}" in wanted]
    summary = summarise(records, settings)
    m, nb = records[0]["m"], records[0]["num_buckets"]
    caption = (
        f"Share of the full read's attention on the slots each sparse read skips (decode steps of the question and "
        f"the teacher-forced answer, mean over samples, layers, query heads and steps); M = {m} of {nb} buckets' worth "
        f"of pages; arm at budget {args.budget} ({info.budget_bytes(args.budget):,} bytes a layer), slots unmixed; "
        f"{len(records)} samples, {args.haystack} haystack. Output error: |o - o_full| / |o_full| of each query "
        f"head's attention output against the full read's, mean; with summaries: the same read with read_summaries "
        f"(each skipped page as one entry). Bytes/token: what one layer reads for one decoded token (mean over "
        f"layers; armkv.evals.read_cost); occupied slots per KV head (mean over layers and samples) "
        f"{sum(r.get('slots', 0) for r in records) / len(records):,.0f} for "
        f"{sum(r['tokens'] for r in records) / len(records):,.0f} tokens."
    )
    (output / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = "# Attention the sparse reads skip\n\n" + markdown(summary, caption)
    (output / "table.md").write_text(text)
    plot(summary, output / "reads.png", f"missed attention by layer, M = {m} of {nb}, budget {args.budget}")
    print(json.dumps(summary) if args.json else text)
    if not args.json:
        print(json.dumps({name: row["mean"] for name, row in summary.items()}))
    return 0
