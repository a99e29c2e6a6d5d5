"""ARM's prefill throughput and decode latency per slot format, beside the floor, in one run.

Random token ids through the default model, 1 torch thread, CPU time of the process:
prefill of LENGTH ids in chunks of 256 for every format, then ROUNDS rounds that each
decode 32 steps (``sync`` = 16: two writes) with the floor's model and then with each
format in turn, so that every configuration sees the same machine noise. The first round
is warm-up. The median step mostly misses ARM's write steps; the mean counts them.

    python scripts/arm_speed.py 2048 --formats k8v4,k4v4
    python scripts/arm_speed.py 2048 --formats k4v4 --methods sink,swa
    python scripts/arm_speed.py 2048 --formats k4v4,k4v4:layer_weights=even   # a format with its own options
    python scripts/arm_speed.py 2048 --formats k4v4,k4v4:kernels=0   # without the fused int4 read
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from armkv.bench.decode import cpu_session
from armkv.hf.attach import make_cache


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("length", type=int)
    p.add_argument("--formats", default="k8v4,int8", help="slot formats, each optionally FORMAT:KEY=VALUE[:KEY=VALUE]")
    p.add_argument("--methods", default="", help="other methods to time beside, at the same budget (e.g. sink,swa)")
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--option", action="append", default=[], help="KEY=VALUE for every arm cache, e.g. sync=32")
    a = p.parse_args()

    def label(name: str) -> str:
        return name if name in others else f"arm slot_format={name}"

    extra = {k: (int(v) if v.isdigit() else v) for k, v in (o.split("=", 1) for o in a.option)}
    model, session = cpu_session(a.length, a.budget)
    others = [m for m in a.methods.split(",") if m]
    names = ["floor", *others, *[f for f in a.formats.split(",") if f]]
    state, steps, kernels = {}, {n: [] for n in names}, {}
    with torch.no_grad():
        for name in names:
            if name == "floor":
                cache, n = session.cache("full"), 4
            elif name in others:
                cache, n = make_cache(model, name, a.budget, 256), a.length
            else:
                fmt, *own = name.split(":")
                options = {**extra, **{k: (int(v) if v.isdigit() else v) for k, v in (o.split("=", 1) for o in own)}}
                kernels[name] = str(options.pop("kernels", 1))  # ARMKV_KERNELS while this one decodes
                cache, n = make_cache(model, "arm", a.budget, 256, slot_format=fmt, **options), a.length
            token, seconds = session.prefill(cache, n)
            if name != "floor":
                print(f"{label(name)}: prefill {n / seconds:.0f} tokens/s")
            state[name] = [cache, token, n]
        for r in range(a.rounds):
            for name in names:
                cache, token, pos = state[name]
                os.environ["ARMKV_KERNELS"] = kernels.get(name, "1")
                times, token = session.decode(cache, token, pos, 32)
                state[name] = [cache, token, pos + 32]
                if r:
                    steps[name] += times
    floor = statistics.median(steps["floor"]) * 1e3
    print(f"floor {floor:.1f} ms/token")
    for name in names[1:]:
        med, mean = statistics.median(steps[name]) * 1e3, statistics.mean(steps[name]) * 1e3
        print(f"{label(name)}: decode median {med:.1f} ({med / floor:.2f}x floor), mean {mean:.1f} "
              f"({mean / floor:.2f}x) ms/token over {len(steps[name])} steps")


if __name__ == "__main__":
    main()
