"""A/B of the roomy-write shortcut (``ARMLayer.skip_roomy_unpack``) in one process: ARM's
chunked prefill of LENGTH random ids through the default model, 1 thread, process clock, the
shortcut off then on, PAIRS times, with the number of roomy writes and the time spent
un-packing the pool for the others.

    python scripts/arm_roomy_ab.py 8192 1
"""

from __future__ import annotations

import argparse
import time

import torch

from armkv.bench.decode import cpu_session
from armkv.hf.attach import make_cache
from armkv.methods.arm import ARMLayer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("length", type=int)
    p.add_argument("pairs", type=int, nargs="?", default=1)
    a = p.parse_args()
    model, session = cpu_session(a.length)
    stats = {"roomy": 0, "flush": 0, "unpack_s": 0.0}
    write_form, roomy_form = ARMLayer._write_form, ARMLayer._roomy_form

    def timed(self, *args, **kwargs):
        start = time.process_time()
        out = write_form(self, *args, **kwargs)
        stats["unpack_s"] += time.process_time() - start
        stats["flush"] += 1
        return out

    def counted(self, *args, **kwargs):
        stats["roomy"] += 1
        stats["flush"] += 1
        return roomy_form(self, *args, **kwargs)

    ARMLayer._write_form, ARMLayer._roomy_form = timed, counted
    with torch.no_grad():
        session.prefill(make_cache(model, "arm", 512, 256), 512)  # warm-up
        for skip in [False, True] * a.pairs:
            stats.update(roomy=0, flush=0, unpack_s=0.0)
            cache = make_cache(model, "arm", 512, 256)
            for layer in cache.layers:
                layer.skip_roomy_unpack = skip
            _, seconds = session.prefill(cache, a.length)
            print(
                f"skip={skip}: {a.length / seconds:.1f} tok/s ({seconds:.1f} s), writes {stats['flush']}, "
                f"roomy {stats['roomy']}, un-pack {stats['unpack_s']:.2f} s",
                flush=True,
            )


if __name__ == "__main__":
    main()
