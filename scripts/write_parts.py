"""Where a decode-time write's time goes: after a prefill of LENGTH random ids through the
default model (1 thread, budget 512), ROUNDS times decode 8 tokens and then make every layer
write its waiting tokens, timing per layer-write (process CPU time) the pool's un-pack to
pre-RoPE floats (``ARMLayer._write_form``), the cos/sin of the slots' positions alone, each
slot's nearest neighbour in the band (``write.banded_neighbours``) and the whole write
(``ARMLayer._flush``, which does the first three again). The last line is one JSON document.

    python scripts/write_parts.py 8192
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from armkv.bench.decode import cpu_session
from armkv.hf.attach import make_cache
from armkv.memory.write import banded_neighbours


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("length", type=int)
    p.add_argument("--rounds", type=int, default=4)
    a = p.parse_args()
    model, session = cpu_session(a.length, 512, "arm")
    clock = time.process_time
    parts = dict(unpack=0.0, cos_sin=0.0, band=0.0, write=0.0)
    writes = 0
    with torch.no_grad():
        cache = make_cache(model, "arm", 512, 256)
        token, _ = session.prefill(cache, a.length)
        for r in range(a.rounds):
            _, token = session.decode(cache, token, a.length + 8 * r, 8)
            for layer in cache.layers:
                if layer.pending is None:
                    continue
                t = clock()
                state = layer._write_form(layer.state, torch.float32)
                parts["unpack"] += clock() - t
                t = clock()
                layer.rotary.half_cos_sin(layer._read_positions(layer.state), torch.float32)
                parts["cos_sin"] += clock() - t
                t = clock()
                banded_neighbours("key", state)
                parts["band"] += clock() - t
                t = clock()
                layer._flush()
                parts["write"] += clock() - t
                writes += 1
    ms = {k: round(v / max(writes, 1) * 1e3, 3) for k, v in parts.items()}
    print(f"{writes} layer-writes after {a.length} tokens, ms per layer-write: {ms}")
    print(json.dumps({"length": a.length, "writes": writes, "ms_per_layer_write": ms}))


if __name__ == "__main__":
    main()
