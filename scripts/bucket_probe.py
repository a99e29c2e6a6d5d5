"""Probe for ``demote_scope`` (docs/memory.md, "Session 11"): in ARM's budgeted prefill of
the first LENGTH tokens of a text (the held-out prose), at every write where some pool is
short of room, how large is a token's bucket (its occupied slots over all occupied slots),
and how often is the token's most similar slot in another bucket (and by how much more
similar)? Prints the run's perplexity and those shares as one JSON line.

    python -m armkv.train.data heldout heldout.txt
    python scripts/bucket_probe.py 4096 heldout.txt [--option demote_scope=any]
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

import armkv.memory.write as arm_write
from armkv.options import option_value
from armkv.evals.ppl import perplexity
from armkv.hf.model import load_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("length", type=int)
    p.add_argument("text")
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args()
    torch.set_num_threads(1)
    options = {k.strip(): option_value(v) for k, _, v in (o.partition("=") for o in a.option)}
    stats = {"writes": 0, "tokens": 0, "share": 0.0, "max_share": 0.0, "elsewhere": 0, "gap": 0.0, "no_slot": 0}
    plan_writes = arm_write.plan_writes

    def probe(state, keys, bucket, valid, params, *args, **kwargs):
        occ = state.count > 0
        if bool((valid.sum(-1) > (~occ).sum(-1)).any()):  # some pool short of room
            cos = F.normalize(keys, dim=-1) @ F.normalize(state.key, dim=-1).transpose(1, 2)
            same = torch.where(occ, state.bucket, -1).unsqueeze(1) == bucket.unsqueeze(2)
            best_any = cos.masked_fill(~occ.unsqueeze(1), -math.inf).max(-1).values
            best_own = cos.masked_fill(~same, -math.inf).max(-1).values
            share = same.sum(-1).float() / occ.sum(-1, keepdim=True).clamp_min(1)
            has = torch.isfinite(best_own) & valid
            stats["writes"] += 1
            stats["tokens"] += int(valid.sum())
            stats["share"] += float(share[valid].sum())
            stats["max_share"] = max(stats["max_share"], float(share[valid].max()))
            stats["elsewhere"] += int(((best_any > best_own + 1e-6) & valid).sum())
            stats["no_slot"] += int((~torch.isfinite(best_own) & valid).sum())
            stats["gap"] += float((best_any - best_own)[has].sum())
        return plan_writes(state, keys, bucket, valid, params, *args, **kwargs)

    arm_write.plan_writes = probe  # write_chunk looks it up in the module at each call
    model, tokenizer = load_model(None)
    with open(a.text, encoding="utf-8") as f:
        ids = tokenizer(f.read(), return_tensors="pt").input_ids[:, : a.length]
    result = perplexity(model, ids, "arm", a.budget, 256, **options)
    n = max(stats["tokens"], 1)
    print(json.dumps({
        "ppl": round(result["ppl"], 3), "options": options, "short_writes": stats["writes"], "tokens": stats["tokens"],
        "mean_bucket_share": round(stats["share"] / n, 4), "max_bucket_share": round(stats["max_share"], 4),
        "nearest_in_another_bucket": round(stats["elsewhere"] / n, 4), "no_slot_in_own_bucket": round(stats["no_slot"] / n, 4),
        "mean_cosine_gap": round(stats["gap"] / n, 4),
    }))


if __name__ == "__main__":
    main()
