"""Where a method's budgeted chunked prefill spends its time: cProfile over one prefill of
LENGTH random ids through the default model, 1 torch thread, the 30 costliest functions by
own time (``--sort cumulative``: by time including callees; ``cumtime`` of ``plan_writes``
is ARM's whole write plan).

    python scripts/profile_arm.py 4096 arm
    python scripts/profile_arm.py 4096 arm --decode 64   # 64 decode steps after the prefill
    python scripts/profile_arm.py 2048 arm --writes 3    # 3 rounds of the decode-time write
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from armkv.bench.decode import cpu_session
from armkv.hf.attach import make_cache


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("length", type=int)
    p.add_argument("method", nargs="?", default="arm")
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--decode", type=int, default=0, help="profile this many decode steps after the prefill instead")
    p.add_argument("--writes", type=int, default=0,
                   help="arm: time and profile this many rounds of the decode-time write (8 decode steps, then every layer writes its waiting tokens)")
    p.add_argument("--sort", default="tottime", help="pstats order: tottime (own time) or cumulative")
    p.add_argument("--rows", type=int, default=30, help="functions listed")
    a = p.parse_args()
    model, session = cpu_session(a.length, a.budget, a.method)
    budget = None if a.method == "full" else a.budget
    with torch.no_grad():
        cache = make_cache(model, a.method, budget, 256)
        profile = cProfile.Profile()
        if a.writes:
            token, _ = session.prefill(cache, a.length)
            seconds = 0.0
            for r in range(a.writes):
                _, token = session.decode(cache, token, a.length + 8 * r, 8)
                t0 = time.process_time()
                profile.enable()
                for layer in cache.layers:
                    if layer.pending is not None:
                        layer._flush()
                profile.disable()
                seconds += time.process_time() - t0
            print(f"{a.method}: the decode-time write after {a.length} tokens, "
                  f"{seconds / (a.writes * len(cache.layers)) * 1e3:.1f} ms per layer (under the profiler)")
        elif a.decode:
            token, _ = session.prefill(cache, a.length)
            profile.enable()
            steps, _ = session.decode(cache, token, a.length, a.decode)
            profile.disable()
            print(f"{a.method}: {a.decode} decode steps after {a.length} tokens, "
                  f"mean {sum(steps) / len(steps) * 1e3:.1f} ms/token")
        else:
            profile.enable()
            _, seconds = session.prefill(cache, a.length)
            profile.disable()
            print(f"{a.method}: prefill of {a.length} tokens, {a.length / seconds:.0f} tokens/s")
    pstats.Stats(profile).sort_stats(a.sort).print_stats(a.rows)


if __name__ == "__main__":
    main()
