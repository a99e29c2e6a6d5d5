"""Where a decode step's time goes: ``torch.profiler`` over the decode steps of each cache
method on one model, counting the operators the step dispatches (those that call no other:
what a device runs as kernels; on any device), the kernels it runs and the launches the host
issues for them (on a GPU), and the time the device is busy against the step's wall time.

A step whose device is busy for a small share of its wall time is bound by the host (Python,
dispatch and kernel launches), not by the GPU; the count of kernels per step says how many
launches a fused or graph-captured step would save. Per method: a prompt of ``--prompt``
random tokens, ``--warmup`` untimed steps (a compiled step compiles and records there), then
``--steps`` steps timed with the device synchronised, then the same number profiled.

    python3 scripts/gpu_profile.py --model-config llama-3.1-8b --device cuda --dtype bfloat16
    python scripts/gpu_profile.py --dry-run      # a two-layer toy of the same shape on the CPU
    python3 scripts/gpu_profile.py --runs arm --budget 4096 --option arm.top_m=fixed --option arm.m_fixed=1/8 \
        --option arm.read_rank=partial --option arm.slot_mixing=false --option arm.read_pages=true   # sparse reads

Writes ``profile.md`` (per method: the figures, the top operators by device and by host
time, and for a compiled run torch's log of graph breaks, recompiles and CUDA-graph skips) and
``profile.json`` under ``--out`` (default ``out/gpu_profile`` under the working directory); the
last stdout line is a one-line JSON summary.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from armkv.bench.decode import DecodeBench, Session, build_bench_model  # noqa: E402
from armkv.hf.model import TOY_WIDTHS as DRY_SHAPE  # noqa: E402

# host calls that put work on the device: kernel launches, copies and graph replays
LAUNCHES = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaGraphLaunch",
    "cudaMemcpyAsync",
    "cudaMemsetAsync",
)
# operators that launch no kernel: views, allocations and metadata
NO_KERNEL = {
    f"aten::{n}"
    for n in (
        "empty",
        "empty_strided",
        "empty_like",
        "as_strided",
        "view",
        "_unsafe_view",
        "reshape",
        "slice",
        "select",
        "narrow",
        "transpose",
        "t",
        "permute",
        "expand",
        "unsqueeze",
        "squeeze",
        "alias",
        "detach",
        "lift_fresh",
        "resolve_conj",
        "resolve_neg",
        "unbind",
        "split",
        "chunk",
        "view_as_real",
        "_reshape_alias",
        "set_",
        "is_nonzero",
        "item",
        "_local_scalar_dense",
    )
}


def run_spec(name: str) -> tuple[str, bool]:
    """'arm-compiled' -> ('arm', True); 'full' -> ('full', False)."""
    from armkv.errors import ArmkvError
    from armkv.methods.base import get_method

    method, _, kind = name.partition("-")
    if kind not in ("", "compiled"):
        raise SystemExit(f"--runs {name}: write METHOD or METHOD-compiled")
    if method != "native":
        try:
            get_method(method)
        except ArmkvError as e:
            raise SystemExit(f"--runs {name}: {e}") from None
    return method, kind == "compiled"


class Lines(logging.Handler):
    """Keeps the messages of torch's compile logs (graph breaks, recompiles, CUDA-graph
    decisions and skips, inductor's performance hints) while a compiled run lasts."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.extend(f"{record.name}: {line}" for line in record.getMessage().splitlines()[:20])


def profile_run(model, name: str, a) -> tuple[dict, str]:
    method, compiled = run_spec(name)
    lines, loggers = Lines(), []
    if compiled:
        torch._logging.set_logs(perf_hints=True, recompiles=True, graph_breaks=True, cudagraphs=True)
        # beside torch's own log handlers, with their filter (the artifacts asked for)
        loggers = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict) if n.startswith("torch")]
        loggers = [g for g in loggers if g.handlers and not g.propagate]
        lines.filters = list(loggers[0].handlers[0].filters)
        for logger in loggers:
            logger.addHandler(lines)
    try:
        return _profile_run(model, name, method, compiled, a, lines)
    finally:
        for logger in loggers:
            logger.removeHandler(lines)
        if compiled:
            torch._logging.set_logs()


def _profile_run(model, name: str, method: str, compiled: bool, a, lines: Lines) -> tuple[dict, str]:
    from armkv.options import parse_options

    # (each run checks only its own method's options: another method's are not its to refuse)
    options = parse_options([p for p in a.option or () if p.partition(".")[0].strip() == method])
    bench = DecodeBench(
        methods=[method],
        lengths=[a.prompt],
        budget=a.budget,
        chunk=a.chunk,
        compile=compiled,
        clock="wall",
        repeats=a.steps,
        warmup=a.warmup,
        options=options,
    )
    session = Session(model, bench)
    horizon = a.prompt + a.warmup + 2 * a.steps + 1
    cache = session.cache(method, horizon=horizon)
    token, prefill_s = session.prefill(cache, a.prompt, chunk=session.prefill_chunk(method, a.prompt))
    start = a.prompt
    _, token = session.decode(cache, token, start, a.warmup)
    start += a.warmup
    times, token = session.decode(cache, token, start, a.steps)
    start += a.steps
    activities = [torch.profiler.ProfilerActivity.CPU]
    on_cuda = model.device.type == "cuda"
    if on_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        wall0 = time.perf_counter()
        session.decode(cache, token, start, a.steps)
        if on_cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - wall0
    events = prof.events()
    device_events = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    launches = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.name in LAUNCHES)
    busy_us = sum(e.time_range.elapsed_us() for e in device_events)
    # operators that call no other and move data: what a device runs as kernels, counted on any device
    leaves = sum(
        1
        for e in events
        if e.device_type == torch.autograd.DeviceType.CPU
        and e.name.startswith("aten::")
        and e.name not in NO_KERNEL
        and not any(c.name.startswith("aten::") for c in e.cpu_children)
    )
    record = {
        "method": method,
        "compiled": compiled,
        "prefill_s": round(prefill_s, 3),
        "decode_ms_median": round(1e3 * statistics.median(times), 3),
        "decode_ms_mean": round(1e3 * statistics.mean(times), 3),
        "profiled_ms_per_step": round(1e3 * wall / a.steps, 3),
        "leaf_ops_per_step": round(leaves / a.steps, 1),
        "device_kernels_per_step": round(len(device_events) / a.steps, 1),
        "host_launches_per_step": round(launches / a.steps, 1),
        "device_busy_ms_per_step": round(busy_us / 1e3 / a.steps, 3),
        "device_busy_share": round(busy_us / 1e6 / wall, 3) if wall > 0 else None,
    }
    sort = "self_cuda_time_total" if on_cuda else "self_cpu_time_total"
    averages = prof.key_averages()
    text = [f"## {name}", "", "| figure | value |", "|---|---:|"]
    text += [f"| {k} | {v} |" for k, v in record.items()]
    text += [
        "",
        f"Top operators by {sort} ({a.steps} steps)",
        "",
        "```",
        averages.table(sort_by=sort, row_limit=a.rows),
        "```",
    ]
    if compiled:
        record["compile_log_lines"] = len(lines.lines)
        text += [
            "",
            f"torch's compile log ({len(lines.lines)} lines; the last {a.rows * 4})",
            "",
            "```",
            *lines.lines[-a.rows * 4 :],
            "```",
        ]
    if on_cuda:
        text += [
            "",
            f"Top operators by self_cpu_time_total ({a.steps} steps)",
            "",
            "```",
            averages.table(sort_by="self_cpu_time_total", row_limit=a.rows),
            "```",
        ]
    del cache
    if on_cuda:
        torch.cuda.empty_cache()
    return record, "\n".join(text) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-config", default="llama-3.1-8b", help="a shipped shape or a config.json (random weights)")
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--budget", type=int, default=1024, help="token-equivalents of KV per layer (default 1024)")
    p.add_argument("--chunk", type=int, default=1024, help="prefill chunk P (default 1024)")
    p.add_argument("--prompt", type=int, default=4096, help="prompt tokens before the decode steps (default 4096)")
    p.add_argument("--warmup", type=int, default=6, help="untimed decode steps (default 6)")
    p.add_argument("--steps", type=int, default=32, help="timed, then profiled, decode steps (default 32)")
    p.add_argument(
        "--runs",
        default="native,full,arm,full-compiled,arm-compiled",
        help="comma-separated METHOD or METHOD-compiled (default native,full,arm,full-compiled,arm-compiled)",
    )
    p.add_argument("--rows", type=int, default=20, help="operators per table (default 20)")
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="METHOD.KEY=VALUE",
        help="a cache option of a run's method, as bench decode's --option (repeatable)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="a two-layer toy of the shape, float32 on the CPU, small sizes"
    )
    p.add_argument(
        "--out",
        default=str(Path("out") / "gpu_profile"),
        help="where profile.md and profile.json go (default: %(default)s, under the working directory)",
    )
    a = p.parse_args()
    runs = [r.strip() for r in a.runs.split(",") if r.strip()]
    for r in runs:
        run_spec(r)
    if a.dry_run:
        shape = json.loads((ROOT / "src/armkv/data/model_configs" / f"{a.model_config}.json").read_text())
        a.model_config = str(Path(tempfile.mkdtemp()) / "tiny.json")
        Path(a.model_config).write_text(json.dumps({**shape, **DRY_SHAPE}))
        a.device, a.dtype, a.budget, a.chunk, a.prompt, a.warmup, a.steps = "cpu", "float32", 64, 32, 200, 2, 4
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_bench_model(a.model_config, a.device, a.dtype)
    doc = {
        "settings": {k: v for k, v in vars(a).items() if k != "out"},
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if a.device == "cuda" else None,
        "runs": {},
    }
    texts = []
    for name in runs:
        try:
            with torch.inference_mode():  # as bench decode and generate run
                record, text = profile_run(model, name, a)
        except Exception as e:  # one run's failure keeps the others
            if os.environ.get("ARMKV_PROFILE_RAISE"):
                raise
            record, text = (
                {"error": f"{type(e).__name__}: {e}"[:2000]},
                f"## {name}\n\nfailed: {type(e).__name__}: {e}\n",
            )
        doc["runs"][name] = record
        texts.append(text)
        print(f"[{name}] {json.dumps(record)}", file=sys.stderr, flush=True)
        (out / "profile.json").write_text(json.dumps(doc, indent=1) + "\n")
        (out / "profile.md").write_text("\n".join(texts))
    print(json.dumps({"out": str(out), "runs": doc["runs"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
