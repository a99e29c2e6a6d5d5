"""The read of one ARM layer's memory: which slots a query reads, by which path and backend.

One :class:`Reader` per layer, beside its :class:`~armkv.memory.pool.SlotPool`. A read is one
softmax over [sinks + window + waiting tokens | the slots of the query's top-M buckets (every
slot at M = N_b) | the chunk, causally]. What a read needs of the pool (its readable slots,
their logit bias, the bucket index and its pages, the skipped units' summaries, the fused call
bound to them) changes only when a write replaces the pool's state: it is kept in one
:class:`ReadView` per state, made as reads ask and dropped at the next write.

Paths (:data:`PATHS`, one table picks the first whose rule holds):

- ``dense``: one decoded token reading every bucket, written for one query (nothing the size
  of the state copied);
- ``sparse``: at M < N_b, a short read that gathers each query's buckets' slots (one
  decoded token with ``read_rank="best"`` / ``"partial"``: ranked and read in one call);
- ``ranked``: at M < N_b, a chunk ranked by ``"best"`` whose every slot's logit serves both
  the ranking and the softmax;
- ``masked``: the whole pool under a mask of each query's buckets (every other path's
  reference, and the path of training, ``position_mode="fixed"`` and compiled steps).

Backends (:data:`BACKENDS`, named as fla names its kernels' paths): ``cpu``, the C++ kernels of
``armkv.memory.kernels`` (float32 on a CPU); ``triton``, ``armkv.memory.triton`` where it
imports (CUDA); ``reference``, PyTorch ops everywhere else (gradients, other dtypes, compiled
graphs). The float64 naive read every path is tested against lives in ``memory/naive.py``.

Benchmarks and evals time or observe the reads through :meth:`Reader.hooks`, a context
manager that puts wrappers over ``read`` or ``dense`` and always takes them off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import warnings
from collections.abc import Callable

import torch

from armkv.memory import kernels
from armkv.memory.quant import at_least_float32, mixing_matrix
from armkv.memory.read import (
    BucketIndex,
    bucket_best,
    bucket_best_of_keys,
    bucket_index,
    bucket_slot_mask,
    carried_units,
    dense_decode_call,
    fused_sparse_decode_read,
    index_summaries,
    paged_index,
    partial_row_count,
    partial_rows,
    ranked_chunk_read,
    ranked_decode_call,
    read_slots,
    run_breaks,
    slot_units,
    slots_of_buckets,
    sort_by_bucket,
    unit_summaries,
    units_read,
)
from armkv.memory.state import MemoryState
from armkv.methods.adapters import max_runs, relay_breaks
from armkv.methods.attention import decode_scores, decode_values, joint_attention, safe_softmax

# Reads of at most this many tokens at M < N_b gather their buckets' slots (the sparse path);
# longer chunks mask the whole pool (the gathered copies grow with the tokens; at 64 tokens and
# a full pool of budget 4096 the gathered read measured 2.5-2.9x faster than the masked one,
# `armkv bench ops`)
SPARSE_MAX_QUERIES = 64


# ---------------------------------------------------------------------- backends
@dataclasses.dataclass(frozen=True)
class Backend:
    """A set of fused kernels: the device and query dtypes it serves, the fused calls it has
    (``dense``, ``best``, ``partial``, ``sparse``: the decode reads' ``DecodeCall`` kinds;
    ``route``: the tree's routing of one token; ``chunk``: a chunk's ranked read) and how its
    module is loaded (None where it cannot be: not built, not installed)."""

    name: str
    device: str
    dtypes: tuple[torch.dtype, ...]
    calls: frozenset[str]
    load: Callable[[], object | None]


_triton = None  # (the module, or False once its import failed)


def _load_triton():
    """``armkv.memory.triton`` where it imports (triton installed, a CUDA build), else None."""
    global _triton
    if _triton is None:
        try:
            module = importlib.import_module("armkv.memory.triton")
            _triton = module if hasattr(module, "DecodeCall") else False
        except ImportError:
            _triton = False
    return _triton or None


BACKENDS = (
    Backend(
        "cpu",
        "cpu",
        (torch.float32,),
        frozenset({"dense", "best", "partial", "sparse", "route", "chunk"}),
        kernels.int4_read,
    ),
    Backend(
        "triton",
        "cuda",
        (torch.float32, torch.float16, torch.bfloat16),
        frozenset({"dense", "best", "partial", "sparse"}),
        _load_triton,
    ),
)


def backend(call: str, x: torch.Tensor, codes: torch.Tensor | None = None) -> tuple[str, object | None]:
    """The backend that serves the fused ``call`` on ``x`` (a query, or a chunk's inputs) over
    int4 ``codes`` (uint8 value codes, where the call reads the slots): (its name, its module),
    or ("reference", None) for the PyTorch ops: kernels turned off (``ARMKV_KERNELS=0``), a
    compiled graph being traced, a gradient wanted, codes of another form or device, or no
    backend for the device and dtype (or its module did not load)."""
    if (
        not kernels.enabled()
        or (torch.is_grad_enabled() and x.requires_grad)
        or (codes is not None and (codes.dtype != torch.uint8 or codes.device.type != x.device.type))
    ):
        return "reference", None
    for b in BACKENDS:
        if b.device == x.device.type and x.dtype in b.dtypes and call in b.calls:
            module = b.load()
            return (b.name, module) if module is not None else ("reference", None)
    return "reference", None


def has_backend(device: torch.device) -> bool:
    """Whether fused sparse reads serve on ``device`` (a CPU's kernels, or triton on CUDA)."""
    return device.type == "cpu" or (device.type == "cuda" and _load_triton() is not None)


# ---------------------------------------------------------------------- paths
@dataclasses.dataclass(frozen=True)
class Ask:
    """What picks a read's path: one token or a short read, every bucket read, whether it may
    skip buckets (at inference, stored positions, fewer buckets than all), the ranking, and
    whether skipped units are summarised."""

    one: bool  # one token
    short: bool  # at most SPARSE_MAX_QUERIES tokens
    every: bool  # every bucket, no per-query mask
    top_m: bool  # may skip the pool's other buckets instead of masking them
    stored: bool  # position_mode="stored"
    rank: str  # read_rank
    summarised: bool  # read_summaries


# The first row whose rule holds reads (Reader.path)
PATHS: tuple[tuple[str, Callable[[Ask], bool]], ...] = (
    ("dense", lambda a: a.one and a.every and a.stored),
    # gathered: a short read ("best" / "partial": one token; a chunk scores every slot to rank anyway)
    ("sparse", lambda a: a.top_m and (a.one or (a.short and a.rank == "tree" and not a.summarised))),
    ("ranked", lambda a: a.top_m and a.rank != "tree" and not (a.one and a.summarised)),
    ("masked", lambda a: True),
)


def pick_path(ask: Ask) -> str:
    """The path :data:`PATHS` gives ``ask``."""
    return next(name for name, rule in PATHS if rule(ask))


_warned_slow_sparse = False


def warn_slow_sparse_reads(m: int, num_buckets: int, device: torch.device, training: bool) -> None:
    """Once a process: reads of M < N_b buckets at inference on a device with no fused sparse
    backend run as PyTorch ops, slower than reading every bucket (docs/evaluation.md)."""
    global _warned_slow_sparse
    if _warned_slow_sparse or training or m >= num_buckets or torch.compiler.is_compiling() or has_backend(device):
        return
    _warned_slow_sparse = True
    warnings.warn(
        f"armkv: ARM reads {m} of {num_buckets} buckets on {device.type} with PyTorch ops (its fused sparse kernels "
        "run on CPUs, and on CUDA with armkv's triton kernels installed); there this was slower than reading every "
        "bucket (2.8-3.8x on an H200, docs/evaluation.md). For speed on this device read every bucket (the default: "
        "top_m=adaptive with a shipped adapter).",
        RuntimeWarning,
        stacklevel=3,
    )


# ---------------------------------------------------------------------- the view of one state
class ReadView:
    """What the reads need of one pool state, made as they ask and dropped with the state: its
    logit bias, its bucket index and pages, its units' summaries, and the fused decode calls
    bound to them ((M, call) each)."""

    __slots__ = ("state", "bias", "index", "pages", "summaries", "dense", "ranked")

    def __init__(self, state: MemoryState):
        self.state = state
        self.bias: torch.Tensor | None = None  # [B, H, S] float32, -inf for free slots
        self.index: BucketIndex | None = None
        self.pages: BucketIndex | None = None  # read_pages: the index's pages
        self.summaries: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.dense = None  # (M, the bound dense call)
        self.ranked = None  # (M, the bound best / partial call)


class Reader:
    """The reads of one layer's memory.

    Parameters
    ----------
    pool : the layer's SlotPool (its state is read, and re-laid by bucket where reads gain)
    memory : the layer's ARMMemory (the router and its buckets)
    config : the run-time ARMConfig (ranking, pages, summaries, positions)
    rotary : the model's rotary embedding
    num_kv_heads : H

    The buckets each row reads are the layer's choice (:meth:`choose`): ``m`` [B], ``mix``
    (the soft cascade's weight of Top(M + 1) while training, else None), ``route_k`` (the
    buckets routed per query: the largest M, +1 for the mix) and ``reads_all``.
    """

    def __init__(self, pool, memory, config, rotary, num_kv_heads: int):
        self.pool, self.memory, self.config, self.rotary = pool, memory, config, rotary
        self.num_kv_heads = num_kv_heads
        # the layer decodes through a compiled step (``ARMLayer.compile_decode``): while traced,
        # its reads take static shapes (the whole pool) and keep no Python caches
        self.compiled = False
        self.mixing: torch.Tensor | None = None  # [d, d] the slot mixing matrix (quant.mixing_matrix)
        self.m: torch.Tensor | None = None  # [B] buckets each row reads
        self.mix: torch.Tensor | None = None  # [B] soft-cascade weight of Top(M + 1) (training)
        self.route_k = 0  # buckets routed (and gathered by a sparse read) per query
        self.reads_all = False  # every row reads every bucket (no routing, no per-query mask)
        self.partial_rows = partial_row_count(config.partial_share, pool.head_dim)  # "partial"'s key-code rows
        # [slots read, slots occupied], summed over the decode reads and their KV heads while
        # it is a list (``armkv bench decode`` sets it): what share of the memory a read touches
        self.tally: list[int] | None = None
        self._view: ReadView | None = None
        self._paths: dict = {}  # what picks a path (Reader.path's key) -> the path
        self._take_for = None  # (m, (cap, H), units each group reads)
        self._carried = None  # (the last summaries made, their buckets' sizes): carried over at the next
        self._kept = None  # the last bound best / partial call (its runs are counted until the next)

    # ------------------------------------------------------------------ set-up
    def start(self, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """A new sequence's reads: the mixing matrix fetched once (a compiled step reads it as a tensor)."""
        self.mixing = mixing_matrix(head_dim, dtype, device)

    def choose(self, m: torch.Tensor, mix: torch.Tensor | None, route_k: int, reads_all: bool) -> None:
        """The buckets each row reads (decided by the layer once per sequence)."""
        self.m, self.mix, self.route_k, self.reads_all = m, mix, route_k, reads_all

    def path(self, tokens: int, every: bool) -> str:
        """The path a read of ``tokens`` queries takes (:data:`PATHS`); ``every``: it reads every bucket."""
        c = self.config
        key = (tokens == 1, tokens <= SPARSE_MAX_QUERIES, every, self.memory.training, self.mix is None, self.route_k)
        key += (c.position_mode, c.read_rank, c.read_summaries)  # (a config may be changed in place)
        path = self._paths.get(key)
        if path is None:
            top_m = (
                not every
                and self.mix is None
                and not self.memory.training
                and c.position_mode == "stored"
                and self.route_k < self.memory.router.num_buckets
            )
            ask = Ask(key[0], key[1], every, top_m, c.position_mode == "stored", c.read_rank, c.read_summaries)
            path = self._paths[key] = pick_path(ask)
        return path

    @contextlib.contextmanager
    def hooks(self, **wrappers: Callable):
        """Wrap :meth:`read` (every read of the layer) or :meth:`dense` (the dense decode read)
        while the block runs: each wrapper takes the reader's callable and returns the one to
        call in its place (same arguments). Taken off when the block ends, however it ends."""
        unknown = set(wrappers) - {"read", "dense"}
        if unknown:
            raise ValueError(f"Reader.hooks wraps read and dense, not {', '.join(sorted(unknown))}")
        before = {name: self.__dict__.get(name) for name in wrappers}  # (an outer block's wrappers)
        try:
            for name, wrap in wrappers.items():
                setattr(self, name, wrap(getattr(self, name)))
            yield self
        finally:
            for name, held in before.items():
                if held is None:
                    self.__dict__.pop(name, None)
                else:
                    self.__dict__[name] = held

    def forget(self) -> None:
        """Drop everything derived from the pool's state (the view with its bucket index, pages
        and bias, the bound calls and the carried summaries); the next read makes them again.
        A layer placed in an engine's storage holds nothing of its own between calls
        (``ARMLayer.settle``). The pool's read view stays: it is views of the pool's state,
        which lies in the storage."""
        self._view = self._take_for = self._carried = self._kept = None
        self.pool.dirty = None  # (read_summaries: every bucket's summary is made again)

    # ------------------------------------------------------------------ the view
    def view(self) -> ReadView:
        """The :class:`ReadView` of the pool's current state (a new one after a write)."""
        v = self._view
        if v is None or v.state is not self.pool.state:
            v = self._view = ReadView(self.pool.state)
        return v

    def nbytes(self) -> int:
        """Bytes kept beside the pool for the reads: the current state's bucket index and pages,
        the last units' summaries (kept from write to write: the unchanged buckets' entries
        carry over) and the runs of the last bound ranked call (until the next is bound)."""
        index, v = 0, self._view
        if v is not None and v.state is self.pool.state and v.index is not None:
            index = v.index.nbytes()
            if v.pages is not None:
                index += v.pages.start.nbytes + v.pages.size.nbytes
        if self._carried is not None:
            index += sum(t.nbytes for t in self._carried[0])
        if self._kept is not None:
            index += self._kept.nbytes()
        return index

    def readable(self) -> MemoryState:
        """The slots a read covers (``SlotPool.readable``): the first ``reach`` of them, or every
        slot in a compiled step (a static shape)."""
        return self.pool.readable(whole=self.compiled and torch.compiler.is_compiling())

    def slot_bias(self, count: torch.Tensor) -> torch.Tensor:
        """Each slot's logit bias: log n where ``log_count_bias`` (a slot stands for n keys), else 0."""
        return count.clamp_min(1).log() if self.config.log_count_bias else torch.zeros_like(count)

    def bias(self) -> torch.Tensor:
        """Each slot's logit bias for the read, -inf for free slots [B, H, S] float32: it changes
        only when the slots are written, so it is kept in the view."""
        if self.compiled and torch.compiler.is_compiling():  # (in the step: no Python cache)
            st = self.pool.state
            count = st.count.reshape(-1, self.num_kv_heads, st.slots)
            return at_least_float32(torch.where(count > 0, self.slot_bias(count), -torch.inf))
        v = self.view()
        if v.bias is None:
            st = self.readable()
            count = st.count.reshape(-1, self.num_kv_heads, st.slots)
            v.bias = at_least_float32(torch.where(count > 0, self.slot_bias(count), -torch.inf))
        return v.bias

    def bucket_index(self) -> BucketIndex:
        """The readable slots listed by bucket (``read.bucket_index``), built once per state. Where
        the list has drifted far from the pool's order (``read.run_breaks``: writes put new slots
        wherever a slot is free) the shared pool is first re-laid bucket by bucket
        (``read.sort_by_bucket``, a copy of the pool, every few hundred decoded tokens), so that a
        read's gathers are contiguous runs. A state's meaning does not depend on where its slots lie."""
        v = self.view()
        if v.index is not None:
            return v.index
        st, num_buckets = self.readable(), self.memory.router.num_buckets
        index = bucket_index(st.bucket, st.count > 0, num_buckets)
        if self.config.pool == "shared" and run_breaks(index) > relay_breaks(st.slots, num_buckets):
            self.pool.state = sort_by_bucket(self.pool.state, index)  # (the occupied slots stay within `reach`)
            order = torch.arange(st.slots, dtype=torch.int32, device=index.order.device).expand_as(index.order)
            index = BucketIndex(order=order, start=index.start, size=index.size, laid=True)
            v = self.view()
        v.index = index
        return index

    def page_index(self) -> BucketIndex | None:
        """With ``read_pages``, the index of the buckets' pages (``read.paged_index``), built once
        per state with the bucket index, whose first build may re-lay the pool: a read calls this
        before it looks at the slots. None without ``read_pages``."""
        if not self.config.read_pages:
            return None
        index = self.bucket_index()
        v = self.view()
        if v.pages is None:
            v.pages = paged_index(index, self.memory.router.num_buckets * self.config.page_split)
        return v.pages

    def units_index(self) -> BucketIndex:
        """What a read at M < N_b ranks and reads: the pages (``read_pages``) or the buckets."""
        return self.page_index() or self.bucket_index()

    def read_units(self) -> tuple[torch.Tensor, int]:
        """What a read at M < N_b ranks and takes, slot by slot: the tree's buckets, or with
        ``read_pages`` their pages (made again per call, not kept) -> (the unit of each slot
        [G, S], -1 for a free one; how many units)."""
        pages = self.page_index()
        if pages is None:
            st = self.readable()
            return st.bucket.reshape(-1, st.slots), self.memory.router.num_buckets
        return slot_units(pages), pages.size.shape[1]

    def units(self, m):
        """M buckets (an int or a tensor) in the units a read takes: M * page_split pages under
        ``read_pages`` (each at most 1 / page_split of the mean bucket), else M buckets."""
        return m * self.config.page_split if self.config.read_pages else m

    def summaries(self, index: BucketIndex) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``read_summaries``: the entries of ``index``'s units (buckets, or their pages) that a
        read may skip (``read.index_summaries``, in the slots' basis), made once per state and
        counted in :meth:`nbytes`. The entries of units in buckets that no write changed since
        the last ones are carried over (``SlotPool.take_dirty``, ``read.carried_units``): a
        decode step's write of ``sync`` tokens changes a few buckets, and the rest need not be
        read again."""
        sizes = self.bucket_index().size  # (built before the view is looked at: its first build may re-lay the pool)
        v = self.view()
        if v.summaries is None:
            st = self.readable()
            dirty, kept = self.pool.take_dirty(), None
            if self._carried is not None and dirty is not None and self._carried[1].shape == sizes.shape:
                pages = self.memory.router.num_buckets * self.config.page_split if self.config.read_pages else None
                kept = (self._carried[0], carried_units(dirty, self._carried[1], sizes, pages))
            v.summaries = index_summaries(st, self.bias().reshape(-1, st.slots), index, kept=kept)
            self._carried = (v.summaries, sizes)
        return v.summaries

    def _take(self, m: int, H: int) -> torch.Tensor:
        """How many units (buckets, or pages: :meth:`units`) each group reads, M of its row in
        units capped at m: [B * H] long, kept while M and m stay (a decode step reads it in
        every layer)."""
        if self._take_for is None or self._take_for[0] is not self.m or self._take_for[1] != (m, H):
            self._take_for = (self.m, (m, H), self.units(self.m).clamp_max(m).repeat_interleave(H))
        return self._take_for[2]

    def _held(self, which: str, query: torch.Tensor):
        """The fused decode call the view keeps (``which``: "dense" or "ranked") where it serves
        this read, else None: the same state and M, one query, no ``tally``, no gradient
        wanted, not while ``torch.compile`` traces (a compiled graph cannot call an extension).
        A decode step then makes one kernel call a layer and little else: in a step of the
        model each layer's Python work comes cold, and the checks and calls it skips had taken
        70-100 us a layer, about a sixth of a sparse read at 16k."""
        if torch.compiler.is_compiling():  # (first: a compiled step reads none of these Python objects)
            return None
        v = self._view
        if v is None or v.state is not self.pool.state:
            return None
        held = v.dense if which == "dense" else v.ranked
        if (
            held is None
            or held[0] is not self.m
            or self.tally is not None
            or query.shape[2] != 1
            or query.requires_grad
        ):
            return None
        return held[1]

    def _count(self, read: int, occupied: int) -> None:
        """Add one read of ``read`` of the ``occupied`` slots to ``tally``."""
        self.tally[0] += read
        self.tally[1] += occupied

    # ------------------------------------------------------------------ reads
    def read(self, query, key, value, valid, positions, scaling, exact_k, exact_v, exact_valid, reads_all):
        """A chunk's (or token's) read of the memory and the exact entries, by the path
        :meth:`path` picks. query [B, Hq, T, d] post-RoPE, key / value [B, H, T, d], valid
        [B, T], positions [B, T], exact_k / exact_v [B, H, L, d], exact_valid [B, L]; ``reads_all``:
        every bucket, no routing. Returns [B, T, Hq, d]."""
        # a decode step: the fused call bound to this state and M where it serves (:meth:`_held`),
        # checked inline (each layer's Python runs cold in a step of the model: no other work)
        if (
            (v := self._view) is not None
            and v.state is self.pool.state
            and (held := v.dense if reads_all else v.ranked) is not None
            and held[0] is self.m
            and self.tally is None
            and query.shape[2] == 1
            and not query.requires_grad
            and not torch.compiler.is_compiling()
        ):
            if not reads_all:
                return held[1](query, key, value, valid, exact_k, exact_v, exact_valid, scaling)[0]
            if self.config.position_mode == "stored" and "dense" not in self.__dict__:  # (not while hooks wrap it)
                return held[1](query, key, value, valid, exact_k, exact_v, exact_valid, scaling)
        path = self.path(query.shape[2], reads_all)
        if path == "dense":
            return self.dense(query, key, value, valid, scaling, exact_k, exact_v, exact_valid)
        if path == "sparse":
            return self.sparse(query, key, value, valid, positions, scaling, exact_k, exact_v, exact_valid)
        if path == "ranked":
            return self.ranked(query, key, value, valid, scaling, exact_k, exact_v, exact_valid)
        return self.masked(query, key, value, valid, positions, scaling, exact_k, exact_v, exact_valid, reads_all)

    def dense(self, query, key, value, valid, scaling, exact_k, exact_v, exact_valid, fused: bool = True):
        """The read of every bucket by one decoded token (stored positions): the same softmax as
        :meth:`masked`, written for one query so that nothing the size of the state is copied.
        Slots, exact entries and the token itself are scored apart and share one softmax; the
        slots are read from their codes with the scales folded into the scores and weights
        (``MemoryState.key_scores`` / ``weighted_values``), and mixed slots (``slot_mixing``)
        with the mixed query, (q Q).(k Q) = q.k, their weighted values unmixed once,
        (w V Q) Q^T = w V. Quantised slots with int4 values go through one fused call per layer
        where a backend serves (:func:`backend`: these twenty-odd small ops, each dispatched from
        Python, were a third of the step) unless ``fused=False``; the PyTorch ops below are its
        reference. Returns [B, 1, Hq, d]."""
        if fused and (call := self._held("dense", query)) is not None:
            return call(query, key, value, valid, exact_k, exact_v, exact_valid, scaling)
        B, Hq, _, d = query.shape
        H = key.shape[1]
        st = self.readable()
        S, R = st.slots, Hq // H
        if self.tally is not None:
            occupied = int((st.count > 0).sum())
            self._count(occupied, occupied)
        mix = self.mixing.to(query.dtype) if st.mixed else None
        bias = self.bias()
        kernel = backend("dense", query, st.value)[1] if fused and st.key_scale is not None else None
        if kernel is not None:  # (what the call binds changes only with the state: kept until then)
            call = dense_decode_call(kernel, st, bias, mix)
            self.view().dense = (self.m, call)
            return call(query, key, value, valid, exact_k, exact_v, exact_valid, scaling)
        q = query.reshape(B, H, R, d)  # the query heads of a KV head share its keys
        q_slots = (q if mix is None else q @ mix).reshape(B * H, R, d)
        # the logits come out of the products in the model's dtype (accumulated in float32
        # inside them) and are biased and softmaxed in float32 (no-ops for a float32 model)
        scores = torch.cat(
            [
                at_least_float32(st.key_scores(q_slots).view(B, H, R, S)) * scaling + bias.unsqueeze(2),
                at_least_float32(decode_scores(q, key, valid, scaling, exact_k, exact_valid[:, None, None, :])),
            ],
            -1,
        )
        w = safe_softmax(scores).to(query.dtype)
        from_slots = st.weighted_values(w[..., :S].reshape(B * H, R, S)).view(B, H, R, d)
        if mix is not None:
            from_slots = from_slots @ mix.T
        out = from_slots + decode_values(w[..., S:], exact_v, value, valid)
        return out.reshape(B, Hq, 1, d).transpose(1, 2)

    def masked(self, query, key, value, valid, positions, scaling, exact_k, exact_v, exact_valid, reads_all):
        """A chunk's read over the whole pool: one joint softmax over [exact | slots of the top-M
        buckets, the others masked | the chunk, causally]. Every other path's reference.
        Returns [B, T, Hq, d]."""
        c = self.config
        B, Hq, T, d = query.shape
        H = key.shape[1]
        rep = Hq // H
        if not reads_all:
            self.page_index()  # (a first paged index may re-lay the pool: before the slots are read)
        pos = positions.unsqueeze(1)
        q_pre = None if reads_all and c.position_mode == "stored" else self.rotary.unrotate(query, pos)
        # each bucket's rank, as the sparse read ranks it (the same buckets, ties included)
        best = self.bucket_scores(query, scaling) if not reads_all and c.position_mode == "stored" else None
        # mixed slots (``slot_mixing``) are read in their mixed basis: (q Q).(k Q) = q.k for
        # every key, and the output unmixed once, (w V Q) Q^T = w V. Mixing the chunk's
        # queries and the exact entries costs a few hundred rows; unmixing the slots, thousands
        mix = None
        if c.position_mode == "stored" and self.pool.state.mixed and self.pool.state.key_scale is not None:
            mix = self.mixing.to(query.dtype)
            query, key, value, exact_k, exact_v = (t @ mix for t in (query, key, value, exact_k, exact_v))
        slot_k, slot_v, occupied, bias = self.slots(unmix=mix is None)

        exact_valid_h = exact_valid.unsqueeze(1).expand(B, H, -1)
        state_valid = torch.cat([exact_valid_h, occupied], -1)
        state_bias = torch.cat([torch.zeros_like(exact_valid_h, dtype=bias.dtype), bias], -1)
        L = exact_k.shape[2]
        if c.position_mode == "stored":
            q_in, chunk_k, chunk_v = query, key, value
        else:
            # slots score with pre-RoPE queries (see slots), the rest with post-RoPE ones: both
            # ride in one dot product over [post | pre] halves, the values padded alike
            z = torch.zeros_like
            q_in = torch.cat([query, q_pre], -1)
            exact_k, exact_v = torch.cat([exact_k, z(exact_k)], -1), torch.cat([exact_v, z(exact_v)], -1)
            chunk_k, chunk_v = torch.cat([key, z(key)], -1), torch.cat([value, z(value)], -1)
        if not reads_all and c.position_mode != "stored":
            best = self.bucket_scores(q_in, scaling, slot_k)
        slot_masks = [None] if reads_all else self._masks_for(q_pre, best, occupied, rep)
        summaries = None
        if c.read_summaries and not reads_all:  # each skipped unit as one entry (read.unit_summaries)
            slot_unit, num_units = self.read_units()
            S, dk = slot_k.shape[2], slot_k.shape[-1]
            unit_k, unit_v, log_weight, unit = unit_summaries(
                slot_k.reshape(B * H, S, dk),
                slot_v.reshape(B * H, S, -1),
                bias.reshape(B * H, S),
                slot_unit.reshape(B * H, S),
                num_units,
            )
            summaries = (unit.view(B, H, S).repeat_interleave(rep, 1).reshape(B * Hq, S), num_units)  # (per query head)
            slot_k = torch.cat([slot_k, unit_k.view(B, H, num_units, dk).to(slot_k.dtype)], 2)
            slot_v = torch.cat([slot_v, unit_v.view(B, H, num_units, -1).to(slot_v.dtype)], 2)
            state_valid = torch.cat([state_valid, (log_weight > float("-inf")).view(B, H, num_units)], -1)
            state_bias = torch.cat([state_bias, log_weight.view(B, H, num_units).to(state_bias.dtype)], -1)
        state_k = torch.cat([exact_k, slot_k], 2)
        state_v = torch.cat([exact_v, slot_v], 2)
        outs = []
        for mask in slot_masks:
            state_mask = None
            if mask is not None:
                if summaries is not None:  # a unit's entry where the query skips it
                    unit, num_units = summaries
                    taken = units_read(mask.reshape(B * Hq, T, -1), unit, num_units)
                    mask = torch.cat([mask, ~taken.view(B, Hq, T, num_units)], -1)
                state_mask = torch.cat([torch.ones(B, Hq, T, L, dtype=torch.bool, device=key.device), mask], -1)
            out = joint_attention(
                q_in,
                chunk_k,
                chunk_v,
                valid,
                scaling,
                state_k,
                state_v,
                state_valid,
                state_bias,
                state_mask,
                state_clean=True,
            )
            outs.append(out[..., :d])
        out = (
            outs[0]
            if len(outs) == 1
            else self.mix.view(B, 1, 1, 1) * outs[1] + (1 - self.mix.view(B, 1, 1, 1)) * outs[0]
        )
        return out if mix is None else out @ mix.T

    def slots(self, unmix: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The slots as attention reads them: keys rotated for reading [B, H, S, d or 2d],
        values, occupied [B, H, S], logit bias [B, H, S]. ``unmix=False`` leaves mixed slots'
        keys and values as x Q (a reader that mixes its queries and the other entries alike).

        The state is stored in this read form (see ``SlotPool.stored``), so a read only
        dequantises it: a transient copy for this layer's attention, as KIVI's is, and
        nothing kept beside the budgeted state between steps."""
        c, st = self.config, self.readable()
        H, S = self.num_kv_heads, st.slots
        key, value = (t.reshape(-1, H, S, t.shape[-1]) for t in st.kv(self.pool.model_dtype, unmix=unmix))
        count = st.count.reshape(-1, H, S)
        if c.position_mode != "stored":
            # every slot stands just before the window and scores with the pre-RoPE query (the
            # second half of the joint dot product, see masked)
            key = torch.cat([torch.zeros_like(key), key], -1)
            value = torch.cat([value, torch.zeros_like(value)], -1)
        return key, value, count > 0, self.slot_bias(count)

    def _masks_for(
        self, q_pre: torch.Tensor, best: torch.Tensor | None, occupied: torch.Tensor, rep: int
    ) -> list[torch.Tensor]:
        B, Hq = q_pre.shape[:2]
        buckets = self.group_buckets(self.route_k, q_pre, best).repeat_interleave(rep, 1)
        slot_unit, units = self.read_units()
        slot_unit = slot_unit.long().reshape(B, -1, slot_unit.shape[-1]).repeat_interleave(rep, 1)
        occ = occupied.repeat_interleave(rep, 1).unsqueeze(2)
        ms = [self.m] if self.mix is None else [self.m, (self.m + 1).clamp_max(self.memory.router.num_buckets)]
        return [bucket_slot_mask(buckets, self.units(m), slot_unit, units) & occ for m in ms]

    def group_buckets(self, m: int, q_pre: torch.Tensor, best: torch.Tensor | None = None) -> torch.Tensor:
        """Each query's m buckets, one choice per KV head for its R query heads.

        ``read_rank="best"``: the m buckets with the largest ``best`` [B, H, T, N_b], each
        bucket's best logit (:meth:`bucket_scores`; with ``read_pages``, m buckets' worth of
        pages, :meth:`units`, of its pages' [B, H, T, 2 N_b page_split]). ``"tree"``: the tree's
        read routing of the pre-RoPE queries (``Router.group_topm_buckets``), scored in the
        routers' dtype. q_pre [B, Hq, T, d] -> [B, H, T, m']."""
        router = self.memory.router
        if self.config.read_rank != "tree":  # (ties to the lower bucket id, as the fused kernel breaks them)
            return best.sort(dim=-1, descending=True, stable=True).indices[..., : min(self.units(m), best.shape[-1])]
        B, Hq, T, d = q_pre.shape
        x = q_pre.reshape(B, self.num_kv_heads, -1, T, d).to(router.weight.dtype)
        return router.group_topm_buckets(x, m)[0]

    def bucket_scores(
        self, query: torch.Tensor, scaling: float, keys: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """For ``read_rank="best"`` and ``"partial"`` (None for the tree): each bucket's best
        logit, the largest over its readable slots and the KV head's R query heads of
        q.k * scaling + log n (``read.bucket_best``), in float32 from the stored codes, so that
        every read path picks the same buckets; for ``"partial"`` and one decoded token, q.k
        over the key-code rows of ``read.partial_rows`` only. query [B, Hq, T, d] post-RoPE
        (or, with ``keys`` [B, H, S, d] given, whatever the read scores those keys with)
        -> [B, H, T, N_b], -inf for an empty bucket (with ``read_pages``, [B, H, T, 2 N_b
        page_split]: each page's best logit)."""
        if self.config.read_rank == "tree":
            return None
        slot_bucket, num_buckets = self.read_units()  # (pages under read_pages)
        st = self.readable()
        B, Hq, T, d = query.shape
        H = self.num_kv_heads
        G, R, S = B * H, Hq // H, st.slots
        q = query.reshape(G, R, T, d).float()
        if keys is None and st.mixed:
            q = q @ self.mixing.float()
        bias = self.bias().reshape(G, S)
        if keys is None and T == 1:  # a decoded token: the products from the codes (the fused kernel on a CPU)
            q = q.view(G, R, d)  # ("partial": a few rows of them)
            partial = self.config.read_rank == "partial"
            scores = st.partial_key_scores(q, partial_rows(q, self.partial_rows)) if partial else st.key_scores(q)
            logits = (scores * scaling + bias.unsqueeze(1)).amax(1)
            return bucket_best(logits.unsqueeze(1), slot_bucket, num_buckets).view(B, H, 1, -1)
        if keys is None:  # a chunk: the keys dequantised once
            keys = st.kv(torch.float32, unmix=False)[0]
        best = bucket_best_of_keys(q * scaling, keys.reshape(G, S, -1).float(), bias, slot_bucket, num_buckets)
        return best.view(B, H, T, -1)

    def ranked(self, query, key, value, valid, scaling, exact_k, exact_v, exact_valid, fused: bool = True):
        """:meth:`masked` at M < N_b with ``read_rank="best"``, each slot's logit computed once
        for both the ranking and the softmax (``read.ranked_chunk_read``, in float32, a block of
        queries at a time) instead of once to rank and again under a mask of [queries, state +
        chunk]. It reads the same slots: the buckets are ranked from the same float32 logits of
        the dequantised codes as :meth:`bucket_scores`, chosen by :meth:`group_buckets` and
        masked by ``bucket_slot_mask``; where a backend serves, its kernel ranks and reads them
        (``ranked_slot_read``) unless ``fused=False``. Returns [B, T, Hq, d]."""
        B, Hq, T, d = query.shape
        H, L = key.shape[1], exact_k.shape[2]
        G, R = B * H, Hq // H
        # (the read is in float32 whatever the model's dtype)
        kernel = backend("chunk", query.float())[1] if fused else None
        # what it ranks: buckets, or their pages (read_pages); either's first build may re-lay the pool,
        # so before the slots are read
        index = self.units_index()
        if kernel is not None:  # the kernel takes the units' index
            by_kernel = (kernel, index, self._take(self.units(self.memory.router.num_buckets), H))
        else:
            by_kernel = None
            slot_unit, num_units = self.read_units()
        st = self.readable()
        S = st.slots
        slot_k, slot_v = st.kv(torch.float32, unmix=False)
        mix = self.mixing.float() if st.mixed else None

        def mixed(t: torch.Tensor) -> torch.Tensor:  # the slots' basis: (q Q).(k Q) = q.k
            return t.float() if mix is None else t.float() @ mix

        pick = None
        if by_kernel is None:
            slot_unit = slot_unit.long()
            occupied = (st.count.reshape(G, S) > 0).view(B, H, 1, S)

            def pick(logits: torch.Tensor) -> torch.Tensor:  # [G, T', S] -> the slots of each query's buckets
                best = bucket_best(logits, slot_unit, num_units).view(B, H, -1, num_units)
                buckets = self.group_buckets(self.route_k, None, best)
                return (
                    bucket_slot_mask(buckets, self.units(self.m), slot_unit.view(B, H, S), num_units) & occupied
                ).view(G, -1, S)

        summaries = None
        if self.config.read_summaries:  # each unit a query skips one entry (the PyTorch ops also need each slot's unit)
            unit = None if by_kernel is not None else torch.where(slot_unit < 0, num_units, slot_unit).reshape(G, S)
            summaries = (*self.summaries(index), unit)
        out = ranked_chunk_read(
            mixed(query).reshape(G, R, T, d),
            mixed(key).reshape(G, T, d),
            mixed(value).reshape(G, T, d),
            valid[:, None].expand(B, H, T).reshape(G, T),
            scaling,
            mixed(exact_k).reshape(G, L, d),
            mixed(exact_v).reshape(G, L, d),
            exact_valid[:, None].expand(B, H, L).reshape(G, L),
            slot_k.reshape(G, S, d),
            slot_v.reshape(G, S, d),
            self.bias().reshape(G, S),
            pick,
            fused=by_kernel,
            summaries=summaries,
        )
        if mix is not None:
            out = out @ mix.T
        return out.reshape(B, Hq, T, d).transpose(1, 2).to(query.dtype)

    def sparse(self, query, key, value, valid, positions, scaling, exact_k, exact_v, exact_valid, fused: bool = True):
        """:meth:`masked` at M < N_b with each query's slots gathered: the slots of its KV head's
        top-M buckets (``read.slots_of_buckets``), read from their stored codes
        (``read.gathered_read``). Its cost falls with M; it equals the masked read of the whole
        pool (tests/test_sparse_read.py). One decoded token where a backend serves is ranked and
        read in one fused call (best / partial), or routed, then read (tree). With
        ``read_summaries`` only the fused calls read (each skipped unit one entry, :meth:`summaries`);
        where they do not serve, the masked read does. Returns [B, T, Hq, d]."""
        if (
            fused and (call := self._held("ranked", query)) is not None
        ):  # best / partial: the call kept from the last step
            return call(query, key, value, valid, exact_k, exact_v, exact_valid, scaling)[0]
        B, Hq, T, d = query.shape
        H, M = key.shape[1], self.route_k
        G = B * H
        index = self.units_index()  # what it ranks and reads: pages (read_pages) or buckets
        st = self.readable()
        name, kernel = (
            backend("sparse", query, st.value) if fused and T == 1 and st.key_scale is not None else ("", None)
        )
        if (
            kernel is None and self.config.read_summaries
        ):  # (the skipped units' entries: the fused reads, or the masked one)
            return self.masked(
                query, key, value, valid, positions, scaling, exact_k, exact_v, exact_valid, reads_all=False
            )
        if kernel is not None:
            mix = self.mixing.to(query.dtype) if st.mixed else None
            m = self.units(min(M, self.memory.router.num_buckets))
            take = self._take(m, H)
            units = self.summaries(index) if self.config.read_summaries else None  # (the skipped units' entries)
            if self.config.read_rank in ("best", "partial"):
                # best: every slot scored once, the ranking's logits are the read's; partial: a few
                # rows of every key to rank, the chosen buckets' keys whole. What the call binds
                # changes only with the state or M: kept until then, a decode step makes the one call
                rows = self.partial_rows if self.config.read_rank == "partial" else None
                call = ranked_decode_call(kernel, st, self.bias(), mix, index, m, take, rows, units, max_runs(st.slots))
                self.view().ranked, self._kept = (self.m, call), call
                out, buckets = call(query, key, value, valid, exact_k, exact_v, exact_valid, scaling)
            else:
                buckets = None
                if name == "cpu":  # (the tree's routing of one token, un-rotated inside)
                    buckets = self.memory.router.fused_group_topm(kernel, query, positions, self.rotary, M)
                if buckets is None:
                    buckets = self.group_buckets(M, self.rotary.unrotate(query, positions.unsqueeze(1))).reshape(G, -1)
                out = fused_sparse_decode_read(
                    kernel,
                    query,
                    key,
                    value,
                    valid,
                    exact_k,
                    exact_v,
                    exact_valid,
                    st,
                    self.bias(),
                    mix,
                    scaling,
                    index,
                    buckets,
                    take,
                    units,
                )
            if self.tally is not None:
                chosen = torch.arange(buckets.shape[-1], device=buckets.device) < take.unsqueeze(1)
                self._count(int((index.size.gather(1, buckets).long() * chosen).sum()), int(index.size.sum()))
            return out
        q_pre = self.rotary.unrotate(query, positions.unsqueeze(1))
        buckets = self.group_buckets(M, q_pre, self.bucket_scores(query, scaling))  # [B, H, T, M units]
        M = buckets.shape[-1]
        take = (torch.arange(M, device=query.device) < self.units(self.m).view(B, 1, 1, 1)).expand(B, H, T, M)
        # eager on a CPU, the width these queries need (a host sync costs nothing there); compiled
        # or on an accelerator, the width any M buckets need, fixed until the next write
        eager_cpu = query.device.type == "cpu" and not torch.compiler.is_compiling()
        ids, used = slots_of_buckets(
            index, buckets.reshape(G, T, M), None if eager_cpu else index.width(M), take.reshape(G, T, M)
        )
        if self.tally is not None:
            self._count(int(used.sum()) // T, int(index.size.sum()))
        return read_slots(
            query, key, value, valid, scaling, exact_k, exact_v, exact_valid, st, self.bias(), ids, used, fused=fused
        )
