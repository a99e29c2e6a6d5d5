"""``armkv report``: the results page, regenerated from a folder of JSON summaries.

    armkv report                      # docs/results/*.json -> docs/results.md, its plots, README's table

Reads, from ``--results`` (each file optional, at least one needed; every entry names the
command that produced it and the commit that added it):

- ``ruler.json``: the RULER needle matrix (``armkv eval matrix``'s cells, their ``sources``),
- ``ppl.json``: perplexity of the first N held-out tokens, one run per method and N,
- ``ppl_windows.json``: perplexity over consecutive windows of the held-out text,
- ``decode.json``: ``armkv bench decode``'s results,
- ``policy.json``: the learned top-M against fixed M (``armkv eval policy --fixed``'s curve.json
  under ``curve``, the fitted policy's M per layer under ``picked``).

Writes ``--output`` (markdown tables, the bar check of the matrix, the provenance of every
figure), the plots it links beside the JSON (``ruler.png``, ``ppl_windows.png``), and the
headline table between the ``<!-- results:start -->`` and ``<!-- results:end -->`` lines of
``--readme`` (left alone when the file has no such lines). Nothing is measured here.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from armkv.errors import ArmkvError

START, END = "<!-- results:start -->", "<!-- results:end -->"
SHORT = {"niah_single_1": "single", "niah_multikey_1": "mk1", "niah_multivalue": "mv", "niah_multiquery": "mq"}
FILES = ("ruler.json", "ppl.json", "ppl_windows.json", "decode.json", "policy.json")
ORDER = ["full", "arm", "kivi", "sink", "swa", "offload", "fifo"]


def add_arguments(parser) -> None:
    parser.add_argument(
        "--results", type=Path, default=Path("docs/results"), help="folder of JSON summaries (default: %(default)s)"
    )
    parser.add_argument(
        "--output", type=Path, default=Path("docs/results.md"), help="the page to write (default: %(default)s)"
    )
    parser.add_argument(
        "--readme",
        type=Path,
        default=Path("README.md"),
        help="file whose results markers receive the headline table (default: %(default)s)",
    )
    parser.add_argument("--no-plots", action="store_true", help="write the tables only (no matplotlib needed)")


def load(results: Path) -> dict:
    """{name: parsed JSON} of the summaries present in ``results``."""
    if not results.is_dir():
        raise ArmkvError(f"--results {results}: no such folder; run from the repository root or give the folder")
    data = {}
    for name in FILES:
        path = results / name
        if path.is_file():
            try:
                data[name.removesuffix(".json")] = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ArmkvError(f"{path}: not JSON ({e.msg} at line {e.lineno}); fix or remove the file") from None
    if not data:
        raise ArmkvError(f"--results {results}: none of {', '.join(FILES)} is there")
    return data


def _order(methods) -> list[str]:
    return sorted(methods, key=lambda m: (ORDER.index(m) if m in ORDER else len(ORDER), m))


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _provenance(entries: list[tuple[str, str, str | None]]) -> list[str]:
    """One line per distinct (command, commit): what produced which figures."""
    seen: dict[tuple[str, str | None], list[str]] = {}
    for what, command, commit in entries:
        seen.setdefault((command, commit), []).append(what)
    return [
        f"- {', '.join(whats)}: `{command}` at commit {commit or 'not recorded'}"
        for (command, commit), whats in seen.items()
    ]


# The RULER matrix's cells: {haystack: {method: {task@length: {score, n, ...}}}}, as
# `armkv eval matrix` writes them (it uses these helpers too).
def column_keys(rows: dict, tasks: list[str] | None = None) -> list[str]:
    """The (task@length) columns of one haystack, by length then task."""
    keys = sorted({k for r in rows.values() for k in r}, key=lambda k: (int(k.split("@")[1]), k))
    return [k for k in keys if k.split("@")[0] in tasks] if tasks else keys


def haystack_name(haystack: str) -> str:
    """RULER's "essay" haystack, filled here with the text of --haystack-file, is "prose"."""
    return "prose" if haystack == "essay" else haystack


def short_name(key: str) -> str:
    """``niah_multikey_1@8192`` -> ``mk1 8k``."""
    task, length = key.split("@")
    return f"{SHORT.get(task, task)} {int(length) // 1024}k"


def meets_bar(rows: dict, key: str, bar: str, bounded: list[str], within: float) -> bool:
    """Whether row ``bar`` is within ``within`` points of the full cache at ``key`` and above
    every other bounded row that has the cell."""
    cell = rows[bar][key]["score"]
    others = [rows[o][key]["score"] for o in bounded if o != bar and o in rows and key in rows[o]]
    return cell >= rows["full"][key]["score"] - within - 1e-9 and all(cell > o for o in others)


def source_cells(ruler: dict, source: str) -> str:
    """The cells of the matrix that one source run gave, e.g. ``noise arm: mk1 4k, mv 4k``
    (the provenance names cells, not the run folders the summary was made from)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for haystack, rows in ruler["cells"].items():
        for m in _order(rows):
            keys = [k for k in column_keys({m: rows[m]}) if rows[m][k].get("source") == source]
            if keys:
                groups.setdefault((haystack_name(haystack), m), []).extend(keys)
    return "; ".join(f"{h} {m}: {', '.join(short_name(k) for k in keys)}" for (h, m), keys in groups.items())


def ruler_section(ruler: dict) -> tuple[list[str], dict]:
    """The matrix per haystack, ARM checked against the bar; and per-method means for the headline."""
    within = float(ruler.get("within", 10.0))
    bounded = ruler.get("bounded") or [m for m in ORDER if m != "full"]
    lines = [
        "## RULER needle tasks",
        "",
        ruler.get("what", ""),
        "",
        f"**Bold**: ARM within {within:g} points of the full cache and above every other bounded method "
        "in that cell. Samples per cell in brackets where not 10."
        + (
            " The prose haystack is RULER's essay haystack filled with the held-out text "
            "(`--haystack essay --haystack-file heldout.txt`)."
            if "essay" in ruler["cells"]
            else ""
        ),
        "",
    ]
    means: dict = {}
    for haystack, rows in ruler["cells"].items():
        keys = column_keys(rows)
        methods = _order(rows)
        lines += [
            f"### {haystack_name(haystack).capitalize()} haystack",
            "",
            "| method | " + " | ".join(short_name(k) for k in keys) + " |",
            "|---|" + "---:|" * len(keys),
        ]
        met = 0
        for m in methods:
            out = []
            for k in keys:
                cell = rows[m].get(k)
                if cell is None:
                    out.append("-")
                    continue
                text = f"{cell['score']:.1f}".rstrip("0").rstrip(".") + ("" if cell["n"] == 10 else f" ({cell['n']})")
                if m == "arm" and "full" in rows and k in rows["full"] and meets_bar(rows, k, "arm", bounded, within):
                    text, met = f"**{text}**", met + 1
                out.append(text)
            lines.append(f"| {m} | " + " | ".join(out) + " |")
            full_keys = [k for k in keys if k in rows[m]]
            if len(full_keys) == len(keys):
                means.setdefault(m, {})[haystack] = sum(rows[m][k]["score"] for k in keys) / len(keys)
        if "arm" in rows and "full" in rows:
            both = [k for k in keys if k in rows["arm"] and k in rows["full"]]
            lines += ["", f"ARM meets the bar in {met} of {len(both)} cells."]
        lines.append("")
    return lines, means


def ppl_section(ppl: dict) -> tuple[list[str], dict]:
    runs = ppl["runs"]
    lengths = sorted({r["tokens"] for r in runs})
    by = {(r["method"], r["tokens"]): r for r in runs}
    methods = _order({r["method"] for r in runs})
    lines = [
        "## Perplexity on held-out text",
        "",
        ppl.get("what", ""),
        "",
        "| method | " + " | ".join(f"{n:,} tokens" for n in lengths) + " | cache bytes (largest) |",
        "|---|" + "---:|" * (len(lengths) + 1),
    ]
    for m in methods:
        out = []
        for n in lengths:
            r = by.get((m, n))
            if r is None:
                out.append("-")
                continue
            full = by.get(("full", n))
            over = f" ({100 * (r['ppl'] / full['ppl'] - 1):+.1f}%)" if full and m != "full" else ""
            out.append(f"{r['ppl']:.2f}{over}")
        size = max(r["cache_bytes"] for r in runs if r["method"] == m)
        lines.append(f"| {m} | " + " | ".join(out) + f" | {size:,} |")
    lines.append("")
    return lines, by


def _row_name(row: dict) -> str:
    opts = ", ".join(f"{k}={v}" for k, v in (row.get("options") or {}).items())
    return row["method"] + (f" ({opts})" if opts else "")


def windows_section(windows: dict) -> tuple[list[str], dict]:
    rows = windows["rows"]
    count = max(len(r["ppl"]) for r in rows)
    full = next((r for r in rows if r["method"] == "full" and not r.get("options")), None)
    full_gm = geometric_mean(full["ppl"]) if full else None
    lines = [
        "## Perplexity over every window of the held-out text",
        "",
        windows.get("what", ""),
        "",
        "| method | " + " | ".join(f"w{k}" for k in range(count)) + " | geometric mean | over full | cache bytes |",
        "|---|" + "---:|" * (count + 3),
    ]
    gms = {}
    for r in rows:
        gm = geometric_mean(r["ppl"])
        gms[_row_name(r)] = gm
        over = f"{100 * (gm / full_gm - 1):+.2f}%" if full_gm else "-"
        lines.append(
            f"| {_row_name(r)} | "
            + " | ".join(f"{p:.3f}" for p in r["ppl"])
            + f" | {gm:.3f} | {over} | {r['cache_bytes']:,} |"
        )
    lines.append("")
    return lines, gms


def decode_section(decode: dict) -> list[str]:
    res = decode["results"]
    lengths = sorted({int(n) for per in res["decode_ms_per_token"].values() for n in per})
    floor = res.get("floor_ms_per_token")
    lines = [
        "## Decode latency",
        "",
        decode.get("what", ""),
        "",
        f"Floor (the full cache with a 4-token context): {floor:.1f} ms/token." if floor else "",
        "",
        "| method | "
        + " | ".join(f"decode ms/token at {n:,} (x floor)" for n in lengths)
        + " | "
        + " | ".join(f"prefill tokens/s at {n:,}" for n in lengths)
        + " | cache bytes |",
        "|---|" + "---:|" * (2 * len(lengths) + 1),
    ]
    for m in _order(res["decode_ms_per_token"]):
        med = res["decode_ms_per_token"][m]
        cells = [
            f"{med[str(n)]:.1f}" + (f" ({med[str(n)] / floor:.2f}x)" if floor else "") if str(n) in med else "-"
            for n in lengths
        ]
        pre = res.get("prefill_tokens_per_s", {}).get(m, {})
        cells += [f"{pre[str(n)]:.0f}" if str(n) in pre else "-" for n in lengths]
        size = max(res.get("cache_bytes", {}).get(m, {"": 0}).values())
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {size:,} |")
    lines.append("")
    return lines


def curve_markdown(rows: list[dict], caption: str) -> str:
    lines = [
        caption,
        "",
        "| top-M | buckets read | perplexity | fixed M at the same cost | cache bytes |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        beside = "" if r.get("fixed_at_same_share") is None else f"{r['fixed_at_same_share']:.3f}"
        lines.append(
            f"| {r['label']} | {100 * r['read_share']:.1f}% | {r['ppl']:.3f} | {beside} | {r['cache_bytes']:,} |"
        )
    return "\n".join(lines) + "\n"


def plot_curve(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    fixed = sorted((r for r in rows if r["kind"] == "fixed"), key=lambda r: r["read_share"])
    ax.plot(
        [100 * r["read_share"] for r in fixed], [r["ppl"] for r in fixed], marker="o", label="fixed M (shipped adapter)"
    )
    for r in fixed:
        ax.annotate(
            r["label"].split("=")[-1],
            (100 * r["read_share"], r["ppl"]),
            textcoords="offset points",
            xytext=(4, 4),
            fontsize=8,
        )
    learned = [r for r in rows if r["kind"] == "learned"]
    ax.scatter(
        [100 * r["read_share"] for r in learned],
        [r["ppl"] for r in learned],
        marker="*",
        s=140,
        color="tab:red",
        label="policy's M",
        zorder=3,
    )
    for r in learned:
        ax.annotate(
            r["label"], (100 * r["read_share"], r["ppl"]), textcoords="offset points", xytext=(4, -10), fontsize=8
        )
    ax.set_xlabel("buckets read (% of N_b, mean over layers and windows)")
    ax.set_ylabel("perplexity (lower is better)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def policy_section(policy: dict) -> list[str]:
    """The learned top-M: the curve of perplexity against buckets read, and M per layer."""
    rows = policy["curve"]["rows"]
    lines = [
        "## Learned top-M against fixed M",
        "",
        policy.get("what", ""),
        "",
        curve_markdown(
            rows, "Perplexity against the share of buckets read (the policies' M is chosen per layer and input)."
        ),
    ]
    learned = [r for r in rows if r["kind"] == "learned" and r.get("fixed_at_same_share") is not None]
    if learned:
        better = sum(r["ppl"] < r["fixed_at_same_share"] for r in learned)
        lines += [
            f"The learned M is below the fixed-M curve (lower perplexity at the same read cost) at {better} of "
            f"{len(learned)} points.",
            "",
        ]
    picked = policy.get("picked")
    if picked:
        per = ", ".join(f"{row['mean']:.0f}" for row in picked["per_layer"])
        lines += [
            f"M picked per layer (mean over {picked['inputs']} windows of {picked['tokens']} tokens, "
            f"{picked['num_buckets']} buckets), policy `{picked['adapter']}` (the folder the command under "
            f"Provenance writes): {per}.",
            "",
        ]
    return lines


def headline(means: dict, ppl_by: dict, gms: dict) -> list[str]:
    """The README's table: per method, mean RULER score per haystack and held-out perplexity."""
    methods = _order(set(means) | {m for m, _ in ppl_by} | {n for n in gms if " " not in n})
    hays = sorted({h for per in means.values() for h in per})
    lengths = sorted({n for _, n in ppl_by})
    head = [f"RULER {haystack_name(h).split(' ')[0]} (mean)" for h in hays] + [f"ppl {n // 1024}k" for n in lengths]
    if gms:
        head.append("ppl, every 8k window (geo. mean)")
    lines = ["| method | " + " | ".join(head) + " |", "|---|" + "---:|" * len(head)]
    for m in methods:
        cells = [f"{means[m][h]:.1f}" if h in means.get(m, {}) else "-" for h in hays]
        cells += [f"{ppl_by[(m, n)]['ppl']:.2f}" if (m, n) in ppl_by else "-" for n in lengths]
        if gms:
            cells.append(f"{gms[m]:.2f}" if m in gms else "-")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines


def render(data: dict, plots: list[str]) -> tuple[str, str]:
    """(the results page, the headline table) from the loaded summaries."""
    page = [
        "# Results",
        "",
        "Generated by `armkv report` from the JSON summaries in `docs/results/`; edit those, not this page. "
        "Every figure names the command that produced it and the commit that added it to the repository "
        "(last section).",
        "",
    ]
    means, ppl_by, gms, prov = {}, {}, {}, []
    if "ruler" in data:
        lines, means = ruler_section(data["ruler"])
        page += lines
        if "ruler.png" in plots:
            page += ["![RULER scores against context length](results/ruler.png)", ""]
        for src, s in data["ruler"].get("sources", {}).items():
            cells = source_cells(data["ruler"], src)
            if cells:
                prov.append((f"RULER {cells}", s["command"], s.get("commit")))
    if "ppl" in data:
        lines, ppl_by = ppl_section(data["ppl"])
        page += lines
        prov += [(f"ppl {r['method']} {r['tokens']}", r["command"], r.get("commit")) for r in data["ppl"]["runs"]]
    if "ppl_windows" in data:
        lines, gms = windows_section(data["ppl_windows"])
        page += lines
        if "ppl_windows.png" in plots:
            page += ["![Perplexity per window](results/ppl_windows.png)", ""]
        prov += [(f"windows {_row_name(r)}", r["command"], r.get("commit")) for r in data["ppl_windows"]["rows"]]
    if "decode" in data:
        page += decode_section(data["decode"])
        prov.append(("decode latency", data["decode"]["command"], data["decode"].get("commit")))
    if "policy" in data:
        page += policy_section(data["policy"])
        if "policy_curve.png" in plots:
            page += ["![Perplexity against buckets read](results/policy_curve.png)", ""]
        prov.append(("learned top-M curve", data["policy"]["command"], data["policy"].get("commit")))
    table = headline(means, ppl_by, gms)
    page += ["## Provenance", ""] + _provenance(prov) + [""]
    return "\n".join(page), "\n".join(table)


def make_plots(data: dict, folder: Path) -> list[str]:
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise ArmkvError("the plots need matplotlib: pip install 'armkv[hf]', or pass --no-plots") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    if "ruler" in data:
        cells = data["ruler"]["cells"]
        fig, axes = plt.subplots(1, len(cells), figsize=(5 * len(cells), 3.6), squeeze=False)
        for ax, (haystack, rows) in zip(axes[0], cells.items()):
            for m in _order(rows):
                by_len: dict[int, list[float]] = {}
                for key, cell in rows[m].items():
                    by_len.setdefault(int(key.split("@")[1]), []).append(cell["score"])
                xs = sorted(by_len)
                ax.plot(xs, [sum(by_len[x]) / len(by_len[x]) for x in xs], marker="o", label=m)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{haystack_name(haystack)} haystack: mean over its needle tasks")
            ax.set_xlabel("context tokens")
            ax.set_ylabel("score")
            ax.legend(fontsize=8)
        made.append(_save(fig, folder / "ruler.png", plt))
    if "ppl_windows" in data:
        rows = data["ppl_windows"]["rows"]
        fig, ax = plt.subplots(figsize=(8, 3.6))
        for r in rows:
            ax.plot(range(len(r["ppl"])), r["ppl"], marker="o", label=_row_name(r))
        ax.set_xlabel("window")
        ax.set_ylabel("perplexity")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
        made.append(_save(fig, folder / "ppl_windows.png", plt))
    if "policy" in data:
        plot_curve(data["policy"]["curve"]["rows"], folder / "policy_curve.tmp.png", "learned top-M against fixed M")
        os.replace(folder / "policy_curve.tmp.png", folder / "policy_curve.png")
        made.append("policy_curve.png")
    return made


def _save(fig, path: Path, plt) -> str:
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.tight_layout()
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path.name


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def update_readme(readme: Path, table: str) -> bool:
    """Put ``table`` between the results markers of ``readme``; False when it has none."""
    if not readme.is_file():
        return False
    text = readme.read_text()
    if START not in text or END not in text:
        return False
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    _write(readme, f"{head}{START}\n{table}\n{END}{tail}")
    return True


def main(args) -> int:
    data = load(args.results)
    plots = [] if args.no_plots else make_plots(data, args.results)
    page, table = render(data, plots)
    # the page links its plots relative to where it is written
    rel = Path(os.path.relpath(args.results, args.output.parent)).as_posix()
    page = page.replace("](results/", f"]({rel}/")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    _write(args.output, page)
    readme = update_readme(args.readme, table)
    print(
        f"wrote {args.output}"
        + (f", {', '.join(plots)} in {args.results}" if plots else "")
        + (f", the table in {args.readme}" if readme else "")
    )
    return 0
