"""``armkv bench ops``: the memory's kernels on one layer, against their naive references.

- scan: 8k tokens' writes into one layer's pool: the vectorised gate + scan against the
  per-token loop of the same recurrence (``armkv.memory.naive.naive_scan``) on the same
  writes; and the whole write path (route, plan, gate, scan) per chunk of P.
- read: time per query of the top-M read (route + slot mask + attention over the pool)
  as the tree grows from 256 to 16,384 buckets at fixed M: beam search costs D * M * C,
  not N_b, so it should stay flat.
- int4 read: the decode step's read of one layer's k4v4 slots (key scores, then the
  weighted values) by the fused CPU kernel (``armkv.memory.kernels``) against the PyTorch
  ops it replaces, at each ``--int4-slots`` pool size, with the largest difference.
- sparse read: one layer's read at M = N_b / ``--sparse-fraction`` on the default model's shape
  (3 KV heads of 3 query heads, d = 64, the shipped adapter's 64-bucket tree, k4v4 slots, a
  full pool of each ``--sparse-budgets`` budget), for each bucket ranking of ``--sparse-ranks``
  (``read_rank``): the layer's read of the top-M buckets' slots (``Reader.read``: ranking
  included; for one query on a CPU fused calls of ``armkv.memory.kernels``; for a chunk the
  gathered PyTorch read, or with ``best`` and ``partial`` the ranked read that reuses its
  logits; ``partial`` on unmixed slots, as it requires; a ranking with ``-pages``, e.g.
  ``partial-pages``, takes pages of the buckets instead of whole ones, ``read_pages``, of
  1 / ``--page-split`` of the mean bucket; one ending in ``-summaries``, e.g.
  ``partial-pages-summaries``, reads each skipped unit as one entry, ``read_summaries``, whose
  entries a write makes once: their build is timed apart) against
  the dense read of every slot (the decode step's
  ``Reader.dense``) and the masked read of the whole pool at the same M
  (``Reader.masked``, the sparse read's reference), for one query and for chunks of
  ``--sparse-queries``; with the largest difference from the masked read. The three reads
  are timed side by side, their calls interleaved (at least 30 rounds), so that their ratios
  hold on a shared machine.
- chunk read: one prefill chunk's attention over a state of each ``--int4-slots`` size and
  itself (``joint_attention``): the split form (two flash attentions merged by their
  log-sum-exps) against one SDPA call over [state | chunk] with the full float mask.

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
from armkv.memory.read import bucket_index, bucket_slot_mask, index_summaries, slots_of_buckets
from armkv.memory.write import gate_weights, scan_writes


def add_arguments(parser) -> None:
    parser.add_argument("--tokens", type=int, default=8192, help="tokens written for the scan timing")
    parser.add_argument("--chunk", type=int, default=256, help="P, tokens per chunk")
    parser.add_argument("--slots", type=int, default=433, help="pool size (433 = the budget-512 split for d=64)")
    parser.add_argument("--kv-heads", type=int, default=3, help="KV heads of the memory")
    parser.add_argument("--head-dim", type=int, default=64, help="head dimension d")
    parser.add_argument("--buckets", default="256,1024,4096,16384", help="tree sizes for the read timing (powers of 4)")
    parser.add_argument("--m", type=int, default=16, help="fixed M for the read timing")
    parser.add_argument("--queries", type=int, default=64, help="queries per read")
    parser.add_argument(
        "--int4-slots",
        default="2706,8295",
        help="pool sizes for the int4 read timing (2706: budget 512, d = 64; 8295: the largest calibrated share)",
    )
    parser.add_argument(
        "--sparse-budgets", default="2048,4096,8192", help="budgets for the sparse read timing (full pools)"
    )
    parser.add_argument(
        "--sparse-ranks",
        default="best,partial,tree,partial-pages,partial-pages-summaries",
        help="bucket rankings (read_rank; with -pages: read_pages; then -summaries: read_summaries) for "
        "the sparse read timing",
    )
    parser.add_argument("--sparse-fraction", type=int, default=8, help="the sparse read's M = N_b / this")
    parser.add_argument(
        "--page-split",
        type=int,
        default=ARMConfig.page_split,
        help="pages per mean bucket for the -pages rankings (page_split)",
    )
    parser.add_argument("--sparse-queries", default="1,16,64", help="tokens per read for the sparse read timing")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per point")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument(
        "--clock",
        choices=tuple(CLOCK),
        default="wall",
        help="wall time, or the process's CPU time (steadier on a shared machine; with --threads 1)",
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON line")


CLOCK = {"wall": time.perf_counter, "process": time.process_time}
_clock = time.perf_counter


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = _clock()
        fn()
        times.append(_clock() - t0)
    return statistics.median(times)


def _time_side_by_side(fns: dict, repeats: int) -> dict:
    """Median seconds per call of each of ``fns`` (name -> callable), their calls interleaved
    round by round, so that a slow stretch of a shared machine weighs on each alike and
    their ratios hold where timing one after the other would not."""
    for fn in fns.values():
        fn()  # warm-up
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = _clock()
            fn()
            times[name].append(_clock() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def _synthetic_plan(tokens: int, slots: int, kv_heads: int, head_dim: int) -> tuple:
    """One chunk of ``tokens`` writes spread over a pool, as the planner would hand them to
    the scan: a target slot per token, the slot's count before the write (its rank among
    the chunk's writes to it, on top of what it held), and the key the gate compares with."""
    from armkv.memory.state import MemoryState
    from armkv.memory.write import WritePlan, _exclusive_rank

    G, N, d = kv_heads, tokens, head_dim
    state = MemoryState.empty(G, slots, d)
    state.key.normal_()
    state.value.normal_()
    state.count[:, : slots // 2] = 1.0  # half the pool in use, half free
    target = torch.randint(0, slots, (G, N))
    count = state.count.gather(1, target) + _exclusive_rank(target, torch.ones(G, N, dtype=torch.bool), slots)
    plan = WritePlan(
        target=target, alpha=torch.ones(G, N), cand=torch.randn(G, N, d), count=count.float(), bucket=state.bucket
    )
    keys, values = torch.randn(G, N, d), torch.randn(G, N, d)
    positions = torch.arange(N, dtype=torch.float32).expand(G, N)
    return state, plan, keys, values, positions


def bench_scan(tokens: int, chunk: int, slots: int, kv_heads: int, head_dim: int) -> dict:
    """The scan kernel against the per-token loop on the same writes (``tokens`` of one layer
    in one sync), and the whole write path (route, plan, gate, scan) per chunk of P."""
    torch.manual_seed(0)
    cfg = ARMConfig(depth=3, branching=4, slots=slots, chunk=chunk)
    mem = ARMMemory(cfg, kv_heads, head_dim).eval()
    with torch.no_grad():
        state, plan, k, v, p = _synthetic_plan(tokens, slots, kv_heads, head_dim)
        fast = _time(lambda: scan_writes(state, plan, gate_weights(plan, k, mem.writes), k, v, p), 3)
        t0 = time.perf_counter()
        naive.naive_scan(state, plan, k, v, p, mem.writes)
        slow = time.perf_counter() - t0

        # the whole write path on text-like keys: a few hundred recurring directions plus noise
        centres = torch.randn(300, head_dim)
        st = mem.init_state(1, torch.float32, "cpu")
        chunks = []
        for start in range(0, tokens, chunk):
            idx = torch.randint(0, 300, (kv_heads, chunk))
            keys = (centres[idx] + 0.3 * torch.randn(kv_heads, chunk, head_dim)).unsqueeze(0)
            t0 = time.perf_counter()
            st = mem.write(
                st,
                keys,
                torch.randn_like(keys),
                torch.arange(start, start + chunk)[None],
                torch.ones(1, chunk, dtype=torch.bool),
            )
            chunks.append(time.perf_counter() - t0)
    return {
        "scan_ms": 1e3 * fast,
        "naive_ms": 1e3 * slow,
        "scan_speedup": slow / fast,
        "write_ms_per_chunk": 1e3 * statistics.median(chunks),
        "write_tokens_per_s": chunk / statistics.median(chunks),
    }


def bench_read(
    buckets: list[int], m: int, slots: int, kv_heads: int, head_dim: int, queries: int, repeats: int
) -> dict:
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


def bench_int4_read(slots: list[int], kv_heads: int, head_dim: int, repeats: int, rep: int = 3) -> dict:
    """One decode step's slot read of one layer (keys against a query per head, then the
    values under softmax weights), fused kernel against PyTorch ops: microseconds per layer."""
    from armkv.memory.kernels import int4_read
    from armkv.memory.state import MemoryState

    if int4_read() is None:
        return {}
    out = {}
    for n in slots:
        g = torch.Generator().manual_seed(n)
        st = MemoryState.empty(kv_heads, n, head_dim)
        st.key.copy_(torch.randn(kv_heads, n, head_dim, generator=g))
        st.value.copy_(torch.randn(kv_heads, n, head_dim, generator=g))
        st.count.fill_(1)
        st = st.pack("k4v4", mix=True)
        q = torch.randn(kv_heads, rep, head_dim, generator=g)
        w = torch.softmax(torch.randn(kv_heads, rep, n, generator=g), -1)

        def read(fused: bool):
            return st.key_scores(q, fused=fused), st.weighted_values(w, fused=fused)

        with torch.no_grad():
            diff = max((a - b).abs().max().item() for a, b in zip(read(True), read(False)))
            fused = _time(lambda: read(True), max(repeats, 20))
            eager = _time(lambda: read(False), max(repeats, 20))
        out[str(n)] = {
            "fused_us": 1e6 * fused,
            "pytorch_us": 1e6 * eager,
            "speedup": eager / fused,
            "max_abs_diff": diff,
        }
    return out


def _ranking(spec: str) -> tuple[str, bool, bool]:
    """A ``--sparse-ranks`` entry -> (read_rank, read_pages, read_summaries): "partial-pages-summaries"
    -> ("partial", True, True)."""
    summaries = spec.endswith("-summaries")
    spec = spec.removesuffix("-summaries")
    return spec.removesuffix("-pages"), spec.endswith("-pages"), summaries


def _full_arm_layer(
    budget: int, fraction: int, seed: int = 0, read_rank: str = "best", page_split: int = ARMConfig.page_split
):
    """Layer 0 of the arm cache on the default model's shape at ``budget`` (even shares),
    its pool full of slots: keys drawn near the tree's leaf centroids plus noise, each filed
    where the tree routes it (unevenly, as on text: some buckets empty, the largest four times
    the mean). ``read_rank`` may end in ``-pages`` (``read_pages``, ``page_split``), then in
    ``-summaries`` (``read_summaries``)."""
    from armkv.memory.rope import Rotary
    from armkv.memory.state import MemoryState
    from armkv.methods.arm import make_arm
    from armkv.methods.base import ModelInfo

    info = ModelInfo(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_positions=8192)
    rotary = Rotary(1.0 / 100000 ** (torch.arange(0, 64, 2).float() / 64))
    probe = make_arm(0, info, rotary, budget, 256, layer_weights="even")
    nb = probe.memory.router.num_buckets
    rank, pages, summaries = _ranking(read_rank)
    layer = make_arm(
        0,
        info,
        rotary,
        budget,
        256,
        layer_weights="even",
        top_m="fixed",
        m_fixed=max(1, nb // fraction),
        read_rank=rank,
        slot_mixing=rank != "partial",
        read_pages=pages,
        page_split=page_split,
        read_summaries=summaries,
    )
    g = torch.Generator().manual_seed(seed)
    H, d = info.num_kv_heads, info.head_dim
    with torch.no_grad():
        layer.begin(torch.zeros(1, H, 1, d), torch.ones(1, 1, dtype=torch.bool))  # (the state allocated, M decided)
        pool = layer.pool
        pool.rung = len(pool.rungs) - 1
        S = pool.rungs[-1][1]
        router = layer.memory.router
        leaves = router.weight[:, router.num_nodes - nb // router.branching :].reshape(
            H, nb, d
        )  # the last level's rows
        pick = torch.randint(0, nb, (H, S), generator=g)
        keys = leaves.gather(1, pick.unsqueeze(-1).expand(H, S, d))
        keys = keys + 0.3 * keys.norm(dim=-1, keepdim=True) / d**0.5 * torch.randn(H, S, d, generator=g)
        state = MemoryState(
            key=keys,
            value=torch.randn(H, S, d, generator=g),
            pos=torch.arange(S).float().expand(H, S).clone(),
            count=torch.ones(H, S),
            bucket=router.route_writes(keys.unsqueeze(0))[0],
        )
        pool.state = pool.stored(state)
        pool.reach = S
    return layer, info


def bench_sparse_read(
    budgets: list[int],
    fraction: int,
    queries: list[int],
    repeats: int,
    ranks: tuple[str, ...] = ("best", "partial", "tree"),
    page_split: int = ARMConfig.page_split,
) -> dict:
    """Per budget and bucket ranking (``read_rank``): microseconds per layer of the layer's read
    at M = N_b / fraction, the dense read of every slot (one query) and the masked read at M,
    and the share of the pool gathered."""
    out = {}
    for budget, rank in [(b, r) for b in budgets for r in ranks]:
        layer, info = _full_arm_layer(budget, fraction, read_rank=rank, page_split=page_split)
        H, Hq, d = info.num_kv_heads, info.num_heads, info.head_dim
        g = torch.Generator().manual_seed(budget)
        reader = layer.reader
        exact = layer.exact()
        st, nb, M = reader.readable(), layer.memory.router.num_buckets, reader.route_k
        t0 = time.perf_counter()
        bucket_index(st.bucket, st.count > 0, nb)
        build = time.perf_counter() - t0
        t0 = time.perf_counter()
        # the synthetic pool lies in random order: re-laid by bucket here (read_pages: then cut into pages)
        index = reader.units_index()
        relay = time.perf_counter() - t0
        width = index.width(reader.units(M))
        row = {
            "slots": layer.state.slots,
            "buckets": nb,
            "m": M,
            "fixed_width": width,
            "fixed_width_share": width / layer.state.slots,
            "index_build_ms": 1e3 * build,
            "index_and_relay_ms": 1e3 * relay,
        }
        if (
            layer.config.read_summaries
        ):  # the units' entries, made once a write (read.index_summaries): the median of 5 builds
            bias = reader.bias().reshape(-1, reader.readable().slots)
            row["summaries_build_ms"] = 1e3 * _time(lambda: index_summaries(reader.readable(), bias, index), 5)
        for T in queries:
            q = torch.randn(1, Hq, T, d, generator=g)
            k, v = torch.randn(1, H, T, d, generator=g), torch.randn(1, H, T, d, generator=g)
            valid = torch.ones(1, T, dtype=torch.bool)
            pos = torch.arange(layer.state.slots, layer.state.slots + T).unsqueeze(0)
            with torch.no_grad():
                if T == 1:  # the width an eager CPU read gathers for this query (the fixed one serves compiled reads)
                    q_pre = layer.rotary.unrotate(q, pos.unsqueeze(1))
                    picked = reader.group_buckets(M, q_pre, reader.bucket_scores(q, d**-0.5)).reshape(H, 1, -1)
                    row["eager_width_share"] = slots_of_buckets(index, picked)[0].shape[-1] / layer.state.slots
                sparse = lambda: reader.read(q, k, v, valid, pos, d**-0.5, *exact, reads_all=False)  # noqa: E731
                masked = lambda: reader.masked(q, k, v, valid, pos, d**-0.5, *exact, reads_all=False)  # noqa: E731
                diff = (sparse() - masked()).abs().max().item()
                if T == 1:  # the dense read of every slot: the fused decode read
                    dense = lambda: reader.dense(q, k, v, valid, d**-0.5, *exact)  # noqa: E731
                else:
                    dense = lambda: reader.masked(q, k, v, valid, pos, d**-0.5, *exact, reads_all=True)  # noqa: E731
                took = _time_side_by_side({"sparse": sparse, "masked": masked, "dense": dense}, repeats)
                cell = {f"{name}_us": 1e6 * t for name, t in took.items()}
                cell["max_abs_diff"] = diff
                cell["speedup_vs_dense"] = cell["dense_us"] / cell["sparse_us"]
                cell["speedup_vs_masked"] = cell["masked_us"] / cell["sparse_us"]
            row[f"T{T}"] = cell
        out.setdefault(str(budget), {})[rank] = row
    return out


def bench_chunk_read(states: list[int], chunk: int, kv_heads: int, head_dim: int, repeats: int, rep: int = 3) -> dict:
    """One prefill chunk's read of one layer (``joint_attention``, no gradients), split into
    two flash attentions against the one-call SDPA: milliseconds per layer and chunk."""
    import armkv.methods.attention as attention

    if attention._flash_with_lse() is None:
        return {}
    out = {}
    for n in states:
        g = torch.Generator().manual_seed(n)
        q = torch.randn(1, kv_heads * rep, chunk, head_dim, generator=g)
        k, v = (
            torch.randn(1, kv_heads, chunk, head_dim, generator=g),
            torch.randn(1, kv_heads, chunk, head_dim, generator=g),
        )
        sk, sv = torch.randn(1, kv_heads, n, head_dim, generator=g), torch.randn(1, kv_heads, n, head_dim, generator=g)
        state = dict(
            state_key=sk,
            state_value=sv,
            state_valid=torch.ones(1, kv_heads, n, dtype=torch.bool),
            state_bias=torch.rand(1, kv_heads, n, generator=g),
            state_clean=True,
        )
        valid = torch.ones(1, chunk, dtype=torch.bool)

        def read(split: bool):
            attention.SPLIT_ATTENTION = split
            try:
                return attention.joint_attention(q, k, v, valid, head_dim**-0.5, **state)
            finally:
                attention.SPLIT_ATTENTION = True

        with torch.no_grad():
            diff = (read(True) - read(False)).abs().max().item()
            split = _time(lambda: read(True), repeats)
            one = _time(lambda: read(False), repeats)
        out[str(n)] = {"split_ms": 1e3 * split, "one_call_ms": 1e3 * one, "speedup": one / split, "max_abs_diff": diff}
    return out


def main(args) -> int:
    global _clock
    from armkv.config import CHOICES
    from armkv.errors import ArmkvError

    ranks = tuple(r for r in args.sparse_ranks.split(",") if r)
    unknown = [r for r in ranks if _ranking(r)[0] not in CHOICES["read_rank"] or r.startswith("tree-pages")]
    if unknown:
        raise ArmkvError(
            f"--sparse-ranks {','.join(unknown)}: not a read_rank; use any of {', '.join(CHOICES['read_rank'])}, "
            "best-pages, partial-pages, each optionally ending in -summaries (e.g. partial-pages-summaries)"
        )
    if args.page_split < 1:
        raise ArmkvError(f"--page-split {args.page_split}: give at least 1 page per mean bucket")
    _clock = CLOCK[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr))
    log(f"threads: {torch.get_num_threads()}")
    scan = bench_scan(args.tokens, args.chunk, args.slots, args.kv_heads, args.head_dim)
    log(
        f"scan of {args.tokens} writes x {args.kv_heads} KV heads into {args.slots} slots: {scan['scan_ms']:.1f} ms "
        f"vs the per-token loop {scan['naive_ms']:.1f} ms = {scan['scan_speedup']:.1f}x faster"
    )
    log(
        f"whole write path (route, plan, gate, scan), chunks of {args.chunk}: {scan['write_ms_per_chunk']:.1f} ms "
        f"per chunk = {scan['write_tokens_per_s']:.0f} tokens/s per layer"
    )
    buckets = [int(b) for b in args.buckets.split(",")]
    read = bench_read(buckets, args.m, args.slots, args.kv_heads, args.head_dim, args.queries, args.repeats)
    log("| buckets | read us/query (M = %d) |\n|---:|---:|" % args.m)
    for nb, us in read.items():
        log(f"| {nb} | {us:.2f} |")
    int4 = bench_int4_read(
        [int(n) for n in args.int4_slots.split(",") if n], args.kv_heads, args.head_dim, args.repeats
    )
    if int4:
        log("| int4 slots | fused read us/layer | PyTorch ops us/layer | speedup |\n|---:|---:|---:|---:|")
        for n, r in int4.items():
            log(f"| {n} | {r['fused_us']:.0f} | {r['pytorch_us']:.0f} | {r['speedup']:.1f}x |")
    else:
        log("int4 read: the fused kernel is not available here (see the warning); not timed")
    sparse = bench_sparse_read(
        [int(b) for b in args.sparse_budgets.split(",") if b],
        args.sparse_fraction,
        [int(t) for t in args.sparse_queries.split(",") if t],
        max(args.repeats, 30),
        ranks,
        args.page_split,
    )
    log(
        "| budget | ranking | slots | M / N_b | gathered share | T | sparse us | dense us (every slot) | masked us | "
        "vs dense | vs masked | max diff |\n"
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for b, by_rank in sparse.items():
        for rank, r in by_rank.items():
            for key, cell in r.items():
                if key.startswith("T"):
                    log(
                        f"| {b} | {rank} | {r['slots']} | {r['m']}/{r['buckets']} | "
                        f"{r.get('eager_width_share', float('nan')):.3f} | {key[1:]} | "
                        f"{cell['sparse_us']:.0f} | {cell['dense_us']:.0f} | {cell['masked_us']:.0f} | "
                        f"{cell['speedup_vs_dense']:.1f}x | "
                        f"{cell['speedup_vs_masked']:.1f}x | {cell['max_abs_diff']:.1e} |"
                    )
    for b, by_rank in sparse.items():
        for rank, r in by_rank.items():
            if "summaries_build_ms" in r:
                log(
                    f"budget {b}, {rank}: the units' entries (read_summaries) built in {r['summaries_build_ms']:.2f} "
                    "ms, "
                    "once a write (every sync decoded tokens)"
                )
    chunk_read = bench_chunk_read(
        [int(n) for n in args.int4_slots.split(",") if n], args.chunk, args.kv_heads, args.head_dim, args.repeats
    )
    if chunk_read:
        log(
            "| state keys | chunk read ms/layer, split | one SDPA call | speedup |  (chunk of "
            f"{args.chunk})\n|---:|---:|---:|---:|"
        )
        for n, r in chunk_read.items():
            log(f"| {n} | {r['split_ms']:.1f} | {r['one_call_ms']:.1f} | {r['speedup']:.1f}x |")
    result = {
        **scan,
        "read_us_per_query": read,
        "int4_read_us_per_layer": int4,
        "chunk_read_ms_per_layer": chunk_read,
        "sparse_read_us_per_layer": sparse,
        "m": args.m,
        "threads": torch.get_num_threads(),
        "clock": args.clock,
    }
    print(json.dumps(result))
    return 0
