"""``armkv bench ops``: the memory's kernels on one layer, against their naive references.

- scan: writing 8k tokens (chunks of P) into one layer's pool: the vectorised gate + scan
  against the per-token loop of the same recurrence (``armkv.memory.naive.naive_scan``),
  on the same write plans.
- read: time per query of the top-M read (route + slot mask + attention over the pool)
  as the tree grows from 256 to 16,384 buckets at fixed M: beam search costs D * M * C,
  not N_b, so it should stay flat.

The last stdout line is one JSON document.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from armkv.config import ARMConfig
from armkv.memory import naive
from armkv.memory.module import ARMMemory
from armkv.memory.read import bucket_slot_mask
from armkv.memory.write import gate_weights, plan_writes, scan_writes


def add_arguments(parser) -> None:
    parser.add_argument("--tokens", type=int, default=8192, help="tokens written for the scan timing")
    parser.add_argument("--chunk", type=int, default=256, help="P, tokens per chunk")
    parser.add_argument("--slots", type=int, default=433, help="pool size (433 = the budget-512 split for d=64)")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--buckets", default="256,1024,4096,16384", help="tree sizes for the read timing (powers of 4)")
    parser.add_argument("--m", type=int, default=16, help="fixed M for the read timing")
    parser.add_argument("--queries", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print only the JSON line")


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_scan(tokens: int, chunk: int, slots: int, kv_heads: int, head_dim: int) -> dict:
    torch.manual_seed(0)
    cfg = ARMConfig(depth=3, branching=4, slots=slots, chunk=chunk)
    mem = ARMMemory(cfg, kv_heads, head_dim).eval()
    # text-like keys: a few hundred recurring directions plus noise, so writes merge and fill
    centres = torch.randn(300, head_dim)
    state = mem.init_state(1, torch.float32, "cpu")
    fast = slow = plan_time = 0.0
    with torch.no_grad():
        for start in range(0, tokens, chunk):
            n = min(chunk, tokens - start)
            idx = torch.randint(0, 300, (kv_heads, n))
            keys = (centres[idx] + 0.3 * torch.randn(kv_heads, n, head_dim)).unsqueeze(0)
            values = torch.randn(1, kv_heads, n, head_dim)
            pos = torch.arange(start, start + n, dtype=torch.float32)
            G = kv_heads
            k, v = keys.reshape(G, n, head_dim), values.reshape(G, n, head_dim)
            p, valid = pos.expand(G, n), torch.ones(G, n, dtype=torch.bool)
            bucket = mem.router.route_writes(keys).reshape(G, n)
            t0 = time.perf_counter()
            plan, merged = plan_writes(state, k, bucket, valid, mem.writes)
            t1 = time.perf_counter()
            new = scan_writes(merged, plan, gate_weights(plan, k, mem.writes), k, v, p)
            t2 = time.perf_counter()
            naive.naive_scan(merged, plan, k, v, p, mem.writes)
            t3 = time.perf_counter()
            plan_time += t1 - t0
            fast += t2 - t1
            slow += t3 - t2
            state = new
    return {"scan_ms": 1e3 * fast, "naive_ms": 1e3 * slow, "plan_ms": 1e3 * plan_time, "scan_speedup": slow / fast}


def bench_read(buckets: list[int], m: int, slots: int, kv_heads: int, head_dim: int, queries: int, repeats: int) -> dict:
    torch.manual_seed(0)
    out = {}
    for nb in buckets:
        depth = round(torch.log(torch.tensor(float(nb))).item() / torch.log(torch.tensor(4.0)).item())
        if 4**depth != nb:
            raise SystemExit(f"--buckets: {nb} is not a power of 4")
        cfg = ARMConfig(depth=depth, branching=4, slots=slots, top_m="fixed", m_fixed=min(m, nb))
        mem = ARMMemory(cfg, kv_heads, head_dim).eval()
        rep = 3
        q = torch.randn(1, kv_heads * rep, queries, head_dim)
        slot_keys = torch.randn(1, kv_heads, slots, head_dim)
        slot_vals = torch.randn(1, kv_heads, slots, head_dim)
        slot_bucket = torch.randint(0, nb, (1, kv_heads * rep, slots))
        mm = torch.full((1,), min(m, nb), dtype=torch.long)

        def read():
            with torch.no_grad():
                b = mem.route_queries(q, min(m, nb))
                mask = bucket_slot_mask(b, mm, slot_bucket, nb)
                logits = (q.view(1, kv_heads, rep * queries, head_dim) @ slot_keys.transpose(-1, -2)).view(
                    1, kv_heads * rep, queries, slots
                )
                p = torch.softmax(logits.masked_fill(~mask, -1e9), -1).view(1, kv_heads, rep * queries, slots)
                return p @ slot_vals

        out[str(nb)] = 1e6 * _time(read, repeats) / (queries * kv_heads * rep)
    return out


def main(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr))
    log(f"threads: {torch.get_num_threads()}")
    scan = bench_scan(args.tokens, args.chunk, args.slots, args.kv_heads, args.head_dim)
    log(
        f"scan of {args.tokens} tokens (chunks of {args.chunk}, {args.slots} slots, {args.kv_heads} KV heads): "
        f"{scan['scan_ms']:.1f} ms vs naive loop {scan['naive_ms']:.1f} ms = {scan['scan_speedup']:.1f}x "
        f"(write planning {scan['plan_ms']:.1f} ms more)"
    )
    buckets = [int(b) for b in args.buckets.split(",")]
    read = bench_read(buckets, args.m, args.slots, args.kv_heads, args.head_dim, args.queries, args.repeats)
    log("| buckets | read us/query (M = %d) |\n|---:|---:|" % args.m)
    for nb, us in read.items():
        log(f"| {nb} | {us:.2f} |")
    result = {**scan, "read_us_per_query": read, "m": args.m, "threads": torch.get_num_threads()}
    print(json.dumps(result))
    return 0
