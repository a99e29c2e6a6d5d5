"""``arm``: the routed memory as a cache method, and its ablation ``fifo``.

Per layer the cache holds: the first ``sinks`` and last ``window`` tokens exact (an
:class:`ExactBuffer`), and a fixed pool of slots the tree indexes. Each chunk of new
tokens is read against [sinks | slots of the query's top-M buckets | window | the chunk,
causally] in one softmax, then committed: the tokens that leave the window are written
into the slots (chunked scan; one token at a time while decoding).

Device and dtype. The ARM parameters (router, slot scorer and gate, policy: a few hundred
KB) live on the model's device, kept in float32 whatever the model's dtype; a cache of a
model on another device than the adapter gets its own copy there (``adapters.arm_on_device``).
The memory computes in float32 (``ARMLayer.work_dtype``): routing, the top-M policy, the
write plan (cosines, merges), the gates and the blending scan, and the rotations between
read and write positions, so that a bfloat16 or float16 model routes and merges its
tokens as a float32 one would, its slots not drifting by a rounding per write. The
exact buffer, the ``"model"`` slot format and the reads stay in the model's dtype (as its
own attention does); a read's logits are biased, masked and softmaxed in float32
(``_decode_read``, and ``joint_attention``'s kernels). Quantised slots are packed from
float32 and keep bfloat16 scales whatever the model's dtype (``memory.state``). The fused
CPU kernels (``memory.kernels``) serve float32 on a CPU only; any other dtype or device
takes their PyTorch references.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

import torch

from armkv.budget import (
    LAYER_SHARE_RULES,
    adapter_layer_weights,
    layer_budget,
    parse_layer_weights,
    retrieval_layer_weights,
)
from armkv.config import ARMConfig
from armkv.errors import ArmkvError
from armkv.memory import kernels
from armkv.memory.arena import Layout, carve, layout_bytes
from armkv.memory.module import ARMModel
from armkv.memory.pool import SlotPool
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
    gather_slots,
    gathered_read,
    index_summaries,
    paged_index,
    partial_row_count,
    partial_rows,
    ranked_chunk_read,
    ranked_decode_call,
    run_breaks,
    slot_units,
    slots_of_buckets,
    sort_by_bucket,
    unit_summaries,
    units_read,
)
from armkv.memory.rope import Rotary
from armkv.memory.state import MemoryState
from armkv.memory.write import WriteRule
from armkv.methods.adapters import (
    DEFAULT_ADAPTER_ORDER,
    SHIPPED_ADAPTERS,
    arm_on_device,
    max_runs,
    relay_breaks,
    resolve_arm,
    shipped_adapter,
)
from armkv.methods.attention import decode_scores, decode_values, joint_attention, safe_softmax
from armkv.methods.base import CacheLayer, ModelInfo, register_method, require_budget
from armkv.methods.buffers import ExactBuffer

# Reads of at most this many tokens at M < N_b gather their buckets' slots (ARMLayer._sparse_read);
# longer chunks mask the whole pool (the gathered copies grow with the tokens; at 64 tokens and
# a full pool of budget 4096 the gathered read measured 2.5-2.9x faster than the masked one,
# `armkv bench ops`)
SPARSE_MAX_QUERIES = 64


_warned_slow_sparse = False


def _warn_slow_sparse_reads(m: int, num_buckets: int, device: torch.device, training: bool) -> None:
    """Once a process: reads of M < N_b buckets at inference off the CPU run as PyTorch ops (the
    fused kernels are CPU code), slower than reading every bucket (docs/evaluation.md)."""
    global _warned_slow_sparse
    if _warned_slow_sparse or training or m >= num_buckets or device.type == "cpu" or torch.compiler.is_compiling():
        return
    _warned_slow_sparse = True
    warnings.warn(
        f"armkv: ARM reads {m} of {num_buckets} buckets on {device.type} with PyTorch ops (its fused sparse kernels "
        "run on "
        "CPUs only); there this was slower than reading every bucket (2.8-3.8x on an H200, docs/evaluation.md). For "
        "speed "
        "on this device read every bucket (the default: top_m=adaptive with a shipped adapter).",
        RuntimeWarning,
        stacklevel=3,
    )


class ARMLayer(CacheLayer):
    """One layer of the ARM cache.

    Compiled decoding (``CacheLayer.compile_decode``, a compiled forward of the whole model):
    the step reads the whole pool (not only the slots up to the last one any row holds: a
    static shape), keeps the tokens that leave the window in a fixed buffer of ``sync``
    entries (the oldest first, the unfilled ones invalid and zero) instead of a growing one,
    and computes the slots' logit bias in the step. The write every ``sync`` tokens runs
    eagerly between two steps, after the one that fills the buffer (:meth:`after_decode_step`):
    the same tokens written at the same step as without compiling, into the pool's own
    tensors (``SlotPool.fixed``: allocated whole, a new state copied in place).

    Parameters
    ----------
    memory : the layer's ARMMemory (router, scorer and gate, policy)
    config : the run-time config (budget split and ablation switches)
    """

    def __init__(self, layer_idx: int, info: ModelInfo, rotary: Rotary, memory, config: ARMConfig):
        super().__init__(layer_idx, info, rotary)
        if rotary is None:
            raise ArmkvError("the arm method needs the model's rotary embedding (a RoPE model)")
        self.memory, self.config = memory, config
        self.rule = WriteRule.from_config(config)  # how the writes are decided and blended
        self.chunk = config.chunk
        self.buffer: ExactBuffer | None = None
        # the slots: their stored form, the ladder of formats, growth and the write cycle
        self.pool = SlotPool(memory, config, rotary, info.head_dim, info.dtype_bytes)
        # tokens that left the window and wait to be written (decoding writes every `sync`):
        # (keys [B, H, n, d] post-RoPE, values, valid [B, n], positions [B, n])
        self.pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.m: torch.Tensor | None = None  # [B] buckets each row reads
        self._reads_all = False  # every row reads every bucket (no routing, no per-query mask)
        self._index_for = None  # (state, its BucketIndex) for the sparse read
        self._pages_for = None  # (that BucketIndex, its pages' index): read_pages
        self._summaries_for = None  # (the units' index, their summaries, its buckets' sizes): read_summaries
        self._take_for = None  # (m, (cap, H), buckets each group reads): _take
        self._ranked_for = None  # (pool state, m, the bound fused call): _sparse_read's best / partial
        self._dense_for = None  # the same for _decode_read's fused call
        self.mix: torch.Tensor | None = None  # [B] soft-cascade weight of Top(M + 1) (training)
        self.aux: dict[str, torch.Tensor] = {}
        self.generator: torch.Generator | None = None
        self._bias_for: tuple[MemoryState, torch.Tensor] | None = None  # (state, its decode-read bias)
        self.mixing: torch.Tensor | None = None  # [d, d] the slot mixing matrix (quant.mixing_matrix)
        # compiled decoding: the tokens waiting for the write in `sync` fixed entries (keys
        # [B, H, sync, d], values, valid [B, sync], positions [B, sync]) and the steps since the write
        self.waiting: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.waiting_steps = 0
        self._route_k = (
            0  # buckets routed (and gathered by a sparse read) per query: the largest M, +1 for the training mix
        )
        self._partial_rows = partial_row_count(
            config.partial_share, info.head_dim
        )  # read_rank="partial"'s key-code rows
        # [slots read, slots occupied], summed over the decode reads and their KV heads while
        # it is a list (``armkv bench decode`` sets it): what share of the memory a read touches
        self.read_tally: list[int] | None = None
        # the layer's state in storage a serving engine owns (``place``): {name: view}, None: its own tensors
        self.placed: dict[str, torch.Tensor] | None = None
        self.placed_batch = 0

    @property
    def state(self) -> MemoryState | None:
        """The slots as stored (``SlotPool.stored``): [G = B x KV heads, S], None until the first chunk."""
        return self.pool.state

    @state.setter
    def state(self, state: MemoryState) -> None:
        self.pool.state = state

    @property
    def slots(self) -> int:
        """The slots the budget buys on the current rung (a growing pool allocates them as it fills)."""
        return self.pool.slots

    @property
    def work_dtype(self) -> torch.dtype:
        """The dtype the memory computes in: its parameters' (float32), whatever the model's."""
        return self.pool.work_dtype

    # ------------------------------------------------------------------ placed state
    def storage_layout(self, batch: int = 1) -> Layout:
        """Every tensor the layer keeps from one call to the next, for ``batch`` rows, when it
        is placed (:meth:`place`): the exact buffer (``buffer.*``: sinks and window, their
        positions, validity and ring heads), the tokens waiting for the write (``pending.*``:
        fewer than ``sync`` between calls), the slot pool's region (``pool``: the largest rung
        of the ladder) and the buckets each row reads (``m``). Keys and values first."""
        c, info = self.config, self.info
        H, d, dt = info.num_kv_heads, info.head_dim, info.dtype
        buffer = ExactBuffer.layout(c.sinks, c.window, batch, H, d, dt)
        pending = {
            "k": ((batch, H, c.sync, d), dt),
            "v": ((batch, H, c.sync, d), dt),
            "valid": ((batch, c.sync), torch.bool),
            "pos": ((batch, c.sync), torch.long),
        }
        layout: Layout = {"buffer.k": buffer.pop("k"), "buffer.v": buffer.pop("v")}
        layout.update({"pending.k": pending.pop("k"), "pending.v": pending.pop("v")})
        layout["pool"] = ((self.pool.region_bytes(batch * H),), torch.uint8)
        layout.update({f"buffer.{n}": spec for n, spec in buffer.items()})
        layout.update({f"pending.{n}": spec for n, spec in pending.items()})
        layout["m"] = ((batch,), torch.long)
        return layout

    def storage_bytes(self, batch: int = 1) -> int:
        """Bytes of the storage :meth:`place` needs for ``batch`` rows (``storage_layout``)."""
        return layout_bytes(self.storage_layout(batch))

    def place(self, storage: torch.Tensor, batch: int = 1) -> "ARMLayer":
        """Keep this layer's state for ``batch`` rows in ``storage``, a flat uint8 tensor of at
        least :meth:`storage_bytes` (e.g. a serving engine's block for one request), before its
        first chunk: every tensor the layer keeps between calls is a view of it
        (:meth:`storage_layout`) once :meth:`settle` has run after a call. The outputs and the
        state are those of the layer on its own tensors (the pool allocated whole, ``fixed``);
        ``tests/test_arm_placed.py`` compares them. Returns the layer."""
        if self.buffer is not None:
            raise ArmkvError("ARMLayer.place: the layer already holds a state; place it before its first chunk")
        if self.memory.training or self.compiled:
            raise ArmkvError("ARMLayer.place serves inference, eagerly: not in training or with a compiled decode step")
        self.placed = carve(storage, self.storage_layout(batch))
        self.placed_batch = batch
        self.pool.place(self.placed["pool"])
        return self

    def settle(self) -> None:
        """After a call, on a placed layer: move what the layer keeps to the next call into its
        storage (the waiting tokens and M) and drop what is derived from the state (the
        bucket index, the read's bound calls and slot biases: made again by the next read), so
        that it holds no tensor of its own between calls. Nothing on a layer not placed."""
        if self.placed is None or self.buffer is None:
            return
        if self.pending is not None:
            n = self.pending[0].shape[2]
            area = [self.placed[f"pending.{name}"] for name in ("k", "v", "valid", "pos")]
            if n > area[0].shape[2]:
                raise ArmkvError(
                    f"ARMLayer.settle: {n} tokens wait for the write, more than the {area[0].shape[2]} held"
                )
            views = []
            for held, t in zip(area, self.pending):
                view = held.narrow(2 if held.ndim == 4 else 1, 0, n)
                if view.data_ptr() != t.data_ptr():
                    view.copy_(t)
                views.append(view)
            self.pending = tuple(views)
        if self.m is not None and self.m.data_ptr() != self.placed["m"].data_ptr():
            self.placed["m"].copy_(self.m)
            self.m = self.placed["m"]
        self._index_for = self._pages_for = self._summaries_for = self._take_for = None
        self._ranked_for = self._dense_for = self._bias_for = None
        self.pool._read_view = None
        self.pool.dirty = None  # (read_summaries: every bucket's summary is made again)

    # ------------------------------------------------------------------ state
    def _lazy_init(self, key: torch.Tensor) -> None:
        B, H, _, d = key.shape
        c = self.config
        if self.placed is None:
            self.buffer = ExactBuffer(c.sinks, c.window, B, H, d, key.dtype, key.device)
        else:
            if B != self.placed_batch or key.dtype != self.info.dtype:
                raise ArmkvError(
                    f"ARMLayer: placed for {self.placed_batch} rows of {self.info.dtype}, given {B} of {key.dtype}"
                )
            tensors = {n: self.placed[f"buffer.{n}"] for n in ("k", "v", "valid", "pos", "head")}
            self.buffer = ExactBuffer(c.sinks, c.window, B, H, d, key.dtype, key.device, tensors=tensors)
        self.pool.start(B, key.dtype, key.device)
        self.mixing = mixing_matrix(d, key.dtype, key.device)  # (fetched once: a compiled step reads it as a tensor)
        if self.compiled:
            self.waiting = (
                key.new_zeros(B, H, c.sync, d),
                key.new_zeros(B, H, c.sync, d),
                torch.zeros(B, c.sync, dtype=torch.bool, device=key.device),
                torch.zeros(B, c.sync, dtype=torch.long, device=key.device),
            )

    static_decode = True

    def compile_decode(self) -> None:
        super().compile_decode()
        self.pool.fixed = True  # (allocated whole, written in place)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The exact buffer, the tokens waiting for the write, the pool as stored, the rows' M
        and the mixing matrix: allocated at the first chunk and updated in place by the decode
        step and by the write between steps (a ``slot_ladder`` climb re-packs the pool in the
        next format: new tensors, at most once a rung)."""
        if self.buffer is None:
            return {}
        held = {f"buffer.{name}": t for name, t in self.buffer.tensors().items()}
        held.update({f"pool.{name}": t for name, t in self.pool.tensors().items()})
        for i, t in enumerate(self.waiting or ()):
            held[f"waiting.{i}"] = t
        held.update(m=self.m, mixing=self.mixing)
        return {name: t for name, t in held.items() if t is not None}

    def decode_ready(self) -> bool:
        """Compiled steps start once the prefill is written (nothing pending) and the
        buckets each row reads are decided; training (gradients, the soft cascade) stays eager."""
        return self.buffer is not None and self.pending is None and self.m is not None and not self.memory.training

    def decode_step(self, query, key, value, valid, positions, scaling):
        """:meth:`attend_chunk` for one token with static shapes and no host sync (see the
        class docstring); the write is :meth:`after_decode_step`'s."""
        buf_k, buf_v, buf_valid, _ = self.buffer.kv()
        exact_k = torch.cat([buf_k, self.waiting[0]], 2)
        exact_v = torch.cat([buf_v, self.waiting[1]], 2)
        exact_valid = torch.cat([buf_valid, self.waiting[2]], 1)
        if self._reads_all and self.config.position_mode == "stored":
            out = self._decode_read(query, key, value, valid, scaling, exact_k, exact_v, exact_valid)
        else:
            out = self._chunk_read(
                query, key, value, valid, positions, scaling, exact_k, exact_v, exact_valid, self._reads_all
            )
        overflow = self.buffer.push(key, value, valid, positions)  # one entry a row, valid where a token left
        for held, new in zip(self.waiting, (overflow.key, overflow.value, overflow.valid, overflow.positions)):
            dim = 2 if held.ndim == 4 else 1
            held.copy_(torch.cat([held.narrow(dim, 1, held.shape[dim] - 1), new.to(held.dtype)], dim))
        return out

    def after_decode_step(self) -> None:
        """Every ``sync`` compiled steps: write the waiting tokens (eagerly) and empty the buffer."""
        self.waiting_steps += 1
        if self.waiting_steps < self.config.sync:
            return
        self.pending = tuple(t.clone() for t in self.waiting)
        self._flush()
        for t in self.waiting:
            t.zero_()
        self.waiting_steps = 0

    def state_bytes(self) -> int:
        if self.buffer is None:
            return 0
        waiting = 0 if self.pending is None else self.pending[0].nbytes + self.pending[1].nbytes
        if self.waiting is not None:  # (compiled decoding: the fixed buffer, at most `sync` tokens)
            waiting = max(waiting, self.waiting[0].nbytes + self.waiting[1].nbytes)
        index = 0
        if self._index_for is not None and self._index_for[0] is self.state:
            units = self._index_for[1]
            index = units.nbytes()
            if self._pages_for is not None and self._pages_for[0] is units:
                units = self._pages_for[1]
                index += units.start.nbytes + units.size.nbytes
        if self._summaries_for is not None:  # (kept from write to write: the unchanged buckets' entries carry over)
            index += sum(t.nbytes for t in self._summaries_for[1])
        if self._ranked_for is not None:  # (the bound call's runs of slots, kept until the next one is bound)
            index += self._ranked_for[2].nbytes()
        return self.buffer.state_bytes() + self.pool.nbytes() + waiting + index

    # ------------------------------------------------------------------ attention
    def attend_chunk(self, query, key, value, valid, positions, scaling):
        c = self.config
        T = query.shape[2]
        out = self._read_chunk(query, key, value, valid, positions, scaling)

        # commit: tokens leaving the window wait, then go into the slots together: at the end
        # of every prefill chunk, and every `sync` tokens while decoding
        overflow = self.buffer.push(key, value, valid, positions)
        if overflow.key.shape[2] > 0:
            new = (overflow.key, overflow.value, overflow.valid, overflow.positions)
            self.pending = (
                new
                if self.pending is None
                else tuple(torch.cat([a, b], 2 if a.ndim == 4 else 1) for a, b in zip(self.pending, new))
            )
        if self.pending is not None and (T > 1 or self.pending[0].shape[2] >= c.sync):
            self._flush()
        return out

    def peek_chunk(self, query, key, value, valid, positions, scaling):
        """What :meth:`attend_chunk` returns for these tokens, without committing them: the
        state is left as it was (M, if not yet decided, stays undecided: the whole first chunk
        decides it). A serving engine that schedules the first part of a chunk reads it so, and
        gives the whole chunk to :meth:`attend_chunk` once it is complete (``armkv.vllm``)."""
        undecided = self.m is None
        try:
            return self._read_chunk(query, key, value, valid, positions, scaling)
        finally:
            if undecided:
                self.m, self.mix, self._reads_all, self._route_k = None, None, False, 0
                self.aux.pop("budget", None)

    def _read_chunk(self, query, key, value, valid, positions, scaling):
        """:meth:`attend_chunk`'s read: [state | the chunk, causally], the state unchanged."""
        if self.buffer is None:
            self._lazy_init(key)
        c = self.config
        T = query.shape[2]
        if self.m is None:
            self._decide_m(self.rotary.unrotate(key.to(self.work_dtype), positions.unsqueeze(1)), valid)

        exact_k, exact_v, exact_valid = self._exact()
        # which slots each query reads: those of its top-M buckets (M per row); reading every
        # bucket needs no routing and no per-query mask (state_valid already drops free slots)
        # (decided once per sequence with M, so the decode step has no host sync here)
        reads_all = self.mix is None and self._reads_all
        if T == 1 and reads_all and c.position_mode == "stored":
            out = self._decode_read(query, key, value, valid, scaling, exact_k, exact_v, exact_valid)
        else:
            out = self._read(query, key, value, valid, positions, scaling, exact_k, exact_v, exact_valid, reads_all)
        return out

    def _read(
        self, query, key, value, valid, positions, scaling, exact_k, exact_v, exact_valid, reads_all
    ) -> torch.Tensor:
        """A read of the slots (the decode step's dense read aside): at M < N_b gathered
        (:meth:`_sparse_read`) or ranked (:meth:`_ranked_chunk_read`) where either serves,
        else masked over the whole pool (:meth:`_chunk_read`, their reference). With
        ``read_summaries`` (each unit a read skips one entry of its softmax) a decoded token
        takes the sparse read (fused; where the kernels do not serve, the masked read), a chunk
        ranked by its logits the ranked read, any other read the masked one."""
        if (
            not reads_all and (call := self._held(self._ranked_for, query)) is not None
        ):  # (a decode step: _sparse_read's call)
            return call(query, key, value, valid, exact_k, exact_v, exact_valid, scaling)[0]
        T, summarised = query.shape[2], self.config.read_summaries
        if self._reads_sparse(T, reads_all) and (T == 1 or not summarised):
            return self._sparse_read(query, key, value, valid, positions, scaling, exact_k, exact_v, exact_valid)
        if self._reads_ranked(reads_all) and (T > 1 or not summarised):
            return self._ranked_chunk_read(query, key, value, valid, scaling, exact_k, exact_v, exact_valid)
        return self._chunk_read(query, key, value, valid, positions, scaling, exact_k, exact_v, exact_valid, reads_all)

    def _exact(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The exact part of the state: sinks, window and the tokens waiting to be written
        (keys [B, H, L, d], values, valid [B, L]). Entries that hold no valid token are zero
        (the buffer and its overflow keep them so, and free slots are stored zero), so the
        attention need not mask them out of its products."""
        exact_k, exact_v, exact_valid, _ = self.buffer.kv()
        if self.pending is not None:
            exact_k = torch.cat([exact_k, self.pending[0]], 2)
            exact_v = torch.cat([exact_v, self.pending[1]], 2)
            exact_valid = torch.cat([exact_valid, self.pending[2]], 1)
        return exact_k, exact_v, exact_valid

    def _decode_read(
        self, query, key, value, valid, scaling, exact_k, exact_v, exact_valid, fused: bool = True
    ) -> torch.Tensor:
        """The decode step's read when every bucket is read (one token, stored positions): the
        same softmax as :meth:`_chunk_read`, written for one query so that nothing the size of
        the state is copied. Slots, exact entries and the token itself are scored apart and
        share one softmax; the slots are read from their codes with the scales folded into
        the scores and weights (``MemoryState.key_scores`` / ``weighted_values``), and mixed
        slots (``slot_mixing``) with the mixed query, (q Q).(k Q) = q.k, their weighted values
        unmixed once, (w V Q) Q^T = w V.
        ``tests/test_arm_method.py`` checks it against the chunk read. Quantised slots with int4
        values read on a CPU go through one fused kernel call per layer
        (``armkv.memory.kernels``: these twenty-odd small ops, each dispatched from Python,
        were a third of the step) unless ``fused=False``; the PyTorch ops below are its reference.

        Returns [B, 1, Hq, d]."""
        if fused and (call := self._held(self._dense_for, query)) is not None:
            return call(query, key, value, valid, exact_k, exact_v, exact_valid, scaling)
        B, Hq, _, d = query.shape
        H = key.shape[1]
        st = self._readable()
        S, R = st.slots, Hq // H
        if self.read_tally is not None:
            occupied = int((st.count > 0).sum())
            self._tally(occupied, occupied)
        mix = self.mixing.to(query.dtype) if st.mixed else None
        bias = self._decode_bias()
        kernel = kernels.fused_read(query, st.value) if fused and st.key_scale is not None else None
        if kernel is not None:  # (what the call binds changes only with the state: kept until then)
            call = dense_decode_call(kernel, st, bias, mix)
            self._dense_for = (self.pool.state, self.m, call)
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

    def _decode_bias(self) -> torch.Tensor:
        """Each slot's logit bias for the decode read, -inf for free slots [B, H, S] float32: it
        changes only when the slots are written, so it is kept until the state is replaced."""
        if self.compiled and torch.compiler.is_compiling():  # (in the step: no Python cache)
            st = self.state
            count = st.count.reshape(*self.buffer.sink_k.shape[:2], st.slots)
            return at_least_float32(torch.where(count > 0, self._slot_bias(count), -torch.inf))
        if self._bias_for is not None and self._bias_for[0] is self.state:
            return self._bias_for[1]
        st = self._readable()
        B, H = self.buffer.sink_k.shape[:2]
        count = st.count.reshape(B, H, st.slots)
        bias = at_least_float32(torch.where(count > 0, self._slot_bias(count), -torch.inf))
        self._bias_for = (self.state, bias)
        return bias

    def _chunk_read(
        self, query, key, value, valid, positions, scaling, exact_k, exact_v, exact_valid, reads_all
    ) -> torch.Tensor:
        """A chunk's read: one joint softmax over [exact | slots of the top-M buckets | the
        chunk, causally]. Returns [B, T, Hq, d]."""
        c = self.config
        B, Hq, T, d = query.shape
        H = key.shape[1]
        rep = Hq // H
        if not reads_all:
            self._page_index()  # (a first paged index may re-lay the pool: before the slots are read)
        pos = positions.unsqueeze(1)
        q_pre = None if reads_all and c.position_mode == "stored" else self.rotary.unrotate(query, pos)
        # each bucket's rank, as the sparse read ranks it (the same buckets, ties included)
        best = self._bucket_scores(query, scaling) if not reads_all and c.position_mode == "stored" else None
        # mixed slots (``slot_mixing``) are read in their mixed basis: (q Q).(k Q) = q.k for
        # every key, and the output unmixed once, (w V Q) Q^T = w V. Mixing the chunk's
        # queries and the exact entries costs a few hundred rows; unmixing the slots, thousands
        mix = None
        if c.position_mode == "stored" and self.state.mixed and self.state.key_scale is not None:
            mix = self.mixing.to(query.dtype)
            query, key, value, exact_k, exact_v = (t @ mix for t in (query, key, value, exact_k, exact_v))
        slot_k, slot_v, occupied, bias = self._slots(unmix=mix is None)

        exact_valid_h = exact_valid.unsqueeze(1).expand(B, H, -1)
        state_valid = torch.cat([exact_valid_h, occupied], -1)
        state_bias = torch.cat([torch.zeros_like(exact_valid_h, dtype=bias.dtype), bias], -1)
        L = exact_k.shape[2]
        if c.position_mode == "stored":
            q_in, chunk_k, chunk_v = query, key, value
        else:
            # slots score with pre-RoPE queries (see _slots), the rest with post-RoPE ones: both
            # ride in one dot product over [post | pre] halves, the values padded alike
            z = torch.zeros_like
            q_in = torch.cat([query, q_pre], -1)
            exact_k, exact_v = torch.cat([exact_k, z(exact_k)], -1), torch.cat([exact_v, z(exact_v)], -1)
            chunk_k, chunk_v = torch.cat([key, z(key)], -1), torch.cat([value, z(value)], -1)
        if not reads_all and c.position_mode != "stored":
            best = self._bucket_scores(q_in, scaling, slot_k)
        slot_masks = [None] if reads_all else self._masks_for(q_pre, best, occupied, rep)
        summaries = None
        if c.read_summaries and not reads_all:  # each skipped unit as one entry (read.unit_summaries)
            slot_unit, num_units = self._read_units()
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

    def _slots(self, unmix: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The slots as attention reads them: keys rotated for reading [B, H, S, d or 2d],
        values, occupied [B, H, S], logit bias [B, H, S]. ``unmix=False`` leaves mixed slots'
        keys and values as x Q (a reader that mixes its queries and the other entries alike).

        The state is stored in this read form (see ``SlotPool.stored``), so a read only
        dequantises it: a transient copy for this layer's attention, as KIVI's is, and
        nothing kept beside the budgeted state between steps."""
        c, st = self.config, self._readable()
        B, H = self.buffer.sink_k.shape[:2]
        S = st.slots
        key, value = (t.reshape(B, H, S, -1) for t in st.kv(self.buffer.sink_k.dtype, unmix=unmix))
        count = st.count.reshape(B, H, S)
        if c.position_mode != "stored":
            # every slot stands just before the window and scores with the pre-RoPE query (the
            # second half of the joint dot product, see attend_chunk)
            key = torch.cat([torch.zeros_like(key), key], -1)
            value = torch.cat([value, torch.zeros_like(value)], -1)
        return key, value, count > 0, self._slot_bias(count)

    def _readable(self) -> MemoryState:
        """The slots a read covers (``SlotPool.readable``): the first ``reach`` of them, or every
        slot in a compiled step (a static shape)."""
        return self.pool.readable(whole=self.compiled and torch.compiler.is_compiling())

    def _slot_bias(self, count: torch.Tensor) -> torch.Tensor:
        """Each slot's logit bias: log n where ``log_count_bias`` (a slot stands for n keys), else 0."""
        return count.clamp_min(1).log() if self.config.log_count_bias else torch.zeros_like(count)

    def _flush(self) -> None:
        """Write the waiting tokens into the slots (one chunked scan)."""
        c, mem = self.config, self.memory
        keys, values, valid, positions = self.pending
        self.pending = None
        work = self.work_dtype  # (the module docstring: the memory computes in float32)
        keys, values = keys.to(work), values.to(work)
        k_pre = self.rotary.unrotate(keys, positions.unsqueeze(1))
        if mem.training and c.write != "fifo":
            self.aux["balance"] = self.aux.get("balance", 0) + mem.router.balance_loss(k_pre, valid)
        # the un-packed pool is this write's own: at inference the write fills it in place,
        # outside autograd where no gradient is wanted through it (else the gates' parameters
        # would chain every write's graph to the next through the stored scales, wherever the
        # caller left gradients on); keys that want one still reach write_chunk's refusal
        wanted = mem.training or keys.requires_grad or values.requires_grad
        with contextlib.nullcontext() if wanted else torch.no_grad():
            self.pool.write(
                keys,
                valid,
                lambda state: mem.write(
                    state, k_pre, values, positions, valid, self.generator, self.rule, inplace=not mem.training
                ),
            )

    def _masks_for(
        self, q_pre: torch.Tensor, best: torch.Tensor | None, occupied: torch.Tensor, rep: int
    ) -> list[torch.Tensor]:
        mem = self.memory
        B, Hq = q_pre.shape[:2]
        buckets = self._group_buckets(self._route_k, q_pre, best).repeat_interleave(rep, 1)
        slot_unit, units = self._read_units()
        slot_unit = slot_unit.long().reshape(B, -1, slot_unit.shape[-1]).repeat_interleave(rep, 1)
        occ = occupied.repeat_interleave(rep, 1).unsqueeze(2)
        ms = [self.m] if self.mix is None else [self.m, (self.m + 1).clamp_max(mem.router.num_buckets)]
        return [bucket_slot_mask(buckets, self._units(m), slot_unit, units) & occ for m in ms]

    # ------------------------------------------------------------------ sparse read
    def _group_buckets(self, m: int, q_pre: torch.Tensor, best: torch.Tensor | None = None) -> torch.Tensor:
        """Each query's m buckets, one choice per KV head for its R query heads.

        ``read_rank="best"``: the m buckets with the largest ``best`` [B, H, T, N_b], each
        bucket's best logit (:meth:`_bucket_scores`; with ``read_pages``, m buckets' worth of
        pages, :meth:`_units`, of its pages' [B, H, T, 2 N_b page_split]). ``"tree"``: the tree's read routing of the
        pre-RoPE queries (``Router.group_topm_buckets``), scored in the routers' dtype.
        q_pre [B, Hq, T, d] -> [B, H, T, m']."""
        router = self.memory.router
        if self.config.read_rank != "tree":  # (ties to the lower bucket id, as the fused kernel breaks them)
            return best.sort(dim=-1, descending=True, stable=True).indices[..., : min(self._units(m), best.shape[-1])]
        B, Hq, T, d = q_pre.shape
        x = q_pre.reshape(B, self.info.num_kv_heads, -1, T, d).to(router.weight.dtype)
        return router.group_topm_buckets(x, m)[0]

    def _bucket_scores(
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
        slot_bucket, num_buckets = self._read_units()  # (pages under read_pages)
        st = self._readable()
        B, Hq, T, d = query.shape
        H = self.info.num_kv_heads
        G, R, S = B * H, Hq // H, st.slots
        q = query.reshape(G, R, T, d).float()
        if keys is None and st.mixed:
            q = q @ self.mixing.float()
        bias = self._decode_bias().reshape(G, S)
        if keys is None and T == 1:  # a decoded token: the products from the codes (the fused kernel on a CPU)
            q = q.view(G, R, d)  # ("partial": a few rows of them)
            partial = self.config.read_rank == "partial"
            scores = st.partial_key_scores(q, partial_rows(q, self._partial_rows)) if partial else st.key_scores(q)
            logits = (scores * scaling + bias.unsqueeze(1)).amax(1)
            return bucket_best(logits.unsqueeze(1), slot_bucket, num_buckets).view(B, H, 1, -1)
        if keys is None:  # a chunk: the keys dequantised once
            keys = st.kv(torch.float32, unmix=False)[0]
        best = bucket_best_of_keys(q * scaling, keys.reshape(G, S, -1).float(), bias, slot_bucket, num_buckets)
        return best.view(B, H, T, -1)

    def _reads_top_m(self, reads_all: bool) -> bool:
        """Whether a read may skip the pool's other buckets instead of masking them (the
        masked read, :meth:`_chunk_read`, is the reference): at inference, stored positions,
        fewer buckets than all."""
        return (
            not reads_all
            and self.mix is None
            and not self.memory.training
            and self.config.position_mode == "stored"
            and self._route_k < self.memory.router.num_buckets
        )

    def _reads_sparse(self, T: int, reads_all: bool) -> bool:
        """Whether this read gathers its buckets' slots (:meth:`_sparse_read`): one that may
        skip buckets (:meth:`_reads_top_m`) of at most SPARSE_MAX_QUERIES tokens; with
        ``read_rank="best"`` or ``"partial"`` one token only (a chunk scores every slot for its
        ranking anyway, and :meth:`_ranked_chunk_read` reads with those scores instead of
        gathering per token)."""
        return self._reads_top_m(reads_all) and T <= (SPARSE_MAX_QUERIES if self.config.read_rank == "tree" else 1)

    def _reads_ranked(self, reads_all: bool) -> bool:
        """Whether a read that does not gather is read by :meth:`_ranked_chunk_read`: one that
        may skip buckets, ranked by ``read_rank="best"`` (or ``"partial"``, whose chunks rank as
        ``"best"``)."""
        return self._reads_top_m(reads_all) and self.config.read_rank != "tree"

    def _ranked_chunk_read(
        self, query, key, value, valid, scaling, exact_k, exact_v, exact_valid, fused: bool = True
    ) -> torch.Tensor:
        """:meth:`_chunk_read` at M < N_b with ``read_rank="best"``, each slot's logit computed
        once for both the ranking and the softmax (``read.ranked_chunk_read``, in float32, a
        block of queries at a time) instead of once to rank and again under a mask of
        [queries, state + chunk]. It reads the same slots: the buckets are ranked from the same
        float32 logits of the dequantised codes as :meth:`_bucket_scores`, chosen by
        :meth:`_group_buckets` and masked by ``bucket_slot_mask``; on a CPU the fused kernel
        ranks and reads them (``ranked_slot_read``) unless ``fused=False``. Returns [B, T, Hq, d]."""
        B, Hq, T, d = query.shape
        H, L = key.shape[1], exact_k.shape[2]
        G, R = B * H, Hq // H
        # (the read is in float32 whatever the model's dtype)
        kernel = kernels.fused_cpu(query.float()) if fused else None
        # what it ranks: buckets, or their pages (read_pages); either's first build may re-lay the pool,
        # so before the slots are read
        index = self._page_index() or self._bucket_index()
        if kernel is not None:  # the kernel takes the units' index
            by_kernel = (kernel, index, self._take(self._units(self.memory.router.num_buckets), H))
        else:
            by_kernel = None
            slot_unit, num_units = self._read_units()
        st = self._readable()
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
                buckets = self._group_buckets(self._route_k, None, best)
                return (
                    bucket_slot_mask(buckets, self._units(self.m), slot_unit.view(B, H, S), num_units) & occupied
                ).view(G, -1, S)

        summaries = None
        if self.config.read_summaries:  # each unit a query skips one entry (the PyTorch ops also need each slot's unit)
            unit = None if by_kernel is not None else torch.where(slot_unit < 0, num_units, slot_unit).reshape(G, S)
            summaries = (*self._unit_summaries(index), unit)
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
            self._decode_bias().reshape(G, S),
            pick,
            fused=by_kernel,
            summaries=summaries,
        )
        if mix is not None:
            out = out @ mix.T
        return out.reshape(B, Hq, T, d).transpose(1, 2).to(query.dtype)

    def _bucket_index(self):
        """The readable slots listed by bucket (``read.bucket_index``): they change only at
        writes, so it is built once per state. Where the list has drifted far from the pool's
        order (``read.run_breaks``: writes put new slots wherever a slot is free) the shared
        pool is first re-laid bucket by bucket (``read.sort_by_bucket``, a copy of the pool,
        every few hundred decoded tokens), so that a read's gathers are contiguous runs. A
        state's meaning does not depend on where its slots lie."""
        if self._index_for is not None and self._index_for[0] is self.state:
            return self._index_for[1]
        st, num_buckets = self._readable(), self.memory.router.num_buckets
        index = bucket_index(st.bucket, st.count > 0, num_buckets)
        if self.config.pool == "shared" and run_breaks(index) > relay_breaks(st.slots, num_buckets):
            self.state = sort_by_bucket(self.state, index)  # (the occupied slots stay within `reach`)
            order = torch.arange(st.slots, dtype=torch.int32, device=index.order.device).expand_as(index.order)
            index = BucketIndex(order=order, start=index.start, size=index.size, laid=True)
        self._index_for = (self.state, index)
        return index

    def _read_units(self) -> tuple[torch.Tensor, int]:
        """What a read at M < N_b ranks and takes, slot by slot: the tree's buckets, or with
        ``read_pages`` their pages (made again per call, not kept) -> (the unit of each slot
        [G, S], -1 for a free one; how many units)."""
        pages = self._page_index()
        if pages is None:
            st = self._readable()
            return st.bucket.reshape(-1, st.slots), self.memory.router.num_buckets
        return slot_units(pages), pages.size.shape[1]

    def _page_index(self) -> "BucketIndex | None":
        """With ``read_pages``, the index of the buckets' pages (``read.paged_index``), built
        once per state with the bucket index, whose first build may re-lay the pool: a read
        calls this before it looks at the slots. None without ``read_pages``."""
        if not self.config.read_pages:
            return None
        index = self._bucket_index()
        if self._pages_for is None or self._pages_for[0] is not index:
            self._pages_for = (index, paged_index(index, self.memory.router.num_buckets * self.config.page_split))
        return self._pages_for[1]

    def _units(self, m):
        """M buckets (an int or a tensor) in the units a read takes: M * page_split pages under
        ``read_pages`` (each at most 1 / page_split of the mean bucket), else M buckets."""
        return m * self.config.page_split if self.config.read_pages else m

    def _tally(self, read: int, occupied: int) -> None:
        """Add one read of ``read`` of the ``occupied`` slots to ``read_tally``."""
        self.read_tally[0] += read
        self.read_tally[1] += occupied

    def _sparse_read(
        self, query, key, value, valid, positions, scaling, exact_k, exact_v, exact_valid, fused: bool = True
    ) -> torch.Tensor:
        """:meth:`_chunk_read` at M < N_b with each query's slots gathered: the slots of its
        KV head's top-M buckets (``read.slots_of_buckets``), read from their stored codes
        (``read.gathered_read``). Its cost
        falls with M; it equals the masked read of the whole pool (tests/test_sparse_read.py).
        With ``read_summaries`` only the fused calls read (each skipped unit one entry,
        :meth:`_unit_summaries`); where they do not serve, the masked read does.
        Returns [B, T, Hq, d]."""
        if (
            fused and (call := self._held(self._ranked_for, query)) is not None
        ):  # best / partial: the call kept from the last step
            return call(query, key, value, valid, exact_k, exact_v, exact_valid, scaling)[0]
        B, Hq, T, d = query.shape
        H, M = key.shape[1], self._route_k
        G = B * H
        index = self._page_index() or self._bucket_index()  # what it ranks and reads: pages (read_pages) or buckets
        st = self._readable()
        kernel = kernels.fused_read(query, st.value) if fused and T == 1 and st.key_scale is not None else None
        if (
            kernel is None and self.config.read_summaries
        ):  # (the skipped units' entries: the fused reads, or the masked one)
            return self._chunk_read(
                query, key, value, valid, positions, scaling, exact_k, exact_v, exact_valid, reads_all=False
            )
        if kernel is not None:  # one query on a CPU: ranked and read in one call (best), or routed, then read (tree)
            mix = self.mixing.to(query.dtype) if st.mixed else None
            m = self._units(min(M, self.memory.router.num_buckets))
            take = self._take(m, H)
            units = self._unit_summaries(index) if self.config.read_summaries else None  # (the skipped units' entries)
            if self.config.read_rank in ("best", "partial"):
                # best: every slot scored once, the ranking's logits are the read's; partial: a few
                # rows of every key to rank, the chosen buckets' keys whole. What the call binds
                # changes only with the state or M: kept until then, a decode step makes the one call
                rows = self._partial_rows if self.config.read_rank == "partial" else None
                call = ranked_decode_call(
                    kernel, st, self._decode_bias(), mix, index, m, take, rows, units, max_runs(st.slots)
                )
                self._ranked_for = (self.pool.state, self.m, call)
                out, buckets = call(query, key, value, valid, exact_k, exact_v, exact_valid, scaling)
            else:
                buckets = self.memory.router.fused_group_topm(kernel, query, positions, self.rotary, M)
                if buckets is None:
                    buckets = self._group_buckets(M, self.rotary.unrotate(query, positions.unsqueeze(1))).reshape(G, -1)
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
                    self._decode_bias(),
                    mix,
                    scaling,
                    index,
                    buckets,
                    take,
                    units,
                )
            if self.read_tally is not None:
                chosen = torch.arange(buckets.shape[-1], device=buckets.device) < take.unsqueeze(1)
                self._tally(int((index.size.gather(1, buckets).long() * chosen).sum()), int(index.size.sum()))
            return out
        q_pre = self.rotary.unrotate(query, positions.unsqueeze(1))
        buckets = self._group_buckets(M, q_pre, self._bucket_scores(query, scaling))  # [B, H, T, M units]
        M = buckets.shape[-1]
        take = (torch.arange(M, device=query.device) < self._units(self.m).view(B, 1, 1, 1)).expand(B, H, T, M)
        # eager on a CPU, the width these queries need (a host sync costs nothing there); compiled
        # or on an accelerator, the width any M buckets need, fixed until the next write
        eager_cpu = query.device.type == "cpu" and not torch.compiler.is_compiling()
        ids, used = slots_of_buckets(
            index, buckets.reshape(G, T, M), None if eager_cpu else index.width(M), take.reshape(G, T, M)
        )
        W = ids.shape[-1]
        if self.read_tally is not None:
            self._tally(int(used.sum()) // T, int(index.size.sum()))
        bias = self._decode_bias().reshape(G, st.slots).gather(1, ids.view(G, T * W)).view(B, H, T, W)
        bias = bias.masked_fill(~used.view(B, H, T, W), -torch.inf)
        return gathered_read(
            query,
            key,
            value,
            valid,
            scaling,
            exact_k,
            exact_v,
            exact_valid,
            gather_slots(st, ids, for_reading=True),
            bias,
            fused=fused,
        )

    def _held(self, held, query: torch.Tensor):
        """The fused decode call ``held`` keeps ((pool state, M, the call): ``_ranked_for`` or
        ``_dense_for``, bound where ``kernels.fused_read`` served) where it serves this read,
        else None: the same state and M, one query, no ``read_tally``, no gradient wanted, not
        while ``torch.compile`` traces (a compiled graph cannot call the extension). A
        decode step then makes one kernel call a layer and little else: in a step of the model
        each layer's Python work comes cold, and the checks and calls it skips had taken
        70-100 us a layer, about a sixth of a sparse read at 16k."""
        if (
            torch.compiler.is_compiling()  # (first: a compiled step reads none of these Python objects)
            or held is None
            or held[0] is not self.pool.state
            or held[1] is not self.m
            or self.read_tally is not None
            or query.shape[2] != 1
            or query.requires_grad
        ):
            return None
        return held[2]

    def _unit_summaries(self, index) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``read_summaries``: the entries of ``index``'s units (buckets, or their pages) that a
        read may skip (``read.index_summaries``, in the slots' basis), made once per index (a
        write makes a new one) and kept beside the state, counted in :meth:`state_bytes`. The
        entries of units in buckets that no write changed since the last ones are carried over
        (``SlotPool.take_dirty``, ``read.carried_units``): a decode step's write of ``sync``
        tokens changes a few buckets, and the rest need not be read again."""
        if self._summaries_for is None or self._summaries_for[0] is not index:
            st = self._readable()
            # the units whose buckets no write has changed since the last ones keep their entries
            dirty, sizes, kept = self.pool.take_dirty(), self._bucket_index().size, None
            if self._summaries_for is not None and dirty is not None and self._summaries_for[2].shape == sizes.shape:
                pages = self.memory.router.num_buckets * self.config.page_split if self.config.read_pages else None
                kept = (self._summaries_for[1], carried_units(dirty, self._summaries_for[2], sizes, pages))
            self._summaries_for = (
                index,
                index_summaries(st, self._decode_bias().reshape(-1, st.slots), index, kept=kept),
                sizes,
            )
        return self._summaries_for[1]

    def _take(self, m: int, H: int) -> torch.Tensor:
        """How many units (buckets, or pages: :meth:`_units`) each group reads, M of its row in
        units capped at m: [B * H] long, kept while M and m stay (a decode step reads it in
        every layer)."""
        if self._take_for is None or self._take_for[0] is not self.m or self._take_for[1] != (m, H):
            self._take_for = (self.m, (m, H), self._units(self.m).clamp_max(m).repeat_interleave(H))
        return self._take_for[2]

    def _decide_m(self, k_pre: torch.Tensor, valid: torch.Tensor) -> None:
        """The policy's state: the mean of the first l valid tokens' pre-RoPE keys."""
        c = self.config
        first = valid & (valid.cumsum(1) <= c.policy_tokens)
        w = first.unsqueeze(1).unsqueeze(-1).to(k_pre.dtype)
        pooled = (k_pre * w).sum(2) / w.sum(2).clamp_min(1)  # [B, H, d]
        num_buckets = self.memory.router.num_buckets
        if c.top_m == "fixed" or self.memory.policy is None:
            self.m = torch.full((k_pre.shape[0],), c.fixed_m, dtype=torch.long, device=k_pre.device)
            self._reads_all = c.fixed_m >= num_buckets
            self._route_k = min(c.fixed_m, num_buckets)
            _warn_slow_sparse_reads(self._route_k, num_buckets, k_pre.device, self.memory.training)
            return
        m, g, expected = self.memory.policy.decide(pooled.flatten(1), self.memory.training, c.epsilon, self.generator)
        self.m = m.clamp_max(num_buckets)
        self._reads_all = bool((self.m >= num_buckets).all())
        if self.memory.training:
            self.mix = g
            self.aux["budget"] = expected.mean() / self.memory.router.num_buckets
        # (known here, once per sequence: the decode step's routing then needs no host sync)
        self._route_k = min(int(self.m.max()) + (0 if self.mix is None else 1), num_buckets)
        _warn_slow_sparse_reads(self._route_k, num_buckets, k_pre.device, self.memory.training)

    def diagnostics(self, positions: torch.Tensor | None = None) -> dict:
        """What the memory holds now: slots used, tokens per used slot, and, for the given
        token positions [n] (e.g. a needle's), the share still held exactly (in the sinks,
        the window, waiting, or alone in a slot), averaged over batch rows and KV heads."""
        if self.state is None:
            return {}
        st = self.state
        used = st.count > 0
        out = {
            "slots_used": float(used.float().sum(-1).mean()),
            "slots": self.slots,  # the budget's, allocated or not yet
            "tokens_per_slot": float(st.count.sum() / used.sum().clamp_min(1)),
        }
        if positions is not None:
            positions = positions.to(st.pos.device).float()
            exact = (st.count == 1).unsqueeze(-1) & (st.pos.unsqueeze(-1) == positions)  # [G, S, n]
            held = exact.any(1)  # [G, n]
            _, _, valid, pos = self.buffer.kv()
            in_buffer = (valid.unsqueeze(-1) & (pos.unsqueeze(-1).float() == positions)).any(1)  # [B, n]
            if self.pending is not None:
                waiting = (self.pending[2].unsqueeze(-1) & (self.pending[3].unsqueeze(-1).float() == positions)).any(1)
                in_buffer = in_buffer | waiting
            B = in_buffer.shape[0]
            held = held.view(B, -1, positions.numel()) | in_buffer.unsqueeze(1)
            out["exact_share"] = float(held.float().mean())
        return out

    def aux_losses(self) -> dict[str, torch.Tensor]:
        """Training losses gathered since the cache was made: the balance loss of every
        chunk written, and the policy's expected read cost E[M] / N_b (unweighted)."""
        return dict(self.aux)


# ---------------------------------------------------------------------- registration
@register_method("arm", "ARM: sinks + window exact, a tree-routed pool of merged slots for the rest")
def make_arm(
    layer_idx: int,
    info: ModelInfo,
    rotary: Rotary | None,
    budget: int | None,
    chunk: int,
    adapter=None,
    arm: ARMModel | None = None,
    arm_overrides: dict | None = None,
    **options,
):
    """One layer of the arm cache: the adapter's parameters, the budget shared over the layers
    by the adapter's ``layer_weights`` (``layer_weights="even"``: equal shares; "lift-late":
    that rule applied to the adapter's retrieval scores; or the shares as numbers)."""
    budget = require_budget("arm", budget, 8, "sinks + window + slots")
    overrides = dict(arm_overrides or {})
    overrides.update(options)
    overrides.setdefault("chunk", chunk)
    weights = overrides.pop("layer_weights", None)
    arm_model, runtime = resolve_arm(info, budget, adapter, arm, overrides)
    # the adapter's calibrated per-layer shares of the budget, unless asked otherwise
    weights = adapter_layer_weights(weights, arm_model.config, info.num_layers)
    if weights is not None and weights != "even":
        share = layer_budget(budget, layer_idx, parse_layer_weights(weights, info.num_layers))
        require_budget("arm", share, 8, f"layer {layer_idx}'s share under layer_weights")
        if "sync" not in overrides:
            # every layer writes at the same decode steps (the whole budget's sync), so that the
            # steps between are free of writes; the window stays what the layer's share gives it
            own = ARMConfig.for_budget(share, info.head_dim, info.dtype_bytes, slot_format=runtime.slot_format)
            overrides = {"window": own.window, **overrides, "sync": runtime.sync}
        arm_model, runtime = resolve_arm(
            info, share, arm=arm_model, overrides=overrides
        )  # the same parameters, resized
    arm_model = arm_on_device(arm_model, info.device, given=arm is not None)
    return ARMLayer(layer_idx, info, rotary, arm_model.layers[layer_idx], runtime)


@register_method("fifo", "ablation: ARM's slots overwritten oldest-first, every slot read (no gate, no sparsity)")
def make_fifo(layer_idx: int, info: ModelInfo, rotary: Rotary | None, budget: int | None, chunk: int, **options):
    overrides = dict(options.pop("arm_overrides", None) or {})
    overrides.update(write="fifo", top_m="fixed", log_count_bias=False)
    given = options.get("arm") is not None
    arm_model, runtime = resolve_arm(
        info,
        require_budget("fifo", budget, 8, "sinks + window + slots"),
        options.pop("adapter", None),
        options.pop("arm", None),
        {**overrides, "chunk": chunk},
    )
    if options:
        raise ArmkvError(f"method 'fifo' takes no option {', '.join(sorted(options))}")
    runtime = dataclasses.replace(runtime, m_fixed=arm_model.config.num_buckets)
    arm_model = arm_on_device(arm_model, info.device, given=given)
    return ARMLayer(layer_idx, info, rotary, arm_model.layers[layer_idx], runtime)


# (the adapter lookup and the budget shares live in methods/adapters.py and budget.py; these
# names are also importable from here)
__all__ = [
    "ARMLayer",
    "DEFAULT_ADAPTER_ORDER",
    "LAYER_SHARE_RULES",
    "SHIPPED_ADAPTERS",
    "arm_on_device",
    "resolve_arm",
    "retrieval_layer_weights",
    "shipped_adapter",
]
