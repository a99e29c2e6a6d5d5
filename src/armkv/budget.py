"""Budget shares over layers: how a cache's token budget is divided among the model's layers.

A cache of budget N holds ``num_layers * N`` token-equivalents in all; ``layer_weights`` (a
list of relative shares, a rule applied to an adapter's retrieval scores, or "even") says how
they are shared. The split of one layer's share into sinks, window, waiting tokens and slots
is ``ARMConfig.for_budget`` (``config.py``).
"""

from __future__ import annotations

import math
import re

from armkv.errors import ArmkvError

LAYER_SHARE_RULES = ("lift-late",)


def retrieval_layer_weights(
    scores: list[float],
    rule: str = "lift-late",
    floor: float = 0.5,
    spread: float = 2.0,
    lift: float = 0.25,
) -> list[float]:
    """Relative per-layer budgets from :func:`retrieval_scores`, scaled to mean 1.

    rule "lift-late": each layer gets floor + spread * sqrt(score / top score); every layer
    scoring at least ``lift`` times the top score is raised to the top layer's share (a layer
    whose heads copy from far back needs its needles held exactly, whatever its rank among
    such layers), and the layers above the last raised one pay for it in proportion to their
    shares, at most half of each (anything left is taken from every layer evenly), so that
    the layers below keep their shares. Every layer keeps some memory. The rules it replaced
    and what they measured: docs/decisions.md. ``armkv calibrate`` stores the shares and the
    scores in the adapter.
    """
    if rule not in LAYER_SHARE_RULES:
        raise ArmkvError(f"layer share rule {rule!r} is not one of {', '.join(LAYER_SHARE_RULES)}")
    top = max(scores)
    if not top > 0:
        return [1.0] * len(scores)
    raw = [floor + spread * (max(s, 0.0) / top) ** 0.5 for s in scores]
    lifted = [i for i, s in enumerate(scores) if s >= lift * top]
    extra = sum(floor + spread - raw[i] for i in lifted)
    raw = [floor + spread if i in lifted else r for i, r in enumerate(raw)]
    late = range(lifted[-1] + 1, len(raw))
    paying = sum(raw[i] for i in late)
    if paying > 0:
        keep = max(0.5, 1 - extra / paying)
        raw = [r * keep if i in late else r for i, r in enumerate(raw)]
    mean = sum(raw) / len(raw)
    return [round(w / mean, 4) for w in raw]


def parse_layer_weights(spec, num_layers: int) -> list[float]:
    """Relative per-layer budgets: a sequence of ``num_layers`` numbers, or a string of them
    ("1,1,0.5,...") or of ranges ("0-9:0.5,10-29:1.25"; unlisted layers weigh 1), the items
    separated by commas, slashes or spaces."""

    def bad(why: str) -> ArmkvError:
        return ArmkvError(
            f"layer_weights={spec!r}: {why} (e.g. '0-9:0.5,10-{num_layers - 1}:1.25' or {num_layers} numbers)"
        )

    ranges, weights = [], None
    try:
        if isinstance(spec, str) and ":" in spec:
            for part in filter(None, re.split(r"[,/\s]+", spec)):
                span, _, w = part.partition(":")
                lo, _, hi = span.partition("-")
                ranges.append((span, int(lo), int(hi or lo), float(w)))
        else:
            weights = [float(w) for w in (filter(None, re.split(r"[,/\s]+", spec)) if isinstance(spec, str) else spec)]
    except ValueError:
        raise bad("not numbers") from None
    if weights is None:
        weights = [1.0] * num_layers
        for span, lo, hi, w in ranges:
            if not 0 <= lo <= hi < num_layers:
                raise bad(f"layers {span} are not within 0-{num_layers - 1}")
            weights[lo : hi + 1] = [w] * (hi - lo + 1)
    if len(weights) != num_layers:
        raise bad(f"{len(weights)} weights for {num_layers} layers")
    if min(weights) <= 0 or not all(math.isfinite(w) for w in weights):
        raise bad("every weight must be a positive number")
    return weights


def layer_budget(budget: int, layer_idx: int, weights: list[float]) -> int:
    """Layer ``layer_idx``'s token-equivalents when ``len(weights) * budget`` is shared in
    proportion to ``weights`` (rounded down: the layers together never exceed the total)."""
    return int(budget * len(weights) * weights[layer_idx] / sum(weights))


def adapter_layer_weights(weights, config, num_layers: int):
    """The per-layer shares a cache of an adapter with this ``config`` (an ARMConfig) runs
    with: ``weights`` as asked, else the adapter's calibrated ``layer_weights``; "even" or
    None for equal shares, a rule of :data:`LAYER_SHARE_RULES` applied to the retrieval
    scores the adapter was calibrated with, or the shares as :func:`parse_layer_weights` reads them."""
    # the adapter's calibrated per-layer shares of the budget, unless asked otherwise ("even": none;
    # a rule of LAYER_SHARE_RULES: that rule applied to the retrieval scores the adapter was calibrated with)
    weights = config.layer_weights if weights is None else weights
    if isinstance(weights, str) and weights in LAYER_SHARE_RULES:
        scores = config.meta.get("retrieval_scores")
        if not scores or len(scores) != num_layers:
            raise ArmkvError(
                f"layer_weights={weights!r} needs the retrieval scores of an adapter calibrated by this armkv "
                "(`armkv calibrate --layer-weights-only --out ADAPTER` adds them); give the shares as numbers instead"
            )
        weights = retrieval_layer_weights(scores, weights)
    return weights
