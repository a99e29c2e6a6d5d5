"""How much each slot format, with and without mixing, disturbs attention on real text.

One forward of the default model over the first LENGTH tokens of a prose file captures every
layer's post-RoPE queries, keys and values. Per layer, the last 64 queries attend to the
first LENGTH - 148 keys (what a pool would hold) exactly and with the keys and values
stored in each format (``MemoryState.pack``, mixed or not); printed: the relative error of
the attention output and the total-variation distance of the attention weights, mean and
worst over the 30 layers, and a JSON line.

    python scripts/slot_quant_error.py heldout.txt
"""

from __future__ import annotations

import argparse
import json

import torch

from armkv.hf.model import load_model
from armkv.memory.state import MemoryState


def capture(model, ids):
    """Per layer (query, key, value) [1, heads, T, d], queries and keys after RoPE."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    out = {}

    def hook(index):
        def grab(module, args, kwargs):
            h = kwargs["hidden_states"]
            cos, sin = kwargs["position_embeddings"]
            B, T, _ = h.shape
            d = module.head_dim
            q, k, v = (proj(h).view(B, T, -1, d).transpose(1, 2) for proj in (module.q_proj, module.k_proj, module.v_proj))
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            out[index] = (q, k, v)

        return grab

    handles = [layer.self_attn.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    return out


def stored(k: torch.Tensor, v: torch.Tensor, fmt: str, mix: bool) -> tuple[torch.Tensor, torch.Tensor]:
    H, S, d = k.shape
    st = MemoryState(k, v, torch.zeros(H, S), torch.ones(H, S), torch.zeros(H, S, dtype=torch.long))
    return st.pack(fmt, mix=mix).kv(torch.float32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("text")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--formats", default="int8,k8v4,k4v4")
    a = p.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model()
    ids = tok(open(a.text, encoding="utf-8").read(), return_tensors="pt").input_ids[:, : a.length]
    qkv = capture(model, ids)
    S = ids.shape[1] - 148
    results = {}
    for fmt in a.formats.split(","):
        for mix in (False, True):
            errs, tvs = [], []
            for q, k, v in qkv.values():
                K, V, Q = k[0, :, :S], v[0, :, :S], q[0, :, -64:]
                Kq, Vq = stored(K, V, fmt, mix)
                rep = Q.shape[0] // K.shape[0]
                scale = K.shape[-1] ** -0.5

                def attend(keys, values):
                    w = torch.softmax(Q @ keys.repeat_interleave(rep, 0).transpose(-1, -2) * scale, -1)
                    return w @ values.repeat_interleave(rep, 0), w

                o, w = attend(K, V)
                oq, wq = attend(Kq, Vq)
                errs.append(float((oq - o).norm() / o.norm()))
                tvs.append(float(0.5 * (wq - w).abs().sum(-1).mean()))
            name = f"{fmt}{' mixed' if mix else ''}"
            results[name] = {"output_rel_err": sum(errs) / len(errs), "output_rel_err_max": max(errs), "attn_tv": sum(tvs) / len(tvs)}
            print(f"{name:12s} attention output relative error mean {results[name]['output_rel_err']:.4f} "
                  f"worst layer {results[name]['output_rel_err_max']:.4f}, attention weights TV {results[name]['attn_tv']:.4f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
