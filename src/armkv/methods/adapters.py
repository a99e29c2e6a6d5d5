"""ARM adapters: which parameters a cache of a given model and budget runs with.

An adapter is a folder holding an :class:`ARMModel` (``ARMModel.save`` / ``ARMModel.load``,
``memory/module.py``: its config and weights). This module finds the adapter shipped for a
model's shape, loads an adapter folder once per process, makes the seeded random one, copies
an adapter to the model's device, and splits a budget into the run-time config
(:func:`resolve_arm`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import weakref
from pathlib import Path

import torch

from armkv.config import ARMConfig, slot_bytes
from armkv.errors import ArmkvError
from armkv.memory.module import ARMModel
from armkv.methods.base import ModelInfo

# ARMConfig fields that may differ from the adapter's at run time: none of them changes
# a parameter's shape (the tree, scorer, gate and policy come with the adapter).
RUNTIME_FIELDS = {
    "sinks",
    "window",
    "sync",
    "slots",
    "pool",
    "chunk",
    "position_mode",
    "write",
    "empty_slot_rule",
    "log_count_bias",
    "demote_scope",
    "protect_recent",
    "lazy_merge",
    "slot_format",
    "slot_ladder",
    "slot_mixing",
    "tau",
    "top_m",
    "m_fixed",
    "read_rank",
    "partial_share",
    "read_pages",
    "page_split",
    "read_summaries",
    "epsilon",
}

SHIPPED_ADAPTERS = Path(__file__).resolve().parent.parent / "adapters"


@functools.lru_cache(maxsize=8)
def _load_adapter(path: str) -> ARMModel:
    return ARMModel.load(path).eval()


def _fits(folder: Path, info: ModelInfo) -> bool:
    try:
        _load_adapter(str(folder)).check_fits(info.num_layers, info.num_kv_heads, info.head_dim)
        return True
    except ArmkvError:
        return False


# Which shipped adapter ``--method arm`` uses when none is named, best first: the calibrated
# one (k-means trees and retrieval-head budget shares; docs/design.md). An adapter ships only
# if it beats this one on held-out text (docs/decisions.md).
DEFAULT_ADAPTER_ORDER = ("calibrated",)


def shipped_adapter(info: ModelInfo) -> Path | None:
    """The adapter shipped for a model of this shape, in :data:`DEFAULT_ADAPTER_ORDER`."""
    for kind in DEFAULT_ADAPTER_ORDER:
        for folder in sorted(SHIPPED_ADAPTERS.glob(f"*-{kind}")):
            if _fits(folder, info):
                return folder
    return None


@functools.lru_cache(maxsize=8)
def _random_arm(num_layers: int, num_kv_heads: int, head_dim: int, config_json: str) -> ARMModel:
    import json

    torch.manual_seed(0)
    return ARMModel(ARMConfig.from_dict(json.loads(config_json)), num_layers, num_kv_heads, head_dim).eval()


# (ARM parameters, device) -> their copy on that device; the copy lives as long as the original
_ON_DEVICE: "weakref.WeakKeyDictionary[ARMModel, dict[str, ARMModel]]" = weakref.WeakKeyDictionary()


def arm_on_device(arm: ARMModel, device: torch.device | str, given: bool = False) -> ARMModel:
    """``arm`` where its parameters are on ``device`` already, else a copy there (made once
    per adapter and device, and shared by every cache made from it). Parameters the caller
    gave (``given``: ``make_cache(..., arm=)``, e.g. those being trained) are never copied:
    on another device they are an error, since a copy would not be the parameters trained."""
    device = torch.device(device)
    where = next(arm.parameters()).device
    if where.type == device.type and (device.index is None or where.index == device.index):
        return arm
    if given:
        raise ArmkvError(
            f"the ARM parameters are on {where} but the model is on {device}: move them with arm.to({str(device)!r})"
        )
    copies = _ON_DEVICE.setdefault(arm, {})
    key = str(device)
    if key not in copies:
        copies[key] = copy.deepcopy(arm).to(device)
    return copies[key]


def resolve_arm(info: ModelInfo, budget: int, adapter=None, arm: ARMModel | None = None, overrides: dict | None = None):
    """The ARM parameters and the run-time config for this model and budget.

    adapter : None (the shipped adapter for this model if there is one, else "random"),
        "calibrated" (the shipped adapter of that kind), "random" (a seeded
        fresh initialisation), or an adapter folder
    arm : an ARMModel in memory (training passes its own); wins over adapter
    overrides : run-time ARMConfig fields (ablations), see RUNTIME_FIELDS
    """
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(ARMConfig)})
    if unknown:
        raise ArmkvError(f"arm has no option {', '.join(unknown)}; its options: {', '.join(sorted(RUNTIME_FIELDS))}")
    bad = sorted(set(overrides) - RUNTIME_FIELDS)
    if bad:
        raise ArmkvError(
            f"arm option(s) {bad} change the adapter's parameters; make an adapter with them instead "
            f"(run-time options: {', '.join(sorted(RUNTIME_FIELDS))})"
        )

    def fit(
        slot_format: str,
    ) -> ARMConfig:  # sinks, window, sync (as given, or split off) and slots that fit the budget
        given = {k: int(overrides[k]) for k in ("sinks", "window", "sync") if k in overrides}
        return ARMConfig.for_budget(budget, info.head_dim, info.dtype_bytes, slot_format=slot_format, **given)

    if arm is None:
        if adapter is None:
            found = shipped_adapter(info)
            adapter = str(found) if found else "random"
        if adapter in DEFAULT_ADAPTER_ORDER:
            found = [f for f in sorted(SHIPPED_ADAPTERS.glob(f"*-{adapter}")) if _fits(f, info)]
            if not found:
                raise ArmkvError(
                    f"no {adapter} adapter ships for this model; make one with armkv calibrate / armkv train"
                )
            adapter = str(found[0])
        if adapter == "random":
            import json

            tree_for_budget = fit(overrides.get("slot_format", ARMConfig.slot_format))
            base = dataclasses.replace(
                tree_for_budget, **{k: v for k, v in overrides.items() if k in {"top_m", "m_fixed"}}
            )
            arm = _random_arm(info.num_layers, info.num_kv_heads, info.head_dim, json.dumps(base.to_dict()))
        else:
            if not Path(adapter).is_dir():
                raise ArmkvError(f"adapter {adapter!r} is not a folder (use a path, 'random', or omit --adapter)")
            arm = _load_adapter(str(Path(adapter).resolve()))
    arm.check_fits(info.num_layers, info.num_kv_heads, info.head_dim)
    tree = arm.config
    # the storage format (and its mixing) and lazy merging are run-time choices (they change no parameter):
    # the library's default unless asked, whatever the adapter was saved with
    split = fit(overrides.get("slot_format", ARMConfig.slot_format))
    runtime = dataclasses.replace(tree, sinks=split.sinks, window=split.window, sync=split.sync)
    # the paper's pool partitions the slots over this adapter's buckets: a multiple of N_b
    slots = split.slots
    pool = overrides.get("pool", tree.pool)
    if pool == "paper":
        slots = (slots // tree.num_buckets) * tree.num_buckets
    if slots < 1:
        raise ArmkvError(
            f"budget {budget} is too small for arm: raise --budget to at least "
            f"{split.sinks + split.window + split.sync + 2}"
        )
    fields = {
        "slots": int(slots),
        "pool": pool,
        "slot_format": split.slot_format,
        "slot_mixing": ARMConfig.slot_mixing,
        "slot_ladder": ARMConfig.slot_ladder,
        "lazy_merge": ARMConfig.lazy_merge,
        "demote_scope": ARMConfig.demote_scope,
        **overrides,
    }
    fields.setdefault("chunk", min(tree.chunk, int(slots)))
    runtime = dataclasses.replace(runtime, **fields)
    if runtime.top_m == "fixed" and runtime.fixed_m < runtime.num_buckets:
        runtime = _with_index_bytes(runtime, info, budget)
    return arm, runtime


# bytes a read of fewer buckets than all keeps beside the slots between writes (read.BucketIndex):
# its order, per slot, and each bucket's start and size; read_pages' pages another start and size
# for each of their 2 N_b page_split
INDEX_SLOT_BYTES, INDEX_BUCKET_BYTES, PAGES_BUCKET_BYTES = 4, 8, 16
# the shared pool is re-laid bucket by bucket once its bucket order breaks in more than
# 1 / RESORT_SHARE of its readable slots, and more than RESORT_PER_BUCKET times per bucket
# (relay_breaks; Reader.bucket_index)
RESORT_SHARE = 64
RESORT_PER_BUCKET = 2
# the fused decode read's bound call (the kernel's DecodeCall) keeps the runs of consecutive
# slots of the bucket order, two int32 a run and one more, where there are at most max_runs:
# RUN_BYTES slots / RESORT_SHARE + RUNS_BYTES at most, counted in the budget (a pool with more
# runs finds them at each read instead: one re-laid past RESORT_PER_BUCKET N_b breaks may)
RUN_BYTES, RUNS_BYTES = 8, 12


def relay_breaks(slots: int, num_buckets: int) -> int:
    """The most breaks of its bucket order (read.run_breaks) a shared pool of ``slots`` readable
    slots keeps before it is re-laid bucket by bucket."""
    return max(RESORT_PER_BUCKET * num_buckets, slots // RESORT_SHARE)


def max_runs(slots: int) -> int:
    """The most runs of consecutive slots of the bucket order that a fused decode read's bound
    call keeps for a pool of ``slots`` readable slots (their bytes are in the budget)."""
    return slots // RESORT_SHARE + 1


def summary_bytes(runtime: ARMConfig, head_dim: int) -> int:
    """Bytes ``read_summaries`` keeps per bucket and KV head (read.index_summaries, float32):
    each unit's mean key and value and its log weight, for the bucket or its 2 page_split pages."""
    if not runtime.read_summaries:
        return 0
    return (2 * runtime.page_split if runtime.read_pages else 1) * (2 * head_dim + 1) * 4


def _with_index_bytes(runtime: ARMConfig, info: ModelInfo, budget: int) -> ARMConfig:
    """``runtime`` with fewer slots, so that the bucket index a fixed M < N_b keeps (and with
    ``read_summaries`` its units' entries) fits the budget with them, on every rung of its
    slot ladder (the index grows with the rung that holds the most slots)."""
    d, db = info.head_dim, info.dtype_bytes
    own = slot_bytes(runtime.slot_format, d, db)
    smallest = min(slot_bytes(f, d, db) for f in [*runtime.ladder, runtime.slot_format])
    per_bucket = (
        INDEX_BUCKET_BYTES
        + (PAGES_BUCKET_BYTES * runtime.page_split if runtime.read_pages else 0)
        + summary_bytes(runtime, d)
    )
    # the slots' share of what is left: each (at the ladder's smallest format) with its index entry
    # and its share of the runs the bound call keeps (max_runs: RUN_BYTES / RESORT_SHARE a slot)
    left = (
        (runtime.pool_slots * own - runtime.num_buckets * per_bucket - RUNS_BYTES)
        * smallest
        * RESORT_SHARE
        // ((smallest + INDEX_SLOT_BYTES) * RESORT_SHARE + RUN_BYTES)
    )
    slots = left // own
    if runtime.pool == "paper":
        slots = (slots // runtime.num_buckets) * runtime.num_buckets
    if slots < 1:
        if runtime.read_summaries:
            raise ArmkvError(
                f"budget {budget} is too small for arm with read_summaries: its {runtime.num_buckets} buckets keep "
                f"{runtime.num_buckets * summary_bytes(runtime, d)} bytes of summaries a KV head beside the slots; "
                "raise --budget "
                "or drop --option arm.read_summaries=true"
            )
        raise ArmkvError(f"budget {budget} is too small for arm reading fewer buckets than all: raise --budget")
    return dataclasses.replace(runtime, slots=int(slots), chunk=min(runtime.chunk, int(slots)))


__all__ = [
    "DEFAULT_ADAPTER_ORDER",
    "max_runs",
    "relay_breaks",
    "RUNTIME_FIELDS",
    "SHIPPED_ADAPTERS",
    "arm_on_device",
    "resolve_arm",
    "shipped_adapter",
]
