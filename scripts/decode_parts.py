"""Where ARM's decode step goes beside the floor's: wall time of the attention's parts per
decode step, summed over the layers (the default model, 1 torch thread).

Prefills LENGTH random ids into an ARM cache (budget 512) and 4 into the full cache (the
floor), then decodes STEPS tokens with each and prints, per step: the whole step (CPU time
of the process), the floor's attention, ARM's attention, and inside it the slot read
(``_decode_read``), the window push, the exact part's assembly and the writes (``_flush``,
every ``sync`` tokens, so its per-step figure is the write's cost spread over the steps).

    python scripts/decode_parts.py 8192 --steps 64
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from armkv.bench.decode import cpu_session
from armkv.hf.attach import make_cache
from armkv.methods.arm import ARMLayer
from armkv.methods.buffers import ExactBuffer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("length", type=int)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--budget", type=int, default=512)
    a = p.parse_args()
    spent: dict[str, float] = collections.defaultdict(float)

    def timed(cls, name: str, label: str) -> None:
        fn = getattr(cls, name)

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[label] += time.perf_counter() - t0
            return out

        setattr(cls, name, wrapper)

    model, session = cpu_session(a.length, a.budget)
    with torch.no_grad():
        floor = session.cache("full")
        floor_token, _ = session.prefill(floor, 4)
        arm = make_cache(model, "arm", a.budget, 256)
        arm_token, _ = session.prefill(arm, a.length)
        timed(type(floor.layers[0]), "attend_chunk", "floor: attention")
        timed(ARMLayer, "attend_chunk", "arm: attention")
        timed(ARMLayer, "_decode_read", "arm:   slot read (_decode_read)")
        timed(ExactBuffer, "push", "arm:   window push")
        timed(ARMLayer, "_exact", "arm:   exact part (_exact)")
        timed(ARMLayer, "_flush", "arm:   writes (_flush), spread over the steps")
        rows = {}
        for name, cache, token, pos in (("floor", floor, floor_token, 4), ("arm", arm, arm_token, a.length)):
            t0 = time.process_time()
            session.decode(cache, token, pos, a.steps)
            rows[name] = (time.process_time() - t0) / a.steps * 1e3
    print(f"{a.steps} decode steps after {a.length} tokens (arm) and 4 tokens (floor), budget {a.budget}, 1 thread")
    print(f"step (process CPU time): floor {rows['floor']:.1f} ms, arm {rows['arm']:.1f} ms ({rows['arm'] / rows['floor']:.2f}x)")
    for label, seconds in spent.items():
        print(f"  {label}: {seconds / a.steps * 1e3:.2f} ms/step")


if __name__ == "__main__":
    main()
