"""The GPU benchmark in one call: ``armkv bench decode`` on Llama-3.1-8B's shape (random
weights, bf16, budget 1024, prefill chunk 1024) on one CUDA device, every run independent.

Runs (each its own process under its own time limit, so a crash, an out-of-memory or a
timeout loses that run alone; a run cut short keeps the points it measured, from its
results.partial.json), most wanted first:

  eager-METHOD     one method at contexts 4, 1k, 32k, 128k: decode ms/token, cache bytes,
                   prefill tokens/s (32k and 128k among them)
  compiled-METHOD  the same with ``--compile`` (native on transformers' StaticCache); the
                   unbounded native and full get random KV past 32k instead of a prefill
                   (their prefill is the eager runs')
  batchB-METHOD    decode tokens/s at batch 8 and 32 after 32k-token prompts, full against arm
                   at the same budget (full at batch 32 x 32k needs 137 GB of KV: its failure
                   is recorded, not fatal)
  sparse-READ      arm at budget 4096 after a 32k-token prompt on unmixed slots, reading every
                   bucket (READ = every) or the best pages of M = N_b / 8 (READ = pages): decode
                   ms/token and, timed apart, ARM's reads; smollm2-sparse-READ the same on the
                   default model's shape (smollm2-135m) after 16k tokens
  reads            one layer's attention read alone (``--read-timing``, no model): ARM's reads
                   through the Triton kernels (armkv.memory.triton) at budgets 1024 and 4096 (every
                   bucket on mixed and on unmixed slots; the best pages of M = N_b / 8 with their
                   summaries, ranked and read, and read alone) against SDPA's decode over a full
                   cache of 4k, 32k and 128k tokens, at batch 1, 8 and 32, launched from Python
                   and replayed as a CUDA graph; ratios within the run

in the order eager-arm, eager-full, compiled-native, compiled-full, compiled-arm, reads,
eager-native, batch8-arm, batch8-full, batch32-arm, batch32-full, eager-sink, compiled-sink,
sparse-every, sparse-pages, smollm2-sparse-every, smollm2-sparse-pages.
The whole plan may take longer than one device call (10 minutes): runs start while
``--budget-s`` lasts, the rest are listed as not run, and ``--only`` does them in a second call.

Everything comes back as three files under ``--out`` (default ``out/gpu_bench`` under the
working directory):
``gpu_bench.json`` (per run: the command, exit code, seconds, the result document or the
partial one, the end of its log; and the environment), ``gpu_bench.log`` (all logs) and
``tables.md`` (each run's tables). The last stdout line is a one-line JSON summary.

On the device machine, transformers must be in armkv's tested range (>=5.20,<5.25). Where
the installed one is not, a wheel under ``.whl/`` (carried with the tree) is installed with
``--no-deps`` into a private folder for the runs; make it here first with
``python scripts/gpu_bench.py --fetch-wheel`` (``.whl/`` must be git-ignored, e.g. listed in
``.git/info/exclude``), then run there with ``carry=[".whl"]``:

    python3 scripts/gpu_bench.py                      # everything, within --budget-s seconds
    python3 scripts/gpu_bench.py --only batch8-arm,batch32-arm
    python scripts/gpu_bench.py --dry-run             # the same plan on this CPU, tiny shape, seconds

``--dry-run`` keeps every step and option but runs a two-layer model of the same
architecture at toy widths and lengths in float32 on the CPU: a check of the plan, not a
measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRANSFORMERS_RANGE = ((5, 20), (5, 25))  # [low, high): armkv.hf.compat.SUPPORTED
WHEEL_VERSION = "5.23.0"  # what --fetch-wheel downloads

# name -> the bench decode arguments of that run (model, dtype, device and budget are added)
REAL = {
    "model_config": "llama-3.1-8b",
    "dtype": "bfloat16",
    "device": "cuda",
    "budget": "1024",
    "chunk": "1024",
    "repeats": "32",  # ARM's sync at budget 1024: the mean counts one write of every layer
    "warmup": "4",
    "lengths": "4,1k,32k,128k",
    "gen_lengths": "32",
    "batch_length": "32k",
    "batch_repeats": "8",
    "batches": (8, 32),
    "fill_past": "32768",  # compiled native and full: random KV instead of a prefill past this
    "sparse_budget": "4096",
    "sparse_length": "32k",
    "small_config": "smollm2-135m",  # the default model's shape
    "small_length": "16k",
    # the read-only timing (run "reads"): Llama-3.1-8B's attention shape (query heads, KV heads, head size)
    "read_shape": "32,8,128",
    "read_contexts": "4k,32k,128k",
    "read_batches": "1,8,32",
    "read_budgets": "1024,4096",
    "read_repeats": "50",
    "read_warmup": "4",
}
DRY = {
    "model_config": None,  # written at run time: llama-3.1-8b's architecture at toy widths
    "dtype": "float32",
    "device": "cpu",
    "budget": "64",
    "chunk": "32",
    "repeats": "3",
    "warmup": "1",
    "lengths": "4,96,160",
    "gen_lengths": "8",
    "batch_length": "96",
    "batch_repeats": "2",
    "batches": (2, 3),
    "fill_past": "96",
    "sparse_budget": "64",
    "sparse_length": "160",
    "small_config": None,  # the tiny shape
    "small_length": "96",
    "read_shape": "4,2,16",  # TOY_WIDTHS's heads and head_dim
    "read_contexts": "96,160",
    "read_batches": "1,2",
    "read_budgets": "32",
    "read_repeats": "1",
    "read_warmup": "0",
}
# seconds a run may take at most (the whole call also stops at --budget-s); ARM's prefill
# of 161k tokens at 1.3k-2k tokens/s is the longest; reads compiles its Triton kernels first
# (about 10 s each of the five on this project's CPU)
LIMITS = {"eager-arm": 240, "compiled-arm": 240, "batch32-arm": 240, "reads": 240}
DEFAULT_LIMIT = 150
DRY_LIMIT = 240


def plan(p: dict) -> list[tuple[str, list[str]]]:
    """[(run name, bench decode arguments)], in the order they run. The names are the same
    in a dry run (whose batches are smaller)."""

    def head(config: str, budget: str) -> list[str]:
        return [
            "--model-config",
            config,
            "--dtype",
            p["dtype"],
            "--device",
            p["device"],
            "--budget",
            budget,
            "--chunk",
            p["chunk"],
            "--warmup",
            p["warmup"],
            "--no-progress",
        ]

    common = head(p["model_config"], p["budget"])
    length = ["--lengths", p["lengths"], "--gen-lengths", p["gen_lengths"], "--repeats", p["repeats"]]
    fill = ["--max-full-length", p["fill_past"], "--beyond-full", "fill"]
    batch = ["--lengths", p["batch_length"], "--gen-lengths", p["gen_lengths"], "--repeats", p["batch_repeats"]]
    runs = {f"eager-{m}": common + length + ["--methods", m] for m in ("arm", "full", "native", "sink")}
    for m in ("native", "full", "arm", "sink"):
        runs[f"compiled-{m}"] = (
            common + length + ["--methods", m, "--compile"] + (fill if m in ("native", "full") else [])
        )
    for name_b, b in zip(REAL["batches"], p["batches"]):
        for m in ("arm", "full"):
            runs[f"batch{name_b}-{m}"] = common + batch + ["--methods", m, "--batch", str(b)]
    sparse = [
        "--gen-lengths",
        p["gen_lengths"],
        "--repeats",
        p["repeats"],
        "--methods",
        "arm",
        "--option",
        "arm.slot_mixing=false",
    ]
    for prefix, config, length in (
        ("", p["model_config"], p["sparse_length"]),
        ("smollm2-", p["small_config"] or p["model_config"], p["small_length"]),
    ):
        args = head(config, p["sparse_budget"]) + sparse + ["--lengths", length]
        runs[f"{prefix}sparse-every"] = args
        runs[f"{prefix}sparse-pages"] = args + SPARSE_PAGES
    runs["reads"] = [
        "--dtype",
        p["dtype"],
        "--device",
        p["device"],
        "--shape",
        p["read_shape"],
        "--contexts",
        p["read_contexts"],
        "--batches",
        p["read_batches"],
        "--budgets",
        p["read_budgets"],
        "--repeats",
        p["read_repeats"],
        "--warmup",
        p["read_warmup"],
    ]
    return [(name, runs[name]) for name in ORDER]


# ARM's read of the best pages of M = N_b / 8 buckets (partial ranking; unmixed slots)
SPARSE_PAGES = [
    "--option",
    "arm.top_m=fixed",
    "--option",
    "arm.m_fixed=1/8",
    "--option",
    "arm.read_rank=partial",
    "--option",
    "arm.read_pages=true",
]


ORDER = [
    "eager-arm",
    "eager-full",
    "compiled-native",
    "compiled-full",
    "compiled-arm",
    "reads",
    "eager-native",
    "batch8-arm",
    "batch8-full",
    "batch32-arm",
    "batch32-full",
    "eager-sink",
    "compiled-sink",
    "sparse-every",
    "sparse-pages",
    "smollm2-sparse-every",
    "smollm2-sparse-pages",
]


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(re.sub(r"\D.*", "", minor) or 0)


def in_range(version: str) -> bool:
    return TRANSFORMERS_RANGE[0] <= _version(version) < TRANSFORMERS_RANGE[1]


def installed_transformers(env: dict) -> str | None:
    out = subprocess.run(
        [sys.executable, "-c", "import transformers; print(transformers.__version__)"],
        env=env,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() if out.returncode == 0 else None


def prepare_env(log) -> tuple[dict, dict]:
    """The runs' environment: ``src`` on the path, the CPU-only fused kernels off (they would
    be compiled in every process and serve no CUDA tensor), and a transformers in the tested
    range, installed from ``.whl`` if the machine's is not. Returns (env, what was found)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env["ARMKV_KERNELS"] = "0"
    env["PYTHONUNBUFFERED"] = "1"
    info = {"transformers_found": installed_transformers(env)}
    if info["transformers_found"] and in_range(info["transformers_found"]):
        info["transformers"] = info["transformers_found"]
        return env, info
    wheels = sorted(p for p in (ROOT / ".whl").glob("transformers-*.whl") if in_range(p.name.split("-")[1]))
    if not wheels:
        info["transformers"] = None
        info["error"] = (
            f"transformers {info['transformers_found']} is outside >=5.20,<5.25 and no wheel is under "
            ".whl/: run `python scripts/gpu_bench.py --fetch-wheel` where pip works, carry .whl"
        )
        return env, info
    site = Path(tempfile.mkdtemp(prefix="armkv-site-"))
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--no-cache-dir",
        "--target",
        str(site),
        str(wheels[-1]),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    log(f"$ {' '.join(cmd)}\n{done.stdout}{done.stderr}")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    info["transformers"] = installed_transformers(env)
    info["wheel"] = wheels[-1].name
    if done.returncode != 0 or not info["transformers"] or not in_range(info["transformers"]):
        info["error"] = f"installing {wheels[-1].name} failed (exit {done.returncode})"
    return env, info


def environment(env: dict) -> dict:
    """GPU, driver, torch and CUDA versions, as the runs will see them."""
    code = (
        "import json, torch; c = torch.cuda.is_available(); print(json.dumps({'torch': torch.__version__, "
        "'cuda': torch.version.cuda, 'gpu': torch.cuda.get_device_name(0) if c else None, "
        "'gpu_memory_bytes': torch.cuda.get_device_properties(0).total_memory if c else None}))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    info = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {"error": out.stderr[-2000:]}
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        info["nvidia_smi"] = smi.stdout.strip()
    return info


WORKER_RUNS = ("reads",)  # runs of this script's own --read-timing, not of bench decode


def command(name: str, args: list[str]) -> str:
    """The command line a run records."""
    head = "python scripts/gpu_bench.py --read-timing " if name in WORKER_RUNS else "armkv bench decode "
    return head + " ".join(args)


def run_one(name: str, args: list[str], env: dict, limit: float, work: Path) -> tuple[dict, str]:
    """One ``armkv bench decode`` run under ``limit`` seconds. Returns (its record, its log)."""
    out = work / name
    if name in WORKER_RUNS:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--read-timing", *args, "--output", str(out)]
    else:
        cmd = [sys.executable, "-m", "armkv.cli", "bench", "decode", *args, "--output", str(out), "--json"]
    record = {"command": command(name, args), "limit_s": round(limit)}
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit, cwd=ROOT)
        record["exit_code"], text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        record["exit_code"] = "timeout"
        text = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
    record["seconds"] = round(time.monotonic() - start, 1)
    for kind, path in (("complete", out / "results.json"), ("partial", out / "results.partial.json")):
        if path.is_file():
            try:
                record["result"] = json.loads(path.read_text())
                record["result_kind"] = kind
                break
            except ValueError:
                pass
    if record["exit_code"] != 0:
        record["log_tail"] = text[-3000:]
    return record, text


def table(name: str, record: dict, out: Path) -> str:
    """A run's markdown tables (the table.md ``bench decode`` wrote), or why there are none."""
    head = f"## {name}\n\n`{record['command']}`: exit {record['exit_code']}, {record['seconds']} s"
    if (out / "table.md").is_file():
        return head + "\n\n" + (out / "table.md").read_text() + "\n"
    kind = record.get("result_kind", "no")
    return head + f", {kind} result (in gpu_bench.json)\n\n```\n" + record.get("log_tail", "")[-1500:] + "\n```\n"


# ---------------------------------------------------------------------- the read-only timing
def _counts(text: str) -> list[int]:
    """'4k,32k,128k' -> [4096, 32768, 131072]."""
    return [int(x.lower().removesuffix("k")) * (1024 if x.lower().endswith("k") else 1) for x in text.split(",") if x]


def read_cases(shape: tuple[int, int, int], budgets: list[int], batch: int, dtype, device) -> dict:
    """ARM's reads of one layer at each budget, bound as a decode step binds them: a full pool of
    ``ARMConfig.for_budget``'s slots (random keys and values, every slot occupied, filed under
    buckets of uneven size: a few hold several times the mean), laid bucket by bucket, with the
    sinks, window and waiting tokens as exact entries. Returns {name: (bound call, its token
    inputs)}: "arm-dense@B" (every bucket, mixed slots: the default), "arm-dense-unmixed@B" (the
    same pool unmixed), "arm-pages@B" (read_rank=partial over pages of M = N_b / 8 with their
    summaries: ranked and read) and "arm-pages-read@B" (the same pages read, the ranking given)."""
    import torch

    from armkv.config import ARMConfig
    from armkv.memory import triton as tk
    from armkv.memory.read import BucketIndex, bucket_index, index_summaries, paged_index, sort_by_bucket
    from armkv.memory.state import MemoryState

    Hq, H, d = shape
    G = batch * H
    g = torch.Generator(device="cpu").manual_seed(0)
    cases = {}
    for budget in budgets:
        c = ARMConfig.for_budget(budget, d, torch.finfo(dtype).bits // 8)
        S, nb, L = c.slots, c.num_buckets, c.sinks + c.window + c.sync
        st = MemoryState.empty(G, S, d)
        st.key.copy_(torch.randn(G, S, d, generator=g) * 2)
        st.value.copy_(torch.randn(G, S, d, generator=g))
        st.count.copy_(torch.randint(1, 5, (G, S), generator=g).float())
        st.bucket.copy_((torch.rand(G, S, generator=g) ** 2 * nb).long())  # (uneven: low ids fuller)
        st = st._map(lambda t: t.to(device))
        bias = torch.where(st.count > 0, st.count.log(), -torch.inf)
        token = (
            torch.randn(batch, Hq, 1, d, generator=g).to(device, dtype),
            torch.randn(batch, H, 1, d, generator=g).to(device, dtype),
            torch.randn(batch, H, 1, d, generator=g).to(device, dtype),
            torch.ones(batch, 1, dtype=torch.bool, device=device),
            torch.randn(batch, H, L, d, generator=g).to(device, dtype),
            torch.randn(batch, H, L, d, generator=g).to(device, dtype),
            torch.ones(batch, L, dtype=torch.bool, device=device),
            d**-0.5,
        )
        for mixed in (True, False):
            packed = st.pack(c.slot_format, mix=mixed)
            index = bucket_index(packed.bucket, packed.count > 0, nb, fused=False)
            packed = sort_by_bucket(packed, index)
            order = torch.arange(S, dtype=torch.int32, device=device).expand(G, S)  # (the identity, as a view)
            laid = BucketIndex(order=order, start=index.start, size=index.size, laid=True)
            mix = None
            if mixed:
                from armkv.memory.quant import mixing_matrix

                mix = mixing_matrix(d, torch.float32, device)
            codes = (packed.key, packed.key_scale, packed.value, packed.value_scale, bias)
            name = f"arm-dense@{budget}" if mixed else f"arm-dense-unmixed@{budget}"
            cases[name] = (tk.DecodeCall("dense", *codes, mix), token)
            if mixed:
                continue
            pages = paged_index(laid, nb * c.page_split)
            m = max(1, nb // 8) * c.page_split
            units = index_summaries(packed, bias, pages, fused=False)
            take = torch.full((G,), m, dtype=torch.long, device=device)
            where = dict(order=pages.kernel_order(), start=pages.start, size=pages.size, take=take)
            summaries = dict(zip(("unit_keys", "unit_values", "unit_log_weight"), units))
            n = max(1, round(c.partial_share * (d // 2)))
            ranked = tk.DecodeCall("partial", *codes, None, m=m, n=n, **where, **summaries)
            cases[f"arm-pages@{budget}"] = (ranked, token)
            chosen = ranked(*token)[1]  # (the pages it ranks first: the read alone reads the same)
            cases[f"arm-pages-read@{budget}"] = (
                tk.DecodeCall("sparse", *codes, None, buckets=chosen, **where, **summaries),
                token,
            )
    return cases


def _time_ms(fn, repeats: int, warmup: int, device) -> float:
    """Mean milliseconds of fn() launched from Python (CUDA: events around the loop)."""
    import torch

    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / repeats
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) * 1000 / repeats


def _graph_ms(fn, repeats: int, warmup: int, device) -> float | None:
    """Mean milliseconds of fn() captured once as a CUDA graph and replayed (the launches'
    cost gone: what a decode step captured whole pays); None off CUDA."""
    import torch

    if device.type != "cuda":
        return None
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _time_ms(graph.replay, repeats, warmup, device)


def read_timing(argv: list[str]) -> int:
    """``--read-timing``: one layer's read alone, ARM's (Triton) against SDPA's decode over a
    full cache; writes results.json (and results.partial.json as it goes) and table.md."""
    p = argparse.ArgumentParser(prog="gpu_bench.py --read-timing", description=read_timing.__doc__)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default=REAL["read_shape"], help="query heads, KV heads, head size")
    p.add_argument("--contexts", default=REAL["read_contexts"], help="the full cache's lengths for SDPA")
    p.add_argument("--batches", default=REAL["read_batches"])
    p.add_argument("--budgets", default=REAL["read_budgets"], help="ARM's budgets (token-equivalents a layer)")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--output", required=True)
    a = p.parse_args(argv)
    if a.device == "cpu":  # (the Triton kernels run on CPU tensors in triton's interpreter)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    import torch.nn.functional as F

    from armkv.memory import triton as tk

    out = Path(a.output)
    out.mkdir(parents=True, exist_ok=True)
    if not tk.available():
        print("read timing: triton is not installed (pip install 'armkv[gpu]')", file=sys.stderr)
        return 2
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    Hq, H, d = (int(x) for x in a.shape.split(","))
    contexts, budgets, batches = _counts(a.contexts), _counts(a.budgets), _counts(a.batches)
    doc = {
        "settings": vars(a) | {"shape": [Hq, H, d]},
        "kernels": tk.describe(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "read_ms": {},
        "graph_ms": {},
        "errors": {},
    }

    def save(name: str) -> None:
        tmp = out / (name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(out / name)

    total, done = len(batches) * (len(contexts) + 4 * len(budgets)), 0
    start = time.monotonic()
    for batch in batches:
        times, graphs = doc["read_ms"].setdefault(str(batch), {}), doc["graph_ms"].setdefault(str(batch), {})
        fns = {}
        for T in contexts:  # SDPA's decode over a full cache of T tokens (FlashAttention where it serves)
            q = torch.randn(batch, Hq, 1, d, device=device, dtype=dtype)
            k, v = (torch.randn(batch, H, T, d, device=device, dtype=dtype) for _ in range(2))
            fns[f"sdpa@{T}"] = lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        for name, (call, token) in read_cases((Hq, H, d), budgets, batch, dtype, device).items():
            fns[name] = lambda call=call, token=token: call(*token)
        for name, fn in fns.items():
            try:
                times[name] = round(_time_ms(fn, a.repeats, a.warmup, device), 4)
                graph = _graph_ms(fn, a.repeats, a.warmup, device)
                if graph is not None:
                    graphs[name] = round(graph, 4)
            except Exception as e:  # (an out-of-memory at batch 32 x 128k: recorded, the rest go on)
                doc["errors"][f"{name}@batch{batch}"] = (
                    f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                )
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            done += 1
            rate = done / max(time.monotonic() - start, 1e-9)
            print(
                f"[reads] {done}/{total} batch {batch} {name}: {times.get(name, 'failed')} ms, "
                f"ETA {(total - done) / rate:.0f} s",
                file=sys.stderr,
                flush=True,
            )
        del fns
        save("results.partial.json")
    doc["ratios"] = read_ratios(doc, contexts, budgets)
    save("results.json")
    (out / "table.md").write_text(read_table(doc))
    print(json.dumps({"read_ms": doc["read_ms"], "graph_ms": doc["graph_ms"], "ratios": doc["ratios"]}))
    return 0


def read_ratios(doc: dict, contexts: list[int], budgets: list[int]) -> dict:
    """Per batch and timing (launched, graph): SDPA's read at each context over ARM's dense
    read at each budget (how many times faster ARM's read is), and the dense read of the
    unmixed pool over its pages' read (ranked and read, and read alone) at each budget."""
    ratios = {}
    for kind in ("read_ms", "graph_ms"):
        for batch, t in doc[kind].items():
            r = ratios.setdefault(kind, {}).setdefault(batch, {})
            for b in budgets:
                for T in contexts:
                    if f"sdpa@{T}" in t and f"arm-dense@{b}" in t:
                        r[f"sdpa@{T} / arm-dense@{b}"] = round(t[f"sdpa@{T}"] / t[f"arm-dense@{b}"], 3)
                for sparse in ("arm-pages", "arm-pages-read"):
                    if f"arm-dense-unmixed@{b}" in t and f"{sparse}@{b}" in t:
                        r[f"arm-dense-unmixed@{b} / {sparse}@{b}"] = round(
                            t[f"arm-dense-unmixed@{b}"] / t[f"{sparse}@{b}"], 3
                        )
    return ratios


def read_table(doc: dict) -> str:
    """The read timing as markdown: ms per read of one layer, a row per read and a column per
    batch (launched from Python / replayed as a CUDA graph), then the ratios."""
    batches = list(doc["read_ms"])
    names = list(dict.fromkeys(n for t in doc["read_ms"].values() for n in t))
    s = doc["settings"]
    lines = [
        f"One layer's read, ms (shape {s['shape']}, {s['dtype']}, {doc['kernels']}; launched / CUDA graph)",
        "",
        "| read | " + " | ".join(f"batch {b}" for b in batches) + " |",
        "|---|" + "---|" * len(batches),
    ]
    for n in names:
        cells = []
        for b in batches:
            t, g = doc["read_ms"][b].get(n), doc["graph_ms"].get(b, {}).get(n)
            cells.append("failed" if t is None else f"{t:.4f}" + (f" / {g:.4f}" if g is not None else ""))
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    for kind, rows in doc.get("ratios", {}).items():
        lines += ["", f"Ratios ({'launched' if kind == 'read_ms' else 'CUDA graph'})", ""]
        for b, r in rows.items():
            lines += [f"- batch {b}: " + ", ".join(f"{k} = {v}" for k, v in r.items())]
    if doc["errors"]:
        lines += ["", "Errors: " + "; ".join(f"{k}: {v}" for k, v in doc["errors"].items())]
    return "\n".join(lines) + "\n"


def fetch_wheel() -> int:
    """Download the transformers wheel into .whl/ (here, where pip reaches the index)."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "-d",
        str(ROOT / ".whl"),
        f"transformers=={WHEEL_VERSION}",
    ]
    print("$", " ".join(cmd))
    return subprocess.run(cmd).returncode


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--read-timing":  # (a run's own process: see read_timing)
        return read_timing(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="the same plan on the CPU with a tiny shape, in seconds")
    p.add_argument("--only", default="", help="comma-separated run names to do (default: all)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=540.0,
        help="stop starting runs, and cut the one running, at this many seconds (default 540)",
    )
    p.add_argument(
        "--out",
        default=str(Path("out") / "gpu_bench"),
        help="where the three files go (default: %(default)s, under the working directory)",
    )
    p.add_argument(
        "--lengths",
        default="",
        help="prompt lengths of the length runs instead of the plan's (e.g. 4,32k: ARM's cache is full by then)",
    )
    p.add_argument(
        "--fetch-wheel", action="store_true", help=f"download transformers {WHEEL_VERSION} into .whl/ and stop"
    )
    a = p.parse_args()
    if a.fetch_wheel:
        return fetch_wheel()

    deadline = time.monotonic() + a.budget_s
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="armkv-gpu-bench-"))
    logs: list[str] = []

    def log(text: str) -> None:
        logs.append(text)
        print(text if len(text) < 400 else text[:400] + " ...", file=sys.stderr, flush=True)

    settings = dict(DRY if a.dry_run else REAL)
    if a.dry_run:
        shape = json.loads((ROOT / "src/armkv/data/model_configs/llama-3.1-8b.json").read_text())
        settings["model_config"] = str(work / "llama-3.1-8b-tiny.json")
        from armkv.hf.model import TOY_WIDTHS

        Path(settings["model_config"]).write_text(json.dumps({**shape, **TOY_WIDTHS}))
    if a.lengths:
        settings["lengths"] = a.lengths
    runs = plan(settings)
    names = [n for n, _ in runs]
    only = [n.strip() for n in a.only.split(",") if n.strip()]
    unknown = [n for n in only if n not in names]
    if unknown:
        print(f"--only {','.join(unknown)}: not among the runs ({', '.join(names)})", file=sys.stderr)
        return 2

    env, found = prepare_env(log)
    doc = {
        "settings": {k: v for k, v in settings.items()},
        "dry_run": a.dry_run,
        "transformers": found,
        "environment": environment(env),
        "runs": {},
    }
    tables = []
    for name, args in runs:
        if only and name not in only:
            continue
        left = deadline - time.monotonic()
        if "error" in found or left < 20:
            why = found.get("error") or f"--budget-s {a.budget_s:.0f} spent"
            doc["runs"][name] = {"command": command(name, args), "exit_code": "not run", "why": why}
            log(f"[{name}] not run: {why}")
            continue
        limit = min(DRY_LIMIT if a.dry_run else LIMITS.get(name, DEFAULT_LIMIT), left)
        log(f"[{name}] start, limit {limit:.0f} s")
        record, text = run_one(name, args, env, limit, work)
        logs.append(f"===== {name}: {record['command']}\n{text}")
        doc["runs"][name] = record
        tables.append(table(name, record, work / name))
        log(
            f"[{name}] exit {record['exit_code']} after {record['seconds']} s, {record.get('result_kind', 'no')} result"
        )
        (out / "gpu_bench.json").write_text(json.dumps(doc, indent=1) + "\n")  # what is done survives a kill

    (out / "gpu_bench.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "gpu_bench.log").write_text("\n".join(logs) + "\n")
    (out / "tables.md").write_text("\n".join(tables))
    shutil.rmtree(work, ignore_errors=True)
    summary = {
        name: {"exit_code": r["exit_code"], "seconds": r.get("seconds"), "result": r.get("result_kind")}
        for name, r in doc["runs"].items()
    }
    print(json.dumps({"out": str(out), "environment": doc["environment"], "runs": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
