"""A layer's slot pool as kept between writes: its stored form and the cycle of a write.

Between writes the pool is stored in the form attention reads: slot keys rotated to their
read positions, free slots zero, and at inference packed to the current slot format. A
write takes it through one cycle (:meth:`SlotPool.write`):

1. grow: a pool allocated as it fills (:meth:`SlotPool.grows`) gets the free slots the
   write needs, at least doubling, up to the slots the budget buys;
2. climb: while a write would have to merge and ``slot_ladder`` has a coarser format left,
   every slot is re-packed in the next format and the pool grows to the slots that format
   holds in the same bytes (:meth:`SlotPool.climb`);
3. unpack: the write form, float keys un-rotated to pre-RoPE (:meth:`SlotPool.write_form`),
   or zeros where the write only fills free slots (:meth:`SlotPool.roomy_form`);
4. the write itself (the caller's: routing, the write plan, the gated scan);
5. restore: only the slots the write changed are rotated and re-packed
   (:meth:`SlotPool.restored`).

Reads take :meth:`SlotPool.readable`, the first ``reach`` slots (the only ones any row may
hold). The pool imports nothing from ``armkv.methods``: the cache layer (``methods.arm``)
holds one and reads it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from armkv.config import ARMConfig, slot_bytes
from armkv.memory import kernels
from armkv.memory.arena import ALIGN, carve
from armkv.memory.rope import Rotary
from armkv.memory.state import MemoryState
from armkv.memory.write import roomy_groups

# Slots a growing pool (SlotPool.grows) starts with; it doubles (at least) whenever a write
# would find too few free ones, up to the slots the budget buys.
INITIAL_SLOTS = 64


def same_layout(a: MemoryState, b: MemoryState) -> bool:
    """Whether two states have the same tensors in shape and dtype (one may be copied into the other)."""
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor) and (x.shape != y.shape or x.dtype != y.dtype):
            return False
    return True


def ladder_rungs(config: ARMConfig, head_dim: int, dtype_bytes: int) -> list[tuple[str, int]]:
    """``slot_ladder``'s formats with the slots each holds in the bytes of the pool as
    configured (``slots`` of ``slot_format``), most precise first; a format that would hold
    no more slots than the one before it is skipped. The last rung is ``slot_format``."""
    c = config
    pool_bytes = c.pool_slots * slot_bytes(c.slot_format, head_dim, dtype_bytes)
    rungs: list[tuple[str, int]] = []
    for fmt in c.ladder if c.pool == "shared" else ():  # (the paper's pool: Y slots a bucket throughout)
        slots = pool_bytes // slot_bytes(fmt, head_dim, dtype_bytes)
        if 1 <= slots < c.pool_slots and (not rungs or slots > rungs[-1][1]):
            rungs.append((fmt, slots))
    return rungs + [(c.slot_format, c.pool_slots)]


class SlotPool:
    """One layer's pool of slots, for a batch: the state as stored, the ladder of formats,
    growth, and the unpack / write / restore cycle.

    Parameters
    ----------
    memory : the layer's ARMMemory (its ``training`` flag, ``init_state``, write parameters)
    config : the run-time config (slots, pool, formats, position mode)
    rotary : the model's rotary embedding (slot keys are stored rotated to their read positions)
    head_dim, dtype_bytes : of the attention layer (the bytes a slot of each format takes)
    """

    def __init__(self, memory, config: ARMConfig, rotary: Rotary, head_dim: int, dtype_bytes: int):
        self.memory, self.config, self.rotary = memory, config, rotary
        self.head_dim, self.dtype_bytes = head_dim, dtype_bytes
        self._state: MemoryState | None = None  # [G = B x KV heads, S] as stored (see stored)
        # the pool's tensors stay where they were allocated (a compiled decode step reads and
        # writes them there): allocated whole, not grown, and a new state is copied into them
        self.fixed = False
        # where the stored state lives when someone else owns the memory (``place``): a flat
        # uint8 tensor the state's tensors are views of, sized for the largest rung; None: its own
        self.region: torch.Tensor | None = None
        self.model_dtype: torch.dtype | None = None  # the dtype "model"-format slots are packed from
        self.reach = 0  # slots from index `reach` on are free in every row: reads stop there
        self._read_view: tuple[MemoryState, MemoryState] | None = None  # (state, its first `reach` slots)
        self.rungs = ladder_rungs(config, head_dim, dtype_bytes)  # (slot format, slots), the last config's own
        self.rung = 0
        self.reserve: torch.Tensor | None = None  # bytes held beside an earlier rung (_reserve_ladder_bytes)
        self.skip_roomy_unpack = True  # False: every write un-packs the pool (roomy_form's reference)
        # read_summaries: the buckets whose slots the writes changed since take_dirty ([G, N_b] bool), None: all
        self.dirty: torch.Tensor | None = None

    @property
    def state(self) -> MemoryState | None:
        """The slots as stored between writes (:meth:`stored`)."""
        return self._state

    @state.setter
    def state(self, state: MemoryState | None) -> None:
        """A new state; in a ``fixed`` pool of the same layout, copied into the tensors it
        has (a new object all the same: what a read keeps is keyed on the state object)."""
        old = self._state
        if self.region is not None and state is not None:
            self._state = self._into_region(state)
            return
        if self.fixed and old is not None and state is not None and state is not old and same_layout(old, state):
            moved = {}
            for f in dataclasses.fields(state):
                held, new = getattr(old, f.name), getattr(state, f.name)
                if isinstance(held, torch.Tensor):
                    if held is not new:
                        held.copy_(new)
                    moved[f.name] = held
            state = dataclasses.replace(state, **moved)
        elif self.fixed and state is not None and state is not old and old is not None:
            # (new tensors: a ladder climb re-packs the pool; a compiled step reads them where they are)
            for tensor in self.tensors_of(state).values():
                torch._dynamo.mark_static_address(tensor)
        self._state = state

    def place(self, region: torch.Tensor) -> None:
        """Keep the stored state in ``region`` (a flat uint8 tensor of :meth:`region_bytes`),
        before :meth:`start`: allocated whole (``fixed``), every state the pool takes is laid
        out in it (views) and a ladder climb re-lays it there; the pool holds no tensor of its own."""
        self.region, self.fixed = region, True

    def region_bytes(self, groups: int) -> int:
        """Bytes a region for ``groups`` rows (batch x KV heads) needs: the largest rung's state
        (what the pool holds at most, the ladder's reserve included) and the alignment of its tensors."""
        largest = groups * max(slots * slot_bytes(fmt, self.head_dim, self.dtype_bytes) for fmt, slots in self.rungs)
        return largest + ALIGN * 8

    def _into_region(self, state: MemoryState) -> MemoryState:
        """``state`` with its tensors as views of :attr:`region` (copied there where they are not yet)."""
        named = self.tensors_of(state)
        views = carve(self.region, {name: (tuple(t.shape), t.dtype) for name, t in named.items()})
        lo, hi = self.region.data_ptr(), self.region.data_ptr() + self.region.nbytes
        moving = {
            name: t.clone() if lo <= t.data_ptr() < hi else t  # (in the region elsewhere: read before it is written)
            for name, t in named.items()
            if t.data_ptr() != views[name].data_ptr() or t.stride() != views[name].stride()
        }
        for name, t in moving.items():
            views[name].copy_(t)
        return dataclasses.replace(state, **views)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored state's tensors by name (empty before :meth:`start`)."""
        return {} if self._state is None else self.tensors_of(self._state)

    @staticmethod
    def tensors_of(state: MemoryState) -> dict[str, torch.Tensor]:
        fields = ((f.name, getattr(state, f.name)) for f in dataclasses.fields(state))
        return {name: t for name, t in fields if isinstance(t, torch.Tensor)}

    def take_dirty(self) -> torch.Tensor | None:
        """The buckets whose slots changed (a slot written, merged, freed or moved to another
        bucket) since the last call, [G, N_b] bool, or None where any may have (a new pool, a
        re-pack, a write in training); counting starts afresh. Tracked only under
        ``read_summaries``, whose entries of unchanged buckets carry over from write to write."""
        dirty = self.dirty
        G, nb = self.state.count.shape[0], self.memory.router.num_buckets
        self.dirty = torch.zeros(G, nb + 1, dtype=torch.bool, device=self.state.count.device)
        return None if dirty is None else dirty[:, :nb]

    def _mark_dirty(
        self, before: MemoryState | None = None, after: MemoryState | None = None, changed: torch.Tensor | None = None
    ) -> None:
        """Add the buckets of the ``changed`` slots [G, S] (each slot's bucket before and after
        the write) to :attr:`dirty`; no ``changed``: every bucket."""
        if not self.config.read_summaries or self.dirty is None:
            return
        if changed is None:
            self.dirty = None
            return
        nb = self.memory.router.num_buckets
        for bucket in (before.bucket, after.bucket):  # (free slots, -1, in the last column)
            self.dirty.scatter_(1, torch.where(changed & (bucket >= 0), bucket.long(), nb), True)

    @property
    def slots(self) -> int:
        """The slots the budget buys on the current rung (a growing pool allocates them as it fills)."""
        return self.rungs[self.rung][1]

    @property
    def slot_format(self) -> str:
        """The format the slots are stored in now (``slot_format`` unless a ladder's earlier rung)."""
        return self.rungs[self.rung][0]

    @property
    def work_dtype(self) -> torch.dtype:
        """The dtype the memory computes in: its parameters' (float32), whatever the model's."""
        return self.memory.router.weight.dtype

    def start(self, batch: int, model_dtype: torch.dtype, device: torch.device) -> None:
        """Allocate the empty pool for ``batch`` rows of a model in ``model_dtype``."""
        self.model_dtype = model_dtype
        self.rung = len(self.rungs) - 1 if self.memory.training else 0  # (training keeps the model's dtype)
        slots = self.rungs[self.rung][1]
        if self.grows():
            slots = min(slots, INITIAL_SLOTS)
        config = dataclasses.replace(self.config, slots=slots)
        self.state = self.stored(self.memory.init_state(batch, self.work_dtype, device, config))
        self.reach = 0
        self.dirty = None
        self._reserve_ladder_bytes()

    def nbytes(self) -> int:
        """Bytes the pool holds: the stored state and the ladder's reserve (placed: its region's
        largest rung, the bytes it holds from the start)."""
        if self.region is not None:
            return max(self.state.nbytes(), self.region_bytes(self.state.groups) - ALIGN * 8)
        return self.state.nbytes() + (0 if self.reserve is None else self.reserve.nbytes)

    # ------------------------------------------------------------------ the write cycle
    def write(self, keys: torch.Tensor, valid: torch.Tensor, write: Callable[[MemoryState], MemoryState]) -> None:
        """One write through the cycle of the module docstring. ``write`` maps the pool in
        its write form (float, pre-RoPE keys, this write's own: at inference it may be
        filled in place) to the state after the write.

        keys : [B, H, N, d] the tokens written, in the work dtype (their shape and dtype
            size the unpacked pool); valid : [B, N]
        """
        dtype = keys.dtype
        packed = self.state
        if self.grows():
            packed = self.grow(packed, valid, dtype)
        if self.rung < len(self.rungs) - 1:
            packed = self.climb(packed, valid, dtype)
        if self.skip_roomy_unpack and self.roomy(packed, keys, valid):
            state = self.roomy_form(packed, dtype)
        else:
            state = self.write_form(packed, dtype)
        written = write(state)
        if self.memory.training:
            self._mark_dirty()
        self.state = self.stored(written) if self.memory.training else self.restored(packed, state, written)
        # writes fill the lowest free slots first, so the occupied slots stay (mostly) a prefix
        occupied = (written.count > 0).any(0).nonzero()
        self.reach = int(occupied[-1, 0]) + 1 if occupied.numel() else 0

    def grows(self) -> bool:
        """Whether the pool is allocated as it fills rather than at once: at inference, in the
        shared pool under lazy merging with the similarity scorer (not fifo). There a write
        whose tokens all find free slots puts each in the lowest free one, whatever else the
        pool holds (``write.roomy_groups``), so free slots past the last one used change
        nothing, and :meth:`grow` adds them only before a write that needs them."""
        c, mem = self.config, self.memory
        return (
            not mem.training
            and not self.fixed  # (a fixed pool is allocated whole: the same writes, the same reads)
            and c.pool == "shared"
            and c.lazy_merge
            and c.write != "fifo"
            and mem.writes.scorer_kind == "similarity"
        )

    def grow(self, packed: MemoryState, valid: torch.Tensor, dtype: torch.dtype) -> MemoryState:
        """The stored state with free slots appended so that every group has room for the
        most valid tokens a row writes now (as :meth:`climb` counts room), at least
        doubling it, never past the slots of the current rung (the budget's); unchanged where
        it has that room or is whole already."""
        G, S = packed.count.shape
        whole = self.slots
        if S >= whole:
            return packed
        short = int(valid.sum(1).max()) - int((packed.count == 0).sum(1).min())
        if short <= 0:
            return packed
        extra = min(whole, max(2 * S, S + short)) - S
        free = self.stored(MemoryState.empty(G, extra, self.head_dim, dtype, packed.count.device))
        along = -1 if packed.key_scale is not None else 1  # quantised keys are channel-major [G, width, S]
        grown = dataclasses.replace(
            packed,
            key=torch.cat([packed.key, free.key], along),
            **{
                name: torch.cat([getattr(packed, name), getattr(free, name)], 1)
                for name in ("value", "pos", "count", "bucket", "key_scale", "value_scale")
                if getattr(packed, name) is not None
            },
        )
        self.state = grown
        self._reserve_ladder_bytes()
        return grown

    def _reserve_ladder_bytes(self) -> None:
        """Hold, beside a ladder rung's whole state, the bytes that make every rung's footprint
        the same (the largest rung's: their slot counts round the same pool bytes down to whole
        slots of different sizes), so that a full pool's size does not depend on the rung it
        reached. Nothing without a ladder, in training, or while the pool is still growing."""
        st = self.state
        if self.region is not None or len(self.rungs) == 1 or self.memory.training or st.slots < self.slots:
            self.reserve = None
            return
        target = st.groups * max(slots * slot_bytes(fmt, self.head_dim, self.dtype_bytes) for fmt, slots in self.rungs)
        self.reserve = torch.empty(max(0, target - st.nbytes()), dtype=torch.uint8, device=st.count.device)

    def climb(self, packed: MemoryState, valid: torch.Tensor, dtype: torch.dtype) -> MemoryState:
        """Climb ``slot_ladder`` while a write of these tokens would have to merge (some row of
        the pool has fewer free slots than it has tokens to write): every slot is re-packed in
        the next rung's format and the pool grows to the slots that format holds in the same
        bytes, the new ones free. Nothing merges while a cheaper format still has room, so a
        context that fits keeps the more precise codes throughout."""
        need = int(valid.sum(1).max())
        while self.rung < len(self.rungs) - 1 and int((packed.count == 0).sum(1).min()) < need:
            self.rung += 1
            fmt, slots = self.rungs[self.rung]
            floats = packed.unpack(dtype)  # the read form: keys rotated, free slots zero
            G, S, d = floats.key.shape
            extra = slots - S

            def grow(t: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
                return torch.cat([t, t.new_full((G, extra, *t.shape[2:]), fill)], 1)

            packed = MemoryState(
                key=grow(floats.key),
                value=grow(floats.value),
                pos=grow(floats.pos),
                count=grow(floats.count),
                bucket=grow(floats.bucket, -1),
            ).pack(fmt, mix=self.config.slot_mixing)
            self.state = packed
            self._reserve_ladder_bytes()
            self._mark_dirty()  # (every slot re-packed)
        return packed

    def roomy(self, packed: MemoryState, keys: torch.Tensor, valid: torch.Tensor) -> bool:
        """True when this write only fills free slots (``write.roomy_groups`` in every group,
        at inference, lazy merging, not fifo): the write plan then gives each token its own
        free slot without looking at any stored slot. keys [B, H, N, d]; valid [B, N]."""
        c, mem = self.config, self.memory
        if mem.training or not c.lazy_merge or c.write == "fifo":
            return False
        B, H, N = keys.shape[:3]
        group_valid = valid.unsqueeze(1).expand(B, H, N).reshape(B * H, N)  # as ARMMemory.write groups them
        roomy = roomy_groups(packed, group_valid, mem.writes, c.slots_per_bucket)
        return roomy is not None and bool(roomy.all())

    def roomy_form(self, packed: MemoryState, dtype: torch.dtype) -> MemoryState:
        """:meth:`write_form` for a roomy write (:meth:`roomy`): zero keys and values in
        place of un-packing the pool. The write reads only the free slots it fills (zero in
        both forms) and :meth:`restored` keeps the stored codes of every slot it did not
        change, so the state after the write is the same (tested against ``write_form``)."""
        G, S = packed.count.shape
        zeros = torch.zeros(G, S, self.head_dim, dtype=dtype, device=packed.count.device)
        return dataclasses.replace(
            packed,
            key=zeros,
            value=zeros.clone(),
            bucket=packed.bucket.long(),
            key_scale=None,
            value_scale=None,
            mixed=False,
        )

    def write_form(self, packed: MemoryState, dtype: torch.dtype, fused: bool = True) -> MemoryState:
        """The stored state as writes use it: float keys un-rotated to pre-RoPE, float values,
        int64 buckets. Slots with int4 values (k4v4, the default, and k8v4) of float32 on a CPU go through the
        fused kernel (``armkv.memory.kernels``: one pass for dequantising, unmixing and
        un-rotating) unless ``fused=False``; the PyTorch ops are its reference."""
        positions = self.read_positions(packed)
        d = packed.value.shape[-1] * 2
        module = None
        if (
            fused
            and packed.key.dtype in (torch.uint8, torch.int8)
            and packed.value.dtype == torch.uint8
            and dtype == torch.float32
            and packed.key.device.type == "cpu"
            and (not packed.mixed or d & (d - 1) == 0)  # Hadamard mixing only
        ):
            module = kernels.int4_read()  # (codes carry no gradient)
        if module is None:
            stored = packed.unpack(dtype)
            return dataclasses.replace(stored, key=self.rotary.unrotate(stored.key, positions))
        G, S = packed.count.shape
        cos, sin = (t.expand(G, S, -1) for t in self.rotary.half_cos_sin(positions, dtype))
        key, value = module.int4_unpack_pre_rope(
            packed.key, packed.key_scale, packed.value, packed.value_scale, cos, sin, packed.mixed, self.rotary.scaling
        )
        return dataclasses.replace(
            packed, key=key, value=value, bucket=packed.bucket.long(), key_scale=None, value_scale=None, mixed=False
        )

    def restored(self, packed: MemoryState, before: MemoryState, after: MemoryState) -> MemoryState:
        """:meth:`stored` of ``after`` that re-rotates and re-packs only the slots the write
        changed, copying their codes into ``packed`` (the state as stored before the write) in
        place; every other slot keeps the codes it has. Equal to ``stored(after)``
        (tests/test_arm_method.py). A changed slot has a new count or position: a write adds
        to its count, a merge adds to one count and frees the other (count 0), and a freed
        slot filled again in the same write holds a later position than anything stored."""
        G, S, d = after.key.shape
        changed = (after.count != before.count) | (after.pos != before.pos)
        self._mark_dirty(before, after, changed)
        rows = changed.view(-1).nonzero().squeeze(1)  # [n] flat indices g * S + s
        fresh = self.stored(
            MemoryState(
                key=after.key.reshape(G * S, d).index_select(0, rows).unsqueeze(0),
                value=after.value.reshape(G * S, d).index_select(0, rows).unsqueeze(0),
                pos=after.pos.reshape(-1).index_select(0, rows).unsqueeze(0),
                count=after.count.reshape(-1).index_select(0, rows).unsqueeze(0),
                bucket=after.bucket.reshape(-1).index_select(0, rows).unsqueeze(0),
            )
        )
        parts = {}
        for name in ("key", "value", "key_scale", "value_scale"):
            old, new = getattr(packed, name), getattr(fresh, name)
            if old is None:
                continue
            if name == "key" and packed.key_scale is not None:  # channel-major codes [G, width, S]
                old[rows // S, :, rows % S] = new[0].transpose(0, 1)
                parts[name] = old
            else:
                row_shape = old.shape[2:]  # (explicit: a write may change no slot at all, rows empty)
                parts[name] = (
                    old.view(G * S, *row_shape).index_copy_(0, rows, new.view(rows.numel(), *row_shape)).view(old.shape)
                )
        return dataclasses.replace(
            packed, pos=after.pos, count=after.count, bucket=after.bucket.to(packed.bucket.dtype), **parts
        )

    def stored(self, state: MemoryState) -> MemoryState:
        """The state as kept between writes, in the form attention reads: slot keys rotated
        to their read positions, free slots zero, and at inference packed to ``slot_format``
        (in training kept in the model's dtype, "model": int8 codes would cut the gradient). Writes
        undo the rotation (:meth:`write_form`); an unchanged slot packs to the same codes again."""
        occupied = (state.count > 0).unsqueeze(-1)
        key = self.rotary.rotate(state.key, self.read_positions(state)).masked_fill(~occupied, 0.0)
        state = dataclasses.replace(state, key=key, value=state.value.masked_fill(~occupied, 0.0))
        if self.memory.training:
            return state.pack("model")
        return state.pack(self.slot_format, mix=self.config.slot_mixing, dtype=self.model_dtype)

    def read_positions(self, state: MemoryState) -> torch.Tensor:
        """Where each slot's key is rotated to for reading: its count-weighted position
        ("stored"), or just before the window ("fixed": q.R(p - delta)k_pre = q_pre.R(-delta)k_pre)."""
        if self.config.position_mode == "stored":
            return state.pos
        return torch.full((1, 1), -float(self.config.window + 1), device=state.pos.device)

    # ------------------------------------------------------------------ reads
    def readable(self, whole: bool = False) -> MemoryState:
        """The state's first ``reach`` slots (at least one), the only ones any row may hold
        (views where they are contiguous): a read over them equals a read over all, the free
        slots past them taking no weight. Kept until the state is replaced. ``whole``: every
        slot (a compiled step's static shape)."""
        st = self.state
        if whole:
            return st
        if self._read_view is not None and self._read_view[0] is st:
            return self._read_view[1]
        view = st.first(max(self.reach, 1))
        self._read_view = (st, view)
        return view
