"""ARM's prefill throughput and decode latency per slot format, beside the floor, in one run.

Random token ids through the default model, 1 torch thread, CPU time of the process:
prefill of LENGTH ids in chunks of 256, then 34 decode steps (the first 2 dropped). With
``sync`` = 16 the mean counts ARM's write steps, the median mostly does not.

    python scripts/arm_speed.py 2048 --formats model,int8
"""

from __future__ import annotations

import argparse
import statistics

import torch

from armkv.bench.decode import DecodeBench, Session, load_bench_model
from armkv.hf.attach import make_cache


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("length", type=int)
    p.add_argument("--formats", default="model,int8")
    p.add_argument("--budget", type=int, default=512)
    a = p.parse_args()
    torch.set_num_threads(1)
    model = load_bench_model(None, "cpu", "float32")
    session = Session(model, DecodeBench(methods=["arm"], lengths=[a.length], budget=a.budget, clock="process"))
    with torch.no_grad():
        token, _ = session.prefill(session.cache("full"), 4)
        steps, _ = session.decode(session.cache("full"), token, 4, 34)
        print(f"floor {statistics.median(steps[2:]) * 1e3:.1f} ms/token")
        for fmt in a.formats.split(","):
            cache = make_cache(model, "arm", a.budget, 256, slot_format=fmt)
            token, seconds = session.prefill(cache, a.length)
            steps, _ = session.decode(cache, token, a.length, 34)
            print(f"arm slot_format={fmt}: prefill {a.length / seconds:.0f} tokens/s, decode median "
                  f"{statistics.median(steps[2:]) * 1e3:.1f} mean {statistics.mean(steps[2:]) * 1e3:.1f} ms/token")


if __name__ == "__main__":
    main()
