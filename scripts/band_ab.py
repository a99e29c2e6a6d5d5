"""The write's neighbour search (``band_neighbours``) of the current kernel source against the
one at git revision REV, built side by side in one process: whether both give the same bits
on a random pool, and their times interleaved (1 thread, process CPU time, mean of 20 calls a
round). The pool is 3 groups x SLOTS slots of head size 64 in 64 buckets, width 32.

    python scripts/band_ab.py 4fe7e54~1
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from armkv.memory import kernels

SOURCE = "src/armkv/memory/csrc/int4_read.cpp"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rev")
    p.add_argument("--slots", type=int, default=2706)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp())
    old_source = folder / "band_ab_old.cpp"
    old_source.write_text(subprocess.run(["git", "show", f"{a.rev}:{SOURCE}"], capture_output=True, text=True, check=True).stdout)
    old = load(name="armkv_band_ab_old", sources=[str(old_source)], build_directory=str(folder), extra_cflags=["-O3", "-std=c++17"])
    new = kernels.int4_read()
    g = torch.Generator().manual_seed(0)
    key = torch.randn(3, a.slots, 64, generator=g)
    bucket = torch.randint(0, 64, (3, a.slots), generator=g)
    order = torch.sort(bucket, dim=1, stable=True).indices
    none = key.new_empty(0)
    want, got = old.band_neighbours(key, none, order, bucket, 32), new.band_neighbours(key, none, order, bucket, 32)
    print("same bits:", torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]))
    for _ in range(a.rounds):
        for name, module in (("old", old), ("new", new)):
            t = time.process_time()
            for _ in range(20):
                module.band_neighbours(key, none, order, bucket, 32)
            print(f"{name}: {(time.process_time() - t) / 20 * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
