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
(``memory.reader``, and ``joint_attention``'s kernels). Quantised slots are packed from
float32 and keep bfloat16 scales whatever the model's dtype (``memory.state``). The fused
kernels serve where a backend has them (``memory.reader.BACKENDS``: the C++ kernels on a CPU in
float32, triton's on CUDA where installed); elsewhere their PyTorch references run.

The read of the memory is the layer's :class:`~armkv.memory.reader.Reader` (``layer.reader``);
this module keeps the exact buffer, the waiting tokens and their write, the decode step and
the choice of M.
"""

from __future__ import annotations

import contextlib
import dataclasses

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
from armkv.memory.arena import Layout, carve, layout_bytes
from armkv.memory.module import ARMModel
from armkv.memory.pool import SlotPool
from armkv.memory.reader import Reader, warn_slow_sparse_reads
from armkv.memory.rope import Rotary
from armkv.memory.state import MemoryState
from armkv.memory.write import WriteRule
from armkv.methods.adapters import (
    DEFAULT_ADAPTER_ORDER,
    SHIPPED_ADAPTERS,
    arm_on_device,
    resolve_arm,
    shipped_adapter,
)
from armkv.methods.base import CacheLayer, ModelInfo, register_method, require_budget
from armkv.methods.buffers import ExactBuffer


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
        # the reads of the slots, and the buckets each row reads (m, mix: decided by _decide_m)
        self.reader = Reader(self.pool, memory, config, rotary, info.num_kv_heads)
        self.aux: dict[str, torch.Tensor] = {}
        self.generator: torch.Generator | None = None
        # compiled decoding: the tokens waiting for the write in `sync` fixed entries (keys
        # [B, H, sync, d], values, valid [B, sync], positions [B, sync]) and the steps since the write
        self.waiting: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.waiting_steps = 0
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
    def m(self) -> torch.Tensor | None:
        """[B] the buckets each row reads (None until the first chunk decides them)."""
        return self.reader.m

    @property
    def mix(self) -> torch.Tensor | None:
        """[B] the soft cascade's weight of Top(M + 1) while training, else None."""
        return self.reader.mix

    @property
    def read_tally(self) -> list[int] | None:
        """[slots read, slots occupied] summed over the decode reads and their KV heads while it
        is a list (``armkv bench decode`` sets it): the share of the memory a read touches."""
        return self.reader.tally

    @read_tally.setter
    def read_tally(self, tally: list[int] | None) -> None:
        self.reader.tally = tally

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
            self.reader.m = self.placed["m"]
        self.reader.forget()

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
        self.reader.start(d, key.dtype, key.device)
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
        self.reader.compiled = True  # (its reads take static shapes while traced)

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
        held.update(m=self.m, mixing=self.reader.mixing)
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
        reads_all = self.reader.reads_all
        if reads_all and self.config.position_mode == "stored":
            out = self.reader.dense(query, key, value, valid, scaling, exact_k, exact_v, exact_valid)
        else:
            out = self.reader.masked(
                query, key, value, valid, positions, scaling, exact_k, exact_v, exact_valid, reads_all
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
        # (+ what the reads keep beside the pool: index, pages, summaries, the bound call's runs)
        return self.buffer.state_bytes() + self.pool.nbytes() + waiting + self.reader.nbytes()

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
                self.reader.choose(None, None, 0, False)
                self.aux.pop("budget", None)

    def _read_chunk(self, query, key, value, valid, positions, scaling):
        """:meth:`attend_chunk`'s read: [state | the chunk, causally], the state unchanged."""
        if self.buffer is None:
            self._lazy_init(key)
        if self.m is None:
            self._decide_m(self.rotary.unrotate(key.to(self.work_dtype), positions.unsqueeze(1)), valid)
        exact_k, exact_v, exact_valid = self.exact()
        # which slots each query reads: those of its top-M buckets (M per row); reading every
        # bucket needs no routing and no per-query mask (state_valid already drops free slots)
        # (decided once per sequence with M, so the decode step has no host sync here)
        reads_all = self.mix is None and self.reader.reads_all
        return self.reader.read(query, key, value, valid, positions, scaling, exact_k, exact_v, exact_valid, reads_all)

    def begin(self, key: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """What the first chunk does before it reads: allocate the state for keys of ``key``'s
        shape [B, H, T, d] (post-RoPE, at ``positions`` [B, T]; 0 where None) and decide M from
        them (``valid`` [B, T]). For callers that fill the pool themselves (``armkv bench ops``)."""
        if self.buffer is None:
            self._lazy_init(key)
        if self.m is None:
            if positions is None:
                positions = torch.zeros(key.shape[0], key.shape[2], dtype=torch.long, device=key.device)
            self._decide_m(self.rotary.unrotate(key.to(self.work_dtype), positions.unsqueeze(1)), valid)

    def exact(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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

    # ------------------------------------------------------------------ the choice of M
    def _decide_m(self, k_pre: torch.Tensor, valid: torch.Tensor) -> None:
        """The policy's state: the mean of the first l valid tokens' pre-RoPE keys."""
        c = self.config
        first = valid & (valid.cumsum(1) <= c.policy_tokens)
        w = first.unsqueeze(1).unsqueeze(-1).to(k_pre.dtype)
        pooled = (k_pre * w).sum(2) / w.sum(2).clamp_min(1)  # [B, H, d]
        num_buckets = self.memory.router.num_buckets
        if c.top_m == "fixed" or self.memory.policy is None:
            m = torch.full((k_pre.shape[0],), c.fixed_m, dtype=torch.long, device=k_pre.device)
            route_k = min(c.fixed_m, num_buckets)
            self.reader.choose(m, None, route_k, c.fixed_m >= num_buckets)
            warn_slow_sparse_reads(route_k, num_buckets, k_pre.device, self.memory.training)
            return
        m, g, expected = self.memory.policy.decide(pooled.flatten(1), self.memory.training, c.epsilon, self.generator)
        m = m.clamp_max(num_buckets)
        mix = None
        if self.memory.training:
            mix = g
            self.aux["budget"] = expected.mean() / self.memory.router.num_buckets
        # (known here, once per sequence: the decode step's routing then needs no host sync)
        route_k = min(int(m.max()) + (0 if mix is None else 1), num_buckets)
        self.reader.choose(m, mix, route_k, bool((m >= num_buckets).all()))
        warn_slow_sparse_reads(route_k, num_buckets, k_pre.device, self.memory.training)

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
