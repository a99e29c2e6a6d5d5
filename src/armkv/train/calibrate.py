"""``armkv calibrate``: the training-free start. Run the model over calibration text and
collect every attention layer's pre-RoPE keys, from which each layer's tree is built
(hierarchical k-means, docs/design.md), and each layer's retrieval score, from which the
budget is shared over the layers (:func:`retrieval_scores`).

This module collects the keys (:func:`collect_keys`); building the trees from them and
saving the adapter is :func:`build_adapter`.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
from collections.abc import Iterable
from pathlib import Path

import torch

from armkv.budget import retrieval_layer_weights
from armkv.errors import ArmkvError
from armkv.train.models import attention_modules, load_model, module_head_dim


@torch.no_grad()
def collect_keys(
    model: torch.nn.Module,
    sequences: Iterable[torch.Tensor],
    max_keys_per_head: int,
    *,
    seed: int = 0,
) -> list[torch.Tensor]:
    """Pre-RoPE keys of every attention layer, a uniform sample of at most
    ``max_keys_per_head`` tokens.

    The keys are read by forward hooks: on ``k_norm`` where the layer has one (Qwen3
    normalises each head's key before RoPE), else on ``k_proj``. The sample is drawn
    without replacement over all tokens seen, with memory bounded by the sample size:
    every token gets a random priority and the ``max_keys_per_head`` highest survive
    each chunk. Tokens are shared by all layers and heads, so key n of every layer
    comes from the same token.

    Parameters
    ----------
    model : a transformers causal LM of the Llama family
    sequences : iterable of LongTensor [T] or [B, T]
        One forward pass each (e.g. packed sequences from ``PackedSequences``).
    max_keys_per_head : int
    seed : int
        Seeds the sample (a private generator: the global RNG is untouched).

    Returns
    -------
    list over layers of float32 CPU tensors [Hkv, N, d], N <= max_keys_per_head.
    """
    if max_keys_per_head < 1:
        raise ArmkvError(f"max_keys_per_head={max_keys_per_head}: must be at least 1")
    layers = attention_modules(model)
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    captured: list[torch.Tensor | None] = [None] * len(layers)  # this chunk's keys, [Hkv, B*T, d]

    def make_hook(i: int, head_dim: int):
        def hook(module, inputs, output):
            keys = output.detach().float()  # k_proj: [B, T, Hkv*d]; k_norm: [B, T, Hkv, d]
            keys = keys.reshape(keys.shape[0] * keys.shape[1], -1, head_dim)  # [B*T, Hkv, d]
            captured[i] = keys.transpose(0, 1).cpu()  # [Hkv, B*T, d]

        return hook

    handles = []
    was_training = model.training
    try:
        for i, attn in enumerate(layers):
            target = attn.k_norm if isinstance(getattr(attn, "k_norm", None), torch.nn.Module) else attn.k_proj
            handles.append(target.register_forward_hook(make_hook(i, module_head_dim(attn, model))))
        model.eval()
        # Only the keys matter: skip the vocabulary projection where the model allows it.
        extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
        kept: list[torch.Tensor] | None = None  # per layer [Hkv, n, d]
        priority = torch.empty(0)  # [n], the kept tokens' priorities
        for seq in sequences:
            ids = seq.reshape(1, -1) if seq.ndim == 1 else seq  # [B, T]
            model(input_ids=ids.to(device), **extra)
            new = torch.rand(ids.numel(), generator=generator)  # [B*T]
            priority = torch.cat([priority, new])
            order = priority.topk(min(max_keys_per_head, priority.numel())).indices.sort().values
            priority = priority[order]
            kept = [
                (captured[i] if kept is None else torch.cat([kept[i], captured[i]], dim=1))[:, order]
                for i in range(len(layers))
            ]
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    if kept is None:
        raise ArmkvError("no calibration sequences: the data was empty")
    return kept


@torch.no_grad()
def retrieval_scores(model: torch.nn.Module, passages: Iterable[torch.Tensor]) -> list[float]:
    """How strongly each layer copies from far back in the context, per layer.

    Each passage P (LongTensor [T]) is fed twice, [P | P]; every query of the second copy
    has, T tokens back, the token that follows its own earlier occurrence: the one an
    induction ("retrieval") head attends to when it copies. A layer's score is the largest,
    over its heads, of the mean attention weight on that token (Wu et al. 2024's retrieval
    heads; RazorAttention's induction heads), averaged over the passages.

    Returns a list over layers of scores in [0, 1].
    """
    was_training, impl = model.training, model.config._attn_implementation
    device = next(model.parameters()).device
    totals = None
    n = 0
    try:
        model.eval()
        model.set_attn_implementation("eager")  # the fused kernels return no attention weights
        for p in passages:
            p = p.reshape(-1)
            T = p.numel()
            if T < 8:
                raise ArmkvError(f"a retrieval passage of {T} tokens is too short (at least 8)")
            out = model(input_ids=torch.cat([p, p]).view(1, -1).to(device), output_attentions=True, use_cache=False)
            q = torch.arange(T + 1, 2 * T, device=device)
            scores = torch.stack([a[0][:, q, q - T + 1].float().mean(-1).max() for a in out.attentions])
            totals = scores if totals is None else totals + scores
            n += 1
    finally:
        model.set_attn_implementation(impl)
        model.train(was_training)
    if totals is None:
        raise ArmkvError("no retrieval passages: the calibration data was empty")
    return (totals / n).cpu().tolist()


def retrieval_passages(documents: Iterable[str], tokenize, length: int, count: int) -> list[torch.Tensor]:
    """``count`` passages of ``length`` tokens, cut from the documents' tokens one after the
    other (fewer, or one shorter passage, when the data runs out first)."""
    stream: list[int] = []
    for doc in documents:
        stream.extend(tokenize(doc))
        if len(stream) >= length * count:
            break
    found = [torch.tensor(stream[i : i + length]) for i in range(0, min(len(stream), length * count), length)]
    return [p for p in found if len(p) == length] or found[:1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from armkv.train.data import add_data_arguments

    parser.add_argument(
        "--model", metavar="DIR", help="local Hugging Face model directory (default: the default model)"
    )
    parser.add_argument("--gguf-file", help="GGUF file inside --model to load")
    add_data_arguments(parser)
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per forward pass")
    parser.add_argument("--tokens", type=int, default=65_536, help="calibration tokens to run through the model")
    parser.add_argument(
        "--max-keys-per-head", type=int, default=8192, help="keys kept per layer and KV head for the tree"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the data sampling and the k-means")
    parser.add_argument(
        "--budget", type=int, default=512, help="memory budget the tree is sized for (token-equivalents)"
    )
    parser.add_argument(
        "--depth",
        type=int,
        default=None,
        help="levels of the tree, branching 4 (unset: sized for --budget, about 6 slots a bucket; "
        "the shipped adapter has 3: 64 buckets)",
    )
    parser.add_argument(
        "--retrieval-tokens",
        type=int,
        default=768,
        help="tokens per passage of the retrieval score that shares the budget over the layers (0: even shares)",
    )
    parser.add_argument("--retrieval-passages", type=int, default=3, help="passages of the retrieval score")
    parser.add_argument(
        "--layer-weights-only",
        action="store_true",
        help="only (re)compute the per-layer budget shares of the adapter already in --out",
    )
    parser.add_argument("--out", required=True, help="adapter directory to write")


def build_adapter(
    model: torch.nn.Module,
    keys: list[torch.Tensor],
    args: argparse.Namespace,
    layer_weights: list[float] | None = None,
    scores: list[float] | None = None,
) -> Path:
    """Build each layer's tree from its keys (hierarchical k-means) and save the adapter.

    ``keys[layer]`` is [Hkv, N, d] pre-RoPE keys; ``layer_weights`` the per-layer budget
    shares (:func:`retrieval_layer_weights`), None for even shares; ``scores`` the retrieval
    scores they came from, kept in the config's meta for the named share rules.
    """
    from armkv.train.arm import calibrate_arm

    depth = {} if getattr(args, "depth", None) is None else {"depth": args.depth}
    arm = calibrate_arm(model, keys, args.budget, seed=args.seed, layer_weights=layer_weights, **depth)
    if scores is not None:
        arm.config = dataclasses.replace(arm.config, meta={**arm.config.meta, "retrieval_scores": scores})
    extra = {"calibration_tokens": args.tokens, "seq_len": args.seq_len, "max_keys_per_head": args.max_keys_per_head}
    return arm.save(args.out, extra=extra)


def update_layer_weights(
    directory: str | Path, layer_weights: list[float] | None, how: dict, scores: list[float] | None = None
) -> None:
    """Set an existing adapter's per-layer budget shares (and the retrieval scores they came
    from, which ``--option layer_weights=lift-late`` needs); its parameters are not touched."""
    from armkv.memory.module import ADAPTER_CONFIG, ARMModel, _atomic_write

    ARMModel.load(directory)  # a missing, foreign or corrupt adapter is a one-line error
    path = Path(directory) / ADAPTER_CONFIG
    meta = json.loads(path.read_text())
    meta["arm_config"]["layer_weights"] = layer_weights
    if scores is not None:
        meta["arm_config"].setdefault("meta", {})["retrieval_scores"] = scores
    meta.setdefault("extra", {})["layer_weights"] = how
    _atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=2)))


def main(args: argparse.Namespace) -> int:

    from armkv.train.data import PackedSequences, hf_tokenize, source_from_args

    if args.tokens < args.seq_len:
        raise ArmkvError(f"--tokens {args.tokens} is less than one sequence (--seq-len {args.seq_len})")
    if args.depth is not None and not 1 <= args.depth <= 10:
        raise ArmkvError(f"--depth {args.depth}: give 1 to 10 levels (4 ** depth buckets)")
    model, tokenizer = load_model(args)
    layer_weights = scores = None
    if args.retrieval_tokens > 0:
        documents = source_from_args(args, args.seed).iter_epoch(0)
        passages = retrieval_passages(documents, hf_tokenize(tokenizer), args.retrieval_tokens, args.retrieval_passages)
        scores = [round(s, 6) for s in retrieval_scores(model, passages)]  # as the adapter stores them
        layer_weights = retrieval_layer_weights(scores)
        print("retrieval score per layer:", " ".join(f"{s:.3f}" for s in scores))
        print("budget share per layer:", " ".join(f"{w:.2f}" for w in layer_weights))
    if args.layer_weights_only:
        update_layer_weights(
            args.out,
            layer_weights,
            {
                "retrieval_tokens": args.retrieval_tokens,
                "retrieval_passages": args.retrieval_passages,
                "rule": "lift-late",
            },
            scores,
        )
        print(f"ARM adapter: {args.out} (per-layer budget shares updated)")
        return 0
    data = PackedSequences(
        source_from_args(args, args.seed), hf_tokenize(tokenizer), tokenizer.eos_token_id, args.seq_len, max_epochs=1
    )
    sequences = (s for _, s in zip(range(args.tokens // args.seq_len), data))

    from tqdm.auto import tqdm

    keys = collect_keys(
        model,
        tqdm(sequences, total=args.tokens // args.seq_len, desc="calibrate", unit="seq"),
        args.max_keys_per_head,
        seed=args.seed,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = build_adapter(model, keys, args, layer_weights, scores)
    print(f"ARM adapter: {path}")
    return 0
