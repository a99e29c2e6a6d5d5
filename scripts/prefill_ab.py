"""A/B of prefill throughput in one process: the chunked prefill of LENGTH random ids through
the default model, 1 thread, process clock, for each config in turn, ROUNDS times round
robin (so that a change in the machine's load falls on every config alike), after one
short warm-up each. Prints each run, then each config's median tokens/s and its ratio to
the first config's, and a JSON line.

Configs are ``METHOD[:KEY=VALUE,...]`` separated by ``;`` (the method's options, as
``armkv eval ruler --option``):

    python scripts/prefill_ab.py 8192 --configs "full;arm:demote_scope=any;arm:demote_scope=bucket" --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from armkv.bench.decode import cpu_session
from armkv.options import option_value
from armkv.hf.attach import make_cache


def parse_config(text: str) -> tuple[str, dict]:
    method, _, rest = text.strip().partition(":")
    options = {}
    for pair in filter(None, rest.split(",")):
        key, _, value = pair.partition("=")
        options[key.strip()] = option_value(value)
    return method.strip(), options


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("length", type=int)
    p.add_argument("--configs", default="full;arm")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--chunk", type=int, default=256)
    a = p.parse_args()
    configs = [c for c in a.configs.split(";") if c.strip()]
    model, session = cpu_session(a.length, a.budget, "full")
    rates: dict[str, list[float]] = {c: [] for c in configs}

    def cache(config: str):
        method, options = parse_config(config)
        return make_cache(model, method, a.budget if method != "full" else None, a.chunk, **options)

    with torch.no_grad():
        for config in configs:  # warm-up: kernels built, code paths touched
            session.prefill(cache(config), 2 * a.chunk)
        for r in range(a.rounds):
            for config in configs:
                _, seconds = session.prefill(cache(config), a.length)
                rates[config].append(a.length / seconds)
                print(f"round {r}: {config}: {a.length / seconds:.1f} tok/s ({seconds:.1f} s)", flush=True)
    base = statistics.median(rates[configs[0]])
    summary = {}
    for config in configs:
        med = statistics.median(rates[config])
        summary[config] = {"tokens_per_s": round(med, 2), "ratio": round(med / base, 3), "runs": [round(x, 2) for x in rates[config]]}
        print(f"{config}: median {med:.1f} tok/s, {med / base:.3f}x {configs[0]}")
    print(json.dumps({"length": a.length, "budget": a.budget, "threads": 1, "prefill": summary}))


if __name__ == "__main__":
    main()
