"""The fused decode read (``arm_decode_read``) over one decode step's 30 layers, with the
slots warm in cache and cold, 1 torch thread.

At decode time a layer's slots come from memory: between two layers' reads the model's
weights (about 18 MB a layer for the default model in fp32) stream through the caches. This
times the kernel alone over 30 layers of the default model's slot counts at budget 512 (3 KV
heads, 3 query heads each, head size 64, k4v4 codes), once with a matmul over 18 MB of
weights before each layer's read (cold) and once without (warm). Medians over the steps.

    python scripts/decode_read_cold.py --steps 20
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from armkv.memory import kernels

# slots per layer after an 8k prefill at budget 512 (the retrieval layers hold more), at least 2,706
SLOTS = [2706] * 17 + [4948, 6036, 2706, 5119, 4181, 4089, 4410, 3443, 2706, 2730, 2706, 2706, 2706]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    torch.set_num_threads(1)
    module = kernels.int4_read()
    if module is None:
        raise SystemExit("the fused kernels are not built here (ARMKV_KERNELS=0 or no compiler)")
    G, R, d, L = 3, 3, 64, 68
    g = torch.Generator().manual_seed(0)
    mix = torch.linalg.qr(torch.randn(d, d, generator=g))[0].contiguous()
    layers = []
    for S in SLOTS:
        layers.append((
            torch.randn(G, R, d, generator=g), torch.randn(G, d, generator=g), torch.randn(G, d, generator=g),
            torch.ones(G, dtype=torch.bool), torch.randn(G, L, d, generator=g), torch.randn(G, L, d, generator=g),
            torch.ones(G, L, dtype=torch.bool), torch.randint(0, 256, (G, d // 2, S), dtype=torch.uint8, generator=g),
            (torch.rand(G, S, 2, generator=g) * 0.1).to(torch.bfloat16),
            torch.randint(0, 256, (G, S, d // 2), dtype=torch.uint8, generator=g),
            (torch.rand(G, S, 2, generator=g) * 0.1).to(torch.bfloat16), torch.zeros(G, S), mix,
        ))
    weights, x = torch.randn(576, 8192, generator=g), torch.randn(1, 576, generator=g)  # 18.9 MB

    def step(cold: bool) -> float:
        spent = 0.0
        for args in layers:
            if cold:
                x @ weights
            t0 = time.perf_counter()
            module.arm_decode_read(*args, 0.125, True)
            spent += time.perf_counter() - t0
        return spent

    for cold in (True, False):
        times = [step(cold) for _ in range(a.steps + 3)][3:]
        print(f"{'cold' if cold else 'warm'}: {statistics.median(times) * 1e3:.2f} ms a step ({sum(SLOTS):,} slots x {G} KV heads)")


if __name__ == "__main__":
    main()
