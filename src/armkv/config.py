"""ARMConfig: one dataclass for the routed memory, and the budget arithmetic.

All sizes are per attention layer and per KV head: every layer and KV head holds the
same structure, so a budget in token-equivalents means the same thing for every method.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from fractions import Fraction

from armkv.errors import ArmkvError

# Bytes of slot metadata kept beside each slot's key and value: count n (fp32),
# count-weighted position (fp32) and bucket id (int32).
SLOT_META_BYTES = 12
SLOT_SCALE_BYTES = 2  # bfloat16 quantisation scales (memory/state.py)

CHOICES = {
    "pool": ("shared", "paper"),
    "position_mode": ("stored", "fixed"),
    "scorer": ("similarity", "paper"),
    "gate": ("scalar", "channel"),
    "write": ("gated", "mean", "fifo"),
    "top_m": ("adaptive", "fixed"),
    "read_rank": ("best", "partial", "tree"),
    "demote_scope": ("bucket", "any"),
    "slot_format": ("model", "bfloat16", "int8", "k8v4", "k4v4"),
}

# Fields that older adapters may carry and that no longer exist: never read ("balance_alpha",
# "budget_penalty": the training losses take their weights from `armkv train`'s flags), or
# options that lost in measurements ("merge_metric": "kv" and "ward" against the key cosine;
# docs/decisions.md). ARMConfig.from_dict drops them.
REMOVED_FIELDS = frozenset({"balance_alpha", "budget_penalty", "merge_metric"})

# The quantised slot formats: (key bits, value bits). 8 bits: one scale per vector; 4 bits:
# two codes a byte, one scale per VALUE_GROUP channels. Scales are bfloat16 (SLOT_SCALE_BYTES).
QUANTISED_SLOTS = {"int8": (8, 8), "k8v4": (8, 4), "k4v4": (4, 4)}


# int4 slot vectors carry one scale per group of this many channels (KIVI's value group)
VALUE_GROUP = 32


def value_groups(head_dim: int) -> int:
    """Scales per int4 vector: one per VALUE_GROUP channels, or one if d does not split."""
    return head_dim // VALUE_GROUP if head_dim % VALUE_GROUP == 0 else 1


def quantised_bytes(bits: int, head_dim: int) -> int:
    """Bytes of one quantised key or value vector: codes and scales."""
    if bits == 8:
        return head_dim + SLOT_SCALE_BYTES
    if head_dim % 2:
        raise ArmkvError(f"4-bit slot formats pack two codes a byte: head size {head_dim} must be even")
    return head_dim // 2 + SLOT_SCALE_BYTES * value_groups(head_dim)


def slot_bytes(slot_format: str, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of one slot for one KV head: key and value as stored, plus the metadata."""
    if slot_format in QUANTISED_SLOTS:
        key_bits, value_bits = QUANTISED_SLOTS[slot_format]
        kv = quantised_bytes(key_bits, head_dim) + quantised_bytes(value_bits, head_dim)
    elif slot_format == "bfloat16":
        kv = 2 * head_dim * 2
    else:
        kv = 2 * head_dim * dtype_bytes
    return kv + SLOT_META_BYTES


def buckets_of(value: str, num_buckets: int, name: str) -> int:
    """A number of buckets given as a share of them ("1/8", "0.25") or a count ("8"): at least 1."""
    try:
        share = Fraction(value.strip())
    except (ValueError, ZeroDivisionError):
        raise ArmkvError(f"ARMConfig.{name}={value!r}: give a number of buckets (8) or a share of them (1/8)") from None
    if share.denominator == 1:
        return int(share)
    if not 0 < share <= 1:
        raise ArmkvError(f"ARMConfig.{name}={value!r}: a share of the buckets must be in (0, 1]")
    return max(1, int(share * num_buckets))


@dataclass
class ARMConfig:
    """The routed memory of one attention layer (same for every layer and KV head).

    Budget in token-equivalents = ``sinks + window + sync + slots``; see :meth:`state_bytes`
    for the exact bytes, metadata included.
    """

    depth: int = 3  # D: levels of routers between the root and the leaf buckets
    branching: int = 4  # C: children per router node; N_b = C ** D buckets
    slots: int = 384  # S: slots in the pool (per layer, per KV head)
    pool: str = "shared"  # "shared": one pool the tree indexes; "paper": S // N_b fixed slots per bucket
    sinks: int = 4  # first tokens kept exact (StreamingLLM's attention sinks)
    window: int = 64  # W: most recent tokens kept exact
    chunk: int = 256  # P: prefill chunk; the sync point of the chunked write scan
    sync: int = 16  # while decoding, tokens that leave the window wait (exact, still read) and are
    # written together every `sync` tokens; 1 = the paper's state-dependent write at every token
    position_mode: str = "stored"  # "stored": slot keys rotated to their count-weighted position;
    # "fixed": every slot rotated as if it stood just before the local window (InfLLM)
    scorer: str = "similarity"  # "similarity": compares token and slot; "paper": w.[K;k]+b (cannot)
    gate: str = "scalar"  # gamma per token ("scalar") or per channel ("channel")
    # "gated": the gate's blend (its initial rule is the running mean); "mean": beta = 1/n;
    # "fifo": overwrite the oldest slot
    write: str = "gated"
    empty_slot_rule: bool = True  # novel tokens take a free slot exactly (beta = 1); ours, not the paper's
    merge_threshold: float = 0.98  # the scorer's initial rule: a token merges into a slot whose key
    # (pre-RoPE) has cosine >= this; the shipped adapter keeps it (docs/design.md). When the pool is
    # full, the pairs with the highest key cosine merge first
    demote_scope: str = "bucket"  # where a full pool merges a novel token that is among the most redundant
    # candidates: "bucket", its most similar slot of its own bucket, where the tree files keys like
    # it (the write then scores each token against its bucket's slots only), "any", its most
    # similar slot of any bucket
    lazy_merge: bool = True  # merge only when the pool is short of room: while a chunk's tokens all fit
    # in free slots, every one takes its own, near-duplicates included; False merges every token
    # above merge_threshold into its slot at once
    protect_recent: float = 0.0  # share of the occupied slots, the most recent, kept out of the merges
    # that make room (0: any slot may merge); the chunk's tokens give way only after the older pairs
    slot_format: str = "k4v4"  # how slots are stored between writes: "k4v4" (default) int4 keys and
    # values with a scale per 32 channels (5.7x the slots of fp32 at equal bytes), "k8v4" int8 keys
    # (4.4x), "int8" keys and values (3.5x), "bfloat16", or the model's dtype ("model"); the budget
    # buys correspondingly more slots
    slot_ladder: str = "k8v4"  # formats, most precise first and comma-separated, that the pool is stored
    # in before slot_format while its bytes hold fewer slots: each gives way to the next (every slot
    # re-packed, the pool grown to the slots the same bytes hold) when a write would have to merge.
    # "k8v4" (default): int8 keys until the pool is full, then k4v4's 36% more slots; "" : k4v4
    # throughout (inference and the shared pool only: the paper's pool keeps its slots per bucket)
    slot_mixing: bool = True  # quantised slots store x Q (Q orthogonal: Hadamard) so that outlier
    # channels do not waste the absmax scale; no bytes, reads mix the query instead
    log_count_bias: bool = True  # add log(n) to a merged slot's attention logit (it stands for n keys)
    tau: float = 1.0  # Gumbel-Softmax temperature (training only)
    top_m: str = "adaptive"  # "adaptive": the policy picks M per input (the shipped adapter's policy
    # picks M = N_b, every bucket); "fixed": M = m_fixed
    m_fixed: int | None = None  # fixed M (default: N_b // 2); a share such as "1/8" is resolved against N_b
    m_max: int | None = None  # largest M the policy may pick (default: N_b)
    read_rank: str = "best"  # which M buckets a query reads when M < N_b: "best", those holding its
    # highest-scoring slots (each bucket ranked by its best logit, max over the slots and the KV
    # head's query heads: a rule, exact, every key scored); "partial", the same ranking from partial
    # logits, a decoded token's q.k over only the key-code rows (channel pairs c, c + d/2) where
    # its query is largest (SparQ's rule; a chunk ranks as "best"; needs slot_mixing=False, as
    # mixed slots spread every channel over all of them); "tree", the tree's read routing
    # (learned routers, scores N_b paths instead of every key, loses needles: docs/decisions.md)
    partial_share: float = 0.25  # read_rank="partial": the share of the d/2 key-code rows it reads
    read_pages: bool = False  # at M < N_b, rank and read pages instead of whole buckets: each bucket's
    # slots cut into pages of at most 1 / page_split of the mean bucket's size (occupied / N_b), a
    # read taking M * page_split of them, so that it touches at most M / N_b of the occupied slots
    # however unevenly the tree fills its buckets (read.paged_index); "best" or "partial" rank them
    # (a page's best logit)
    page_split: int = 1  # read_pages: pages per mean bucket; 4 misses a third less of the full read's
    # attention at M = N_b / 8 and its read costs a third more (docs/design.md, docs/decisions.md)
    read_summaries: bool = False  # at M < N_b, each bucket (or page) a read skips still enters its softmax
    # as one entry: its slots' keys and values averaged with the weights log_count_bias gives them
    # (each slot's count), the log of their total as the logit bias (read.unit_summaries; NSA's
    # compressed attention over the tree's buckets). Kept beside the slots, counted in the budget
    # (2 d + 1 float32 a unit), rebuilt for the buckets a write changes; read by the fused CPU
    # kernels, elsewhere by the masked read (docs/design.md)
    policy_hidden: int = 64  # LSTM width of the top-M policy
    policy_tokens: int = 64  # l: tokens pooled into the policy's starting state
    epsilon: float = 0.1  # epsilon-greedy exploration of the policy in training
    layer_weights: list | None = None  # relative per-layer budgets (calibrated: retrieval_layer_weights); None = even
    meta: dict = field(default_factory=dict)  # free-form provenance (calibration data, training run)

    def __post_init__(self) -> None:
        for name, allowed in CHOICES.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ArmkvError(f"ARMConfig.{name}={value!r} is not one of {', '.join(allowed)}")
        if self.depth < 1:
            raise ArmkvError(f"ARMConfig.depth={self.depth}: the tree needs at least 1 level of routers")
        if self.branching < 2:
            raise ArmkvError(f"ARMConfig.branching={self.branching}: each router needs at least 2 children")
        if self.num_buckets > 1 << 20:
            raise ArmkvError(f"ARMConfig: {self.branching}**{self.depth} buckets is too many; lower depth or branching")
        if self.slots < 1:
            raise ArmkvError(f"ARMConfig.slots={self.slots}: the memory needs at least 1 slot")
        if self.pool == "paper" and self.slots < self.num_buckets:
            raise ArmkvError(
                f"ARMConfig: pool='paper' gives each of the {self.num_buckets} buckets slots // N_b slots, "
                f"but slots={self.slots}; raise slots to a multiple of {self.num_buckets} or lower depth"
            )
        if self.sinks < 0 or self.window < 1:
            raise ArmkvError(f"ARMConfig: sinks={self.sinks} must be >= 0 and window={self.window} >= 1")
        if self.chunk < 1:
            raise ArmkvError(f"ARMConfig.chunk={self.chunk} must be >= 1")
        if self.sync < 1:
            raise ArmkvError(f"ARMConfig.sync={self.sync} must be >= 1 (1 = write at every decoded token)")
        if not 0.0 < self.merge_threshold <= 1.0:
            raise ArmkvError(f"ARMConfig.merge_threshold={self.merge_threshold} must be in (0, 1]")
        if not 0.0 <= self.protect_recent < 1.0:
            raise ArmkvError(f"ARMConfig.protect_recent={self.protect_recent} must be in [0, 1)")
        if self.tau <= 0:
            raise ArmkvError(f"ARMConfig.tau={self.tau} must be > 0")
        if not 0.0 <= self.epsilon <= 1.0:
            raise ArmkvError(f"ARMConfig.epsilon={self.epsilon} must be in [0, 1]")
        if self.m_max is not None and not 1 <= self.m_max <= self.num_buckets:
            raise ArmkvError(
                f"ARMConfig.m_max={self.m_max} must be between 1 and the number of buckets ({self.num_buckets})"
            )
        if isinstance(self.m_fixed, str):  # a share of the buckets: "1/8" -> N_b / 8
            self.m_fixed = buckets_of(self.m_fixed, self.num_buckets, "m_fixed")
        if self.m_fixed is not None and not 1 <= self.m_fixed <= self.num_buckets:
            raise ArmkvError(
                f"ARMConfig.m_fixed={self.m_fixed} must be between 1 and the number of buckets ({self.num_buckets})"
            )
        for rung in self.ladder:
            if rung not in CHOICES["slot_format"]:
                raise ArmkvError(
                    f"ARMConfig.slot_ladder={self.slot_ladder!r}: {rung!r} is not one of "
                    f"{', '.join(CHOICES['slot_format'])}"
                )
        if not 0.0 < self.partial_share <= 1.0:
            raise ArmkvError(f"ARMConfig.partial_share={self.partial_share} must be in (0, 1]")
        if self.read_rank == "partial" and self.slot_mixing:
            raise ArmkvError(
                "ARMConfig: read_rank='partial' ranks by the few key channels where a query is largest, and mixed "
                "slots spread every channel over all of them; set slot_mixing=false (--option arm.slot_mixing=false)"
            )
        if self.page_split < 1:
            raise ArmkvError(
                f"ARMConfig.page_split={self.page_split} must be >= 1 (pages per mean bucket under read_pages)"
            )
        if self.read_pages and self.read_rank == "tree":
            raise ArmkvError(
                "ARMConfig: read_pages=true ranks pages by their best logit, and the tree ranks whole buckets; "
                "use read_rank=best or partial (--option arm.read_rank=partial)"
            )
        if self.policy_hidden < 1 or self.policy_tokens < 1:
            raise ArmkvError("ARMConfig.policy_hidden and policy_tokens must be >= 1")

    # ------------------------------------------------------------------ derived sizes
    @property
    def ladder(self) -> list[str]:
        """The formats of ``slot_ladder``, in order (empty: the pool is ``slot_format`` throughout)."""
        return [f.strip() for f in self.slot_ladder.split(",") if f.strip()]

    @property
    def num_buckets(self) -> int:
        """N_b = C ** D leaf buckets."""
        return self.branching**self.depth

    @property
    def num_nodes(self) -> int:
        """Internal router nodes: 1 + C + ... + C ** (D - 1)."""
        return (self.num_buckets - 1) // (self.branching - 1)

    @property
    def slots_per_bucket(self) -> int:
        """Y of the paper's fixed partition (pool='paper'); 0 for the shared pool."""
        return self.slots // self.num_buckets if self.pool == "paper" else 0

    @property
    def pool_slots(self) -> int:
        """Slots actually allocated: S, or N_b * Y for the paper's partition."""
        return self.num_buckets * self.slots_per_bucket if self.pool == "paper" else self.slots

    @property
    def max_m(self) -> int:
        return self.m_max if self.m_max is not None else self.num_buckets

    @property
    def fixed_m(self) -> int:
        return self.m_fixed if self.m_fixed is not None else max(1, self.num_buckets // 2)

    @property
    def budget_tokens(self) -> int:
        """Token-equivalents held at most: sinks + window + sync (waiting tokens) + slots."""
        return self.sinks + self.window + self.sync + self.pool_slots

    def state_bytes(self, head_dim: int, dtype_bytes: int = 4) -> int:
        """Bytes of one layer's state for one KV head and one sequence, metadata included."""
        token = 2 * head_dim * dtype_bytes
        return (self.sinks + self.window + self.sync) * token + self.pool_slots * slot_bytes(
            self.slot_format, head_dim, dtype_bytes
        )

    # ------------------------------------------------------------------ budget
    @classmethod
    def for_budget(cls, budget: int, head_dim: int, dtype_bytes: int = 4, **overrides) -> "ARMConfig":
        """The config whose state fits ``budget`` token-equivalents of KV bytes.

        The exact part takes ``sinks`` (4) + ``window`` + ``sync`` tokens (budget // 8 at
        most 64 for the last two, a quarter of it for sync); the rest, less the slots'
        metadata, becomes the slot pool. The tree
        gets about 6 slots per bucket (a power of ``branching``).
        """
        token = 2 * head_dim * dtype_bytes
        sinks = overrides.pop("sinks", min(4, max(0, budget // 16)))
        exact = max(2, min(64, budget // 8))
        sync = overrides.pop("sync", max(1, min(16, exact // 4)))
        window = overrides.pop("window", max(1, exact - sync))
        free = budget * token - (sinks + window + sync) * token
        slots = free // slot_bytes(overrides.get("slot_format", cls.slot_format), head_dim, dtype_bytes)
        if slots < 1:
            raise ArmkvError(
                f"budget {budget} token-equivalents is too small for ARM with {sinks} sinks, a window of "
                f"{window} and {sync} waiting tokens: raise --budget to at least {sinks + window + sync + 2}"
            )
        branching = overrides.pop("branching", 4)
        if "depth" in overrides:
            depth = overrides.pop("depth")
        else:
            depth = max(1, round(math.log(max(slots / 6, 1), branching)))
        pool = overrides.get("pool", "shared")
        if pool == "paper":
            nb = branching**depth
            while depth > 1 and slots < nb:
                depth -= 1
                nb = branching**depth
            slots = (slots // nb) * nb
        return cls(
            sinks=sinks, window=window, sync=sync, slots=int(slots), depth=depth, branching=branching, **overrides
        )

    # ------------------------------------------------------------------ io
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ARMConfig":
        """The config saved by :meth:`to_dict`. Fields that were removed (REMOVED_FIELDS) are
        dropped, so adapters saved with them still load; any other unknown field is an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        data = {k: v for k, v in data.items() if k not in REMOVED_FIELDS}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ArmkvError(f"ARM config has unknown fields {unknown}: was it written by another armkv version?")
        return cls(**data)
