"""Experiment: does any question-agnostic signal mark a RULER needle in prose?

For each sample the full cache reads the context once (chunks of 256). Two signals are
ranked over the context's tokens, and the script prints the mean percentile of the needle's
tokens (the value and the 20 tokens before it; 0.5 = no better than a random token):

- surprisal: -log p(token | prefix) under the model;
- attention received: per layer and KV head, the mean attention a token gets from the
  queries of the next 256 positions (what a write at chunk time could have seen).

    python scripts/needle_signals.py --haystack heldout.txt --length 2048 --samples 2
"""

from __future__ import annotations

import argparse

import torch

import armkv.methods.full as full
from armkv.evals.ruler import RulerGenerator, load_essay
from armkv.hf.attach import make_cache
from armkv.hf.model import load_model
from armkv.hf.runner import Runner

RECEIVED: dict[int, dict[str, torch.Tensor]] = {}
_attend = full.FullLayer.attend_chunk


def _recording_attend(self, query, key, value, valid, positions, scaling):
    keys = key if self.keys is None else torch.cat([self.keys, key], 2)
    B, Hq, T, d = query.shape
    H, N = keys.shape[1], keys.shape[2]
    w = torch.einsum("bhgtd,bhnd->bhgtn", query.view(B, H, Hq // H, T, d), keys) * scaling
    q_pos = (N - T + torch.arange(T))[:, None]
    k_pos = torch.arange(N)[None, :]
    w = w.masked_fill(k_pos > q_pos, -float("inf")).softmax(-1)
    near = (q_pos - k_pos < 256) & (k_pos <= q_pos)  # queries within 256 positions after the key
    got = RECEIVED.setdefault(self.layer_idx, {"sum": torch.zeros(H, 0), "count": torch.zeros(0)})
    got["sum"] = torch.cat([got["sum"], torch.zeros(H, T)], 1) + (w * near).sum(2)[0].sum(1)
    got["count"] = torch.cat([got["count"], torch.zeros(T)]) + near.sum(0).float()
    return _attend(self, query, key, value, valid, positions, scaling)


full.FullLayer.attend_chunk = _recording_attend


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--haystack", required=True)
    p.add_argument("--task", default="niah_single_2")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--samples", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(None)
    runner = Runner(model, tok, "full")
    for s in RulerGenerator(tok, haystack_words=load_essay(a.haystack)).samples(a.task, a.length, a.samples):
        RECEIVED.clear()
        ids = runner.encode(s)[0]
        ans = tok(" " + s["answers"][0], add_special_tokens=False)["input_ids"]
        at = next(i for i in range(len(ids) - len(ans)) if ids[i : i + len(ans)] == ans)
        needle = list(range(at - 20, at + len(ans)))
        T = len(ids)
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids]), past_key_values=make_cache(model, "full", chunk=256), use_cache=True).logits[0]
        surprisal = torch.zeros(T)
        surprisal[1:] = -torch.log_softmax(logits[:-1].float(), -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]

        def percentile(signal: torch.Tensor) -> torch.Tensor:  # [..., T] -> mean rank of the needle, [...]
            return (signal.argsort(-1).argsort(-1).float() / (T - 1))[..., needle].mean(-1)

        print(f"{s['id']}: surprisal percentile {float(percentile(surprisal)):.2f}")
        per_layer = [percentile(RECEIVED[i]["sum"] / RECEIVED[i]["count"].clamp_min(1)) for i in sorted(RECEIVED)]
        flat = torch.stack(per_layer)
        print(f"  attention-received percentile over layers and KV heads: {float(flat.min()):.2f} to {float(flat.max()):.2f}"
              f" (mean {float(flat.mean()):.2f})")


if __name__ == "__main__":
    main()
