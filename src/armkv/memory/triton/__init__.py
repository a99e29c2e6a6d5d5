"""ARM's reads as Triton kernels: the decode read of one token (every bucket, the chosen
buckets or pages with their summaries, or ranked by their best partial or full logit) and
a prefill chunk's read of the whole pool, over the int4 / int8 slots as the pools store
them, for CUDA devices (and, under ``TRITON_INTERPRET=1``, on CPU tensors: how the tests
check them here).

:class:`DecodeCall` has the interface and the semantics of the C++ extension's
``DecodeCall`` (``armkv.memory.kernels``, ``csrc/decode.cpp``), so that this module
serves where that one does: ``read._bound_call(armkv.memory.triton, kind, ...)`` binds a
read of kind "dense", "sparse", "best" or "partial" with what stays between writes (the
codes, scales, bias, mixing, index and the units' entries), and each call takes a step's
token inputs (query, own key and value, its valid flag, the exact sinks and window) in the
model's layout or flat by group, and returns the read [B, 1, Hq, d] (or [G, R, d]), with
the m chosen units for the ranked kinds. The token inputs may be float32, float16 or
bfloat16; everything is summed in float32 and the output has the query's dtype.

A read is a split-K pair of launches: ``decode_partials`` (program (g, p): group g's
share p of the slots, or its exact entries, or a share of the units a sparse read skips)
and ``decode_combine`` (one softmax from the shares). A sparse read's shares hold up to 16
chosen units each, their slots packed end to end into blocks (pages of a few slots fill a
block together); the ranked kinds first score every unit (``unit_best``, 16 units a
program, each slot of their lists scored once), pick the m best with one stable sort (ties
to the lower id, as the C++ and PyTorch rankings), then read them as the sparse read does.
:func:`dense_chunk_read` is a prefill chunk's read of the whole pool, the exact entries and
the chunk (causal) in one launch: ``read.gathered_read`` with every slot gathered for every
query.

triton is imported on first use: ``import armkv.memory.triton`` works without it
(:func:`available` says whether it is installed; ``pip install 'armkv[gpu]'``).
"""

from __future__ import annotations

import importlib.util
import os

import torch

KINDS = ("dense", "sparse", "best", "partial")


def available() -> bool:
    """Whether triton is installed (the kernels are compiled on first use)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # (a module entry set to None: treated as absent)
        return False


def describe() -> str:
    """How these kernels run here, for benchmark reports."""
    if not available():
        return "unavailable (triton not installed)"
    import triton

    mode = "interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "compiled"
    return f"triton {triton.__version__} ({mode})"


def _kernels():
    if not available():
        raise RuntimeError("armkv.memory.triton needs triton: pip install 'armkv[gpu]'")
    from armkv.memory.triton import kernels

    return kernels


def _pow2(n: int, least: int = 16) -> int:
    """The block size for n entries: a power of two, at least ``least`` (tl.dot's minimum)."""
    return max(least, 1 << max(0, int(n) - 1).bit_length())


def _check_device(t: torch.Tensor, name: str) -> None:
    if t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"{name}: CPU tensors run the Triton kernels only under TRITON_INTERPRET=1 (set it before "
            "triton is imported), or use the C++ kernels (armkv.memory.kernels) on a CPU"
        )


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t with contiguous channels (its last dimension), a copy only where they are not."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _flag(t: torch.Tensor) -> torch.Tensor:
    """A valid mask as uint8 bytes (bool viewed; any other dtype compared with 0)."""
    return (t if t.dtype == torch.bool else t != 0).view(torch.uint8)


def _dummy(device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.float32, device=device)


class _Tokens:
    """A step's token inputs as the kernels read them, where they lie (channels contiguous):
    the model's layout (query [B, Hq, 1, d], own_k and own_v [B, H, 1, d], own_ok [B, T],
    exact_k and exact_v [B, H, L, d], exact_ok [B, L]) or flat by group (query [G, R, d],
    own_k and own_v [G, d], own_ok [G], exact [G, L, d], exact_ok [G, L]); group g = b H + h."""

    def __init__(self, query, own_k, own_v, own_ok, exact_k, exact_v, exact_ok, G: int, d: int, name: str):
        self.model = query.dim() == 4
        q, kk, vv, ek, ev = (_rows(t) for t in (query, own_k, own_v, exact_k, exact_v))
        ok, eok = _flag(own_ok), _flag(exact_ok)
        if self.model:
            if q.shape[2] != 1 or kk.dim() != 4 or ek.dim() != 4 or ok.dim() != 2 or eok.dim() != 2:
                raise ValueError(
                    f"{name}: query [B, Hq, 1, d], the token's key and value [B, H, 1, d], its valid [B, T], "
                    "exact [B, H, L, d], exact valid [B, L]"
                )
            B, H, L = q.shape[0], kk.shape[1], ek.shape[2]
            self.q = (q, q.stride(0), q.stride(1), q.stride(3))
            self.kk = (kk, kk.stride(0), kk.stride(1))
            self.vv = (vv, vv.stride(0), vv.stride(1))
            self.ek = (ek, ek.stride(0), ek.stride(1), ek.stride(2))
            self.ev = (ev, ev.stride(0), ev.stride(1), ev.stride(2))
        else:
            if q.dim() != 3 or kk.dim() != 2 or ek.dim() != 3 or ok.dim() != 1 or eok.dim() != 2:
                raise ValueError(f"{name}: query [G, R, d], own_k and own_v [G, d], own_ok [G], exact [G, L, d]")
            B, H, L = q.shape[0], 1, ek.shape[1]
            self.q = (q, q.stride(0), q.stride(1), q.stride(2))
            self.kk = (kk, kk.stride(0), 0)
            self.vv = (vv, vv.stride(0), 0)
            self.ek = (ek, ek.stride(0), 0, ek.stride(1))
            self.ev = (ev, ev.stride(0), 0, ev.stride(1))
        Hq = q.shape[1]
        if B * H != G or Hq % H or q.shape[-1] != d or kk.shape[-1] != d or ek.shape[-1] != d or eok.shape[-1] != L:
            raise ValueError(f"{name}: the token's inputs do not match the slots' groups ({G}) or head size ({d})")
        self.R = Hq // H
        self.ok = (ok, ok.stride(0))
        self.eok = (eok, eok.stride(0), eok.stride(1) if L > 1 else 1)
        self.B, self.H, self.L, self.dtype, self.device = B, H, L, query.dtype, query.device

    def out(self, d: int) -> tuple[torch.Tensor, int, int]:
        """The read's output ([B, 1, Hq, d] or [G, R, d], the query's dtype), its batch and head strides."""
        if self.model:
            out = torch.empty(self.B, 1, self.H * self.R, d, dtype=self.dtype, device=self.device)
            return out, out.stride(0), out.stride(2)
        out = torch.empty(self.B, self.R, d, dtype=self.dtype, device=self.device)
        return out, out.stride(0), out.stride(1)

    def flat_query(self) -> torch.Tensor:
        """The query [G, R, d] float32, contiguous (for the rankings)."""
        q = self.q[0]
        return (q.reshape(self.B * self.H, self.R, -1) if self.model else q).float().contiguous()


class _Slots:
    """A pool's codes, scales, bias and mixing as the kernels read them, checked once."""

    def __init__(self, key_codes, key_scale, value_codes, value_scale, bias, mix, name: str):
        if key_codes.dim() != 3 or value_codes.dim() != 3 or key_scale.dim() != 3 or value_scale.dim() != 3:
            raise ValueError(f"{name}: key codes, value codes and scales [G, ., .], bias [G, S] or [B, H, S]")
        if bias.dim() not in (2, 3):
            raise ValueError(f"{name}: bias [G, S] or [B, H, S]")
        self.kc, self.vc = _rows(key_codes), _rows(value_codes)
        self.ks, self.vs = (
            _rows(s if s.dtype in (torch.float32, torch.bfloat16) else s.float()) for s in (key_scale, value_scale)
        )
        self.bias = (bias.reshape(-1, bias.shape[-1]) if bias.dim() == 3 else bias).float().contiguous()
        if self.vc.dtype != torch.uint8:
            raise ValueError(f"{name}: int4 value codes only")
        if self.kc.dtype not in (torch.uint8, torch.int8):
            raise ValueError(f"{name}: int4 (uint8) or int8 key codes only")
        self.int8_keys = self.kc.dtype == torch.int8
        self.G, self.d, self.S = self.kc.shape[0], 2 * self.vc.shape[2], self.bias.shape[1]
        self.ngk, self.ngv = self.ks.shape[2], self.vs.shape[2]
        G, d, S = self.G, self.d, self.S
        mixed = mix is not None and mix.numel() > 0
        if not (
            d > 0
            and self.kc.shape[1] == (d if self.int8_keys else d // 2)
            and self.kc.shape[2] == S
            and self.ks.shape[:2] == (G, S)
            and self.vc.shape[:2] == (G, S)
            and self.vs.shape[:2] == (G, S)
            and self.bias.shape[0] == G
            and d % self.ngk == 0
            and d % self.ngv == 0
            and (not self.int8_keys or self.ngk == 1)
            and (not mixed or tuple(mix.shape) == (d, d))
        ):
            raise ValueError(f"{name}: shapes do not match (codes [G, d/2 or d, S], scales [G, S, ng], bias [G, S])")
        self.mix = mix.to(device=self.kc.device, dtype=torch.float32).contiguous() if mixed else None
        _check_device(self.kc, name)

    def args(self) -> tuple:
        kc, ks, vc, vs, b = self.kc, self.ks, self.vc, self.vs, self.bias
        return (
            kc, kc.stride(0), kc.stride(1), ks, ks.stride(0), ks.stride(1),
            vc, vc.stride(0), vc.stride(1), vs, vs.stride(0), vs.stride(1), b, b.stride(0),
            self.mix if self.mix is not None else _dummy(kc.device),
        )  # fmt: skip


class DecodeCall:
    """A layer's decode read with what stays between writes bound: the C++ ``DecodeCall``'s
    arguments and semantics (``armkv.memory.read._bound_call``). kind "dense": every slot;
    "sparse": the slots of the first ``take`` [G] of ``buckets`` [G, M] (ids outside
    [0, N_b) are skipped); "best" / "partial": each group's m best units by their best logit
    (over every key code, or over the n key-code rows where the query is largest,
    ``read.partial_rows``) and the first ``take`` of them read. ``order`` [G, <= S] (width 0:
    a pool laid unit by unit), ``start`` and ``size`` [G, N_b]: the units' index
    (``read.BucketIndex``); ``unit_keys``, ``unit_values`` [G, N_b, d] and
    ``unit_log_weight`` [G, N_b] (``read_summaries``): each unit the read skips joins its
    softmax as one entry. ``vectorised`` and ``max_runs`` are the C++ call's and change
    nothing here; ``splits`` (dense): the slots' shares a group is cut into (None: enough
    programs to fill a GPU)."""

    def __init__(
        self,
        kind: str,
        key_codes: torch.Tensor,
        key_scale: torch.Tensor,
        value_codes: torch.Tensor,
        value_scale: torch.Tensor,
        bias: torch.Tensor,
        mix: torch.Tensor | None,
        order: torch.Tensor | None = None,
        start: torch.Tensor | None = None,
        size: torch.Tensor | None = None,
        buckets: torch.Tensor | None = None,
        take: torch.Tensor | None = None,
        m: int = 0,
        n: int = 0,
        unit_keys: torch.Tensor | None = None,
        unit_values: torch.Tensor | None = None,
        unit_log_weight: torch.Tensor | None = None,
        vectorised: bool = True,
        max_runs: int = -1,
        splits: int | None = None,
    ):
        if kind not in KINDS:
            raise ValueError(f"DecodeCall: kind is dense, sparse, best or partial, not {kind}")
        self.kind = kind
        name = {"dense": "arm_decode_read", "sparse": "arm_sparse_decode_read"}.get(kind, f"arm_{kind}_decode_read")
        self.name = name
        self.slots = _Slots(key_codes, key_scale, value_codes, value_scale, bias, mix, name)
        G, S, d, dev = self.slots.G, self.slots.S, self.slots.d, self.slots.kc.device
        self.splits = splits
        self.m, self.n, self.units = m, n, None
        if kind == "dense":
            if any(x is not None for x in (order, start, size, buckets, take, unit_keys)):
                raise ValueError(f"{name}: the dense read takes no index")
            return
        if order is None or start is None or size is None or take is None:
            raise ValueError(f"{name}: order, start, size and take are needed")
        self.order = order.to(device=dev, dtype=torch.int32).contiguous()
        self.start = start.to(device=dev, dtype=torch.int32).contiguous()
        self.size = size.to(device=dev, dtype=torch.int32).contiguous()
        self.take = take.to(device=dev, dtype=torch.int64).contiguous()
        if not (
            self.order.dim() == 2
            and self.order.shape[0] == G
            and self.order.shape[1] <= S
            and self.start.dim() == 2
            and self.start.shape[0] == G
            and self.size.shape == self.start.shape
            and self.take.shape == (G,)
        ):
            raise ValueError(f"{name}: order [G, <= S], start and size [G, N_b], take [G]")
        self.nb = self.start.shape[1]
        if kind == "sparse":
            if buckets is None:
                raise ValueError(f"{name}: buckets are needed")
            self.buckets = buckets.to(device=dev, dtype=torch.int64).contiguous()
            if self.buckets.dim() != 2 or self.buckets.shape[0] != G:
                raise ValueError(f"{name}: buckets [G, M]")
            self.m = self.buckets.shape[1]
        else:
            if not 1 <= m <= self.nb:
                raise ValueError(f"{name}: 1 <= m <= N_b")
            if kind == "partial" and not 1 <= n <= d // 2:
                raise ValueError(f"{name}: 1 <= n <= d / 2")
        given = [x is not None for x in (unit_keys, unit_values, unit_log_weight)]
        if any(given) and not all(given):
            raise ValueError(f"{name}: unit_keys, unit_values and unit_log_weight come together")
        if all(given):
            uk, uv = (t.to(device=dev, dtype=torch.float32).contiguous() for t in (unit_keys, unit_values))
            ulw = unit_log_weight.to(device=dev, dtype=torch.float32).contiguous()
            if uk.shape != (G, self.nb, d) or uv.shape != uk.shape or ulw.shape != (G, self.nb):
                raise ValueError(
                    f"{name}: unit_keys and unit_values [G, U, d], unit_log_weight [G, U], U the index's units"
                )
            self.units = (uk, uv, ulw)

    def nbytes(self) -> int:
        """Bytes kept beside the index from call to call: none (the C++ call's runs of slots
        have no counterpart here)."""
        return 0

    def __call__(self, query, own_k, own_v, own_ok, exact_k, exact_v, exact_ok, scaling: float):
        t = _Tokens(query, own_k, own_v, own_ok, exact_k, exact_v, exact_ok, self.slots.G, self.slots.d, self.name)
        _check_device(t.q[0], self.name)
        if self.kind == "dense":
            return self._read(t, scaling, None)
        if self.kind == "sparse":
            return self._read(t, scaling, self.buckets)
        chosen = self._rank(t, scaling)
        return self._read(t, scaling, chosen), chosen

    # ------------------------------------------------------------------ the two passes
    def _read(self, t: _Tokens, scaling: float, chosen: torch.Tensor | None) -> torch.Tensor:
        k = _kernels()
        sl = self.slots
        G, S, d = sl.G, sl.S, sl.d
        R, dev = t.R, sl.kc.device
        BR, BH = _pow2(R), _pow2((d + 1) // 2)
        BS = 32 if dev.type == "cpu" else 64
        if chosen is None:  # dense: the slots cut into NS shares of CHUNK (a multiple of BS)
            want = self.splits or max(
                1, -(-512 // G)
            )  # (about 4 programs a multiprocessor of an H100, over the groups)
            per = -(-S // max(1, min(want, -(-S // BS))))  # slots a share, then rounded up to whole blocks
            CHUNK = max(BS, -(-per // BS) * BS)
            NS = max(1, -(-S // CHUNK))
            M, units, has_order, nb, BC = 0, None, False, 0, 16
            order = start = size = take = chosen_t = _dummy(dev)
        else:  # sparse: BC chosen units a share
            M, units, nb = chosen.shape[1], self.units, self.nb
            BC = min(_pow2(M), 16)
            NS = max(1, -(-M // BC))
            CHUNK = 0
            has_order = self.order.shape[1] > 0
            order, start, size, take, chosen_t = self.order, self.start, self.size, self.take, chosen
        U = nb if units is not None else 0
        uk, uv, ulw = units if units is not None else (_dummy(dev),) * 3
        UCHUNK = max(BS, -(-U // BS // max(1, -(-128 // G))) * BS) if U else BS  # (the skipped units' shares)
        NP = NS + 1 + (-(-U // UCHUNK) if U else 0)
        part_m = torch.empty(G, NP, BR, dtype=torch.float32, device=dev)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(G, NP, BR, 2, BH, dtype=torch.float32, device=dev)
        q, kk, vv, ek, ev = t.q, t.kk, t.vv, t.ek, t.ev
        k.decode_partials[(G, NP)](
            *q, *kk, *vv, *t.ok, *ek, *ev, *t.eok,
            *sl.args(),
            order, order.stride(0) if has_order else 0, start, size, chosen_t, take,
            uk, uv, ulw,
            part_m, part_l, part_acc,
            t.H, R, t.L, S, d, d // 2, d // sl.ngk, d // sl.ngv, nb, M, U, CHUNK, UCHUNK, NS, NP, float(scaling),
            MIXED=sl.mix is not None, KEY_INT8=sl.int8_keys, SPARSE=chosen is not None, HAS_ORDER=has_order,
            HAS_UNITS=units is not None, BR=BR, BH=BH, BS=BS, BM=min(_pow2(M), 64), BC=BC,
        )  # fmt: skip
        out, o_sb, o_sh = t.out(d)
        k.decode_combine[(G,)](
            part_m, part_l, part_acc, out, o_sb, o_sh, sl.mix if sl.mix is not None else _dummy(dev),
            t.H, R, d, d // 2, NS, NP,
            MIXED=sl.mix is not None, BR=BR, BH=BH,
        )  # fmt: skip
        return out

    def _rank(self, t: _Tokens, scaling: float) -> torch.Tensor:
        """Each group's m best units, best first, ties to the lower id: [G, m] int64."""
        k = _kernels()
        sl = self.slots
        G, d, R, dev = sl.G, sl.d, t.R, sl.kc.device
        qm = t.flat_query()
        if sl.mix is not None:
            qm = (qm @ sl.mix).contiguous()
        partial = self.kind == "partial"
        n = self.n if partial else 0
        if partial:  # (read.partial_rows and the rounding of MemoryState.partial_key_scores)
            from armkv.memory.read import partial_rows

            rows = partial_rows(qm, n)
            channels = torch.cat([rows, rows + d // 2], 1)
            sel = qm.gather(2, channels.unsqueeze(1).expand(G, R, 2 * n))
            peak = sel.abs().amax(-1, keepdim=True)
            step = torch.where(peak > 0, peak / 127, torch.ones_like(peak))
            qi = torch.round(sel / step).clamp(-127, 127).contiguous()
            f = (step.squeeze(-1) * scaling).contiguous()
            rows = rows.to(torch.int32).contiguous()
        else:
            qi = f = rows = _dummy(dev)
        best = torch.empty(G, self.nb, dtype=torch.float32, device=dev)
        has_order = self.order.shape[1] > 0
        kc, ks, b = sl.kc, sl.ks, sl.bias
        BU = 16  # units a program ranks
        k.unit_best[(G, -(-self.nb // BU))](
            qm, kc, kc.stride(0), kc.stride(1), ks, ks.stride(0), ks.stride(1), b, b.stride(0),
            self.order, self.order.stride(0) if has_order else 0, self.start, self.size, best,
            qi, f, rows,
            R, d, d // 2, d // sl.ngk, self.nb, n, float(scaling),
            PARTIAL=partial, KEY_INT8=sl.int8_keys, HAS_ORDER=has_order, NGK=sl.ngk,
            BR=_pow2(R), BH=_pow2((d + 1) // 2), BS=32 if dev.type == "cpu" else 64, BN=_pow2(n), BU=BU,
        )  # fmt: skip
        return best.sort(dim=1, descending=True, stable=True).indices[:, : self.m].contiguous()


def dense_chunk_read(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    exact_k: torch.Tensor,
    exact_v: torch.Tensor,
    exact_valid: torch.Tensor,
    state,
    slot_bias: torch.Tensor,
    block: int | None = None,
) -> torch.Tensor:
    """A prefill chunk's read of every slot of the pool, the exact entries and the chunk
    (causally) in one softmax, float32 inside: ``read.gathered_read`` with every slot of
    ``state`` (a packed :class:`MemoryState`, int4 or int8 keys and int4 values, as stored:
    mixed codes are read with the mixed query) read by every query.

    query [B, Hq, T, d] (post-RoPE); key, value [B, H, T, d] the chunk; valid [B, T];
    exact_k, exact_v [B, H, L, d], exact_valid [B, L]; slot_bias [B, H, S] or [G, S] (-inf:
    free) -> [B, T, Hq, d] in the query's dtype. ``block``: query rows (tokens x heads of a
    KV head) a program reads (None: 64 on a GPU)."""
    k = _kernels()
    if state.key_scale is None:
        raise ValueError("dense_chunk_read: a packed pool (slot_format k4v4 or k8v4)")
    mix = None
    if state.mixed:
        from armkv.memory.quant import mixing_matrix

        mix = mixing_matrix(state.value.shape[-1] * 2, torch.float32, state.value.device)
    sl = _Slots(state.key, state.key_scale, state.value, state.value_scale, slot_bias, mix, "dense_chunk_read")
    B, Hq, T, d = query.shape
    H, L = key.shape[1], exact_k.shape[2]
    if B * H != sl.G or Hq % H or d != sl.d:
        raise ValueError("dense_chunk_read: the chunk's shapes do not match the pool's groups or head size")
    _check_device(query, "dense_chunk_read")
    R = Hq // H
    q, kk, vv, ek, ev = (_rows(x) for x in (query, key, value, exact_k, exact_v))
    va, eok = _flag(valid), _flag(exact_valid)
    out = torch.empty(B, T, Hq, d, dtype=query.dtype, device=query.device)
    BM = block or (16 if query.device.type == "cpu" else 64)
    BS = 32 if query.device.type == "cpu" else 64
    k.chunk_read[(sl.G, -(-(T * R) // BM))](
        q, q.stride(0), q.stride(1), q.stride(2), q.stride(3),
        kk, kk.stride(0), kk.stride(1), kk.stride(2), vv, vv.stride(0), vv.stride(1), vv.stride(2),
        va, va.stride(0), va.stride(1),
        ek, ek.stride(0), ek.stride(1), ek.stride(2), ev, ev.stride(0), ev.stride(1), ev.stride(2),
        eok, eok.stride(0), eok.stride(1) if L > 1 else 1,
        *sl.args(),
        out, out.stride(0), out.stride(1), out.stride(2),
        H, R, T, L, sl.S, d, d // 2, d // sl.ngk, d // sl.ngv, float(scaling),
        MIXED=mix is not None, KEY_INT8=sl.int8_keys, BM=BM, BH=_pow2((d + 1) // 2), BS=BS,
    )  # fmt: skip
    return out
