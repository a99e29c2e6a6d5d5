"""ARM's write (``ARMLayer._flush`` of 16 waiting tokens, what decoding does every ``sync``
tokens) in every layer after a prefill of LENGTH random ids through the default model, with
the fused write kernels (``armkv.memory.kernels``) and with the PyTorch forms, interleaved
in one process (1 thread, process CPU time, median of 3 after one warm-up). Each layer's
state is put back after each write, so every timing writes into the same pool. The last
line is one JSON document.

    python scripts/arm_write_speed.py 2048
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from armkv.bench.decode import cpu_session
from armkv.hf.attach import make_cache
from armkv.memory import kernels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("length", type=int)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--rounds", type=int, default=4)
    a = p.parse_args()
    model, session = cpu_session(a.length, a.budget)
    cache = make_cache(model, "arm", a.budget, 256)
    built = kernels.int4_read
    modes = {"fused": built, "pytorch": lambda: None}  # what the write's kernel lookups get
    result = {mode: [] for mode in modes}
    with torch.no_grad():
        session.prefill(cache, a.length)
        g = torch.Generator().manual_seed(0)
        for li, layer in enumerate(cache.layers):
            B, H, _, d = layer.buffer.sink_k.shape
            waiting = (torch.randn(B, H, 16, d, generator=g), torch.randn(B, H, 16, d, generator=g),
                       torch.ones(B, 16, dtype=torch.bool), torch.arange(a.length, a.length + 16).unsqueeze(0))
            before, rung, reserve = layer.state, layer.rung, layer.reserve  # a write may climb the ladder
            times = {mode: [] for mode in modes}
            try:
                for _ in range(a.rounds):
                    for mode, lookup in modes.items():
                        kernels.int4_read = lookup
                        layer.state, layer.rung, layer.reserve, layer.pending = before, rung, reserve, waiting
                        t0 = time.process_time()
                        layer._flush()
                        times[mode].append(time.process_time() - t0)
            finally:
                kernels.int4_read, layer.state, layer.pending = built, before, None
                layer.rung, layer.reserve = rung, reserve
            for mode in modes:
                result[mode].append(statistics.median(times[mode][1:]) * 1000)
            print(f"layer {li:2d}, {before.slots:5d} {layer.rungs[rung][0]} slots: fused {result['fused'][-1]:6.2f} ms, "
                  f"pytorch {result['pytorch'][-1]:6.2f} ms", flush=True)
    fused, plain = sum(result["fused"]), sum(result["pytorch"])
    print(f"all layers: fused {fused:.1f} ms, pytorch {plain:.1f} ms per write ({plain / fused:.2f}x)")
    print(json.dumps({"length": a.length, "budget": a.budget, "write_ms_per_layer": result}))


if __name__ == "__main__":
    main()
