"""Experiment: can int4 keys be made more precise in the same bytes?

One forward of the default model over LENGTH tokens of a prose file captures every layer's
post-RoPE queries and keys (``slot_quant_error.capture``). Per layer, the last 64 queries
attend to the first LENGTH - 148 keys exactly and with the keys rounded by each variant;
printed: the total-variation distance of the attention weights (mean and worst layer) and
the relative error of the output with exact values. Variants that need statistics (the
channel scales) take them from another passage of the same file (--calibrate-at).

    python scripts/int4_key_variants.py heldout.txt
"""

from __future__ import annotations

import argparse
import json

import torch

from armkv.hf.model import load_model
from armkv.memory.quant import dequantise_symmetric, mixing_matrix, quantise_symmetric
from slot_quant_error import capture

VARIANTS = {
    "int8 keys (k8v4)": dict(bits=8, group=64, mix=True),
    "int4 plain": dict(bits=4, group=32, mix=False),
    "int4 mixed (default)": dict(bits=4, group=32, mix=True),
    "int4 mixed, group 16": dict(bits=4, group=16, mix=True),
    "int4 mixed, 16 levels": dict(bits=4, group=32, mix=True, offset=True),
    "int4 mixed, channel scales 0.5": dict(bits=4, group=32, mix=True, alpha=0.5),
    "int4 mixed, channel scales 0.25": dict(bits=4, group=32, mix=True, alpha=0.25),
    "int4 mixed, channel scales 0.75": dict(bits=4, group=32, mix=True, alpha=0.75),
    "int4 mixed, channel scales 0.5, 16 levels": dict(bits=4, group=32, mix=True, alpha=0.5, offset=True),
}


def pair_rms(x: torch.Tensor) -> torch.Tensor:
    """x [H, T, d] -> per-channel RMS [H, d], shared by each RoPE pair (c, c + d/2) so that
    a channel scale commutes with the rotation."""
    r = x.pow(2).mean(1)
    h = r.shape[-1] // 2
    r = (r[..., :h] + r[..., h:]) / 2
    return torch.cat([r, r], -1).sqrt()


def channel_scales(q: torch.Tensor, k: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's balance for a dot product: w = (rms(q) / rms(k)) ** alpha per channel
    (keys stored as k * w, queries read as q / w); q [1, Hq, T, d], k [1, H, T, d] -> [H, d]."""
    H, d = k.shape[1], k.shape[-1]
    rq = pair_rms(q[0].reshape(H, -1, d))  # the query heads of a KV head together
    return (rq / pair_rms(k[0]).clamp_min(1e-6)).pow(alpha)


def rounded_keys(keys: torch.Tensor, bits: int, group: int, mix: bool, w=None, offset=False) -> torch.Tensor:
    d = keys.shape[-1]
    x = keys if w is None else keys * w[:, None, :]
    q = mixing_matrix(d) if mix else None
    if mix:
        x = x @ q
    if offset:  # 16 levels, no zero: x ~ (c + 0.5) s with c in [-8, 7]
        xs = x.reshape(*x.shape[:-1], d // group, group)
        s = (xs.abs().amax(-1, keepdim=True) / 8).to(torch.bfloat16).float().clamp_min(1e-30)
        y = ((torch.floor(xs / s).clamp(-8, 7) + 0.5) * s).reshape(x.shape)
    else:
        codes, scale = quantise_symmetric(x, bits, d // group, torch.bfloat16)
        y = dequantise_symmetric(codes, scale)
    if mix:
        y = y @ q.T
    return y if w is None else y / w[:, None, :]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("text")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--calibrate-at", type=int, default=20000, help="token offset of the passage the channel scales come from")
    a = p.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model()
    ids = tok(open(a.text, encoding="utf-8").read(), return_tensors="pt").input_ids
    calib = capture(model, ids[:, a.calibrate_at : a.calibrate_at + a.length])
    qkv = capture(model, ids[:, : a.length])
    S = a.length - 148
    results = {}
    for name, v in VARIANTS.items():
        tvs, errs = [], []
        for i, (q, k, val) in qkv.items():
            K, V, Q = k[0, :, :S], val[0, :, :S], q[0, :, -64:]
            w = channel_scales(calib[i][0], calib[i][1], v["alpha"]) if "alpha" in v else None
            Kq = rounded_keys(K, v["bits"], v["group"], v["mix"], w, v.get("offset", False))
            rep, scale = Q.shape[0] // K.shape[0], K.shape[-1] ** -0.5
            exact = torch.softmax(Q @ K.repeat_interleave(rep, 0).transpose(-1, -2) * scale, -1)
            rounded = torch.softmax(Q @ Kq.repeat_interleave(rep, 0).transpose(-1, -2) * scale, -1)
            o, oq = exact @ V.repeat_interleave(rep, 0), rounded @ V.repeat_interleave(rep, 0)
            tvs.append(float(0.5 * (rounded - exact).abs().sum(-1).mean()))
            errs.append(float((oq - o).norm() / o.norm()))
        results[name] = {"attn_tv": sum(tvs) / len(tvs), "attn_tv_worst": max(tvs), "output_rel_err": sum(errs) / len(errs),
                         "attn_tv_per_layer": [round(t, 4) for t in tvs]}
        print(f"{name:44s} attention-weight TV mean {results[name]['attn_tv']:.4f} worst layer {max(tvs):.4f}, "
              f"output relative error {results[name]['output_rel_err']:.4f}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
