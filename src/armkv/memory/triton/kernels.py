"""The Triton kernels of ARM's reads (imported only by :mod:`armkv.memory.triton`, which
imports triton lazily). Layouts as the pools store them (``MemoryState.pack``):

- key codes channel-major, int4 uint8 [G, d/2, S] (row c: channel c in the low nibble,
  c + d/2 in the high one, two's complement) or int8 [G, d, S]; scales [G, S, ngk]
  (float32 or bfloat16), channel c in group c // (d / ngk) (int8 keys: one group);
- value codes int4 uint8 [G, S, d/2], scales [G, S, ngv].

Every kernel keeps a vector's two halves apart (channels [0, d/2) and [d/2, d): the two
nibbles of a byte), so that an int4 byte is loaded once and both halves meet the query in
one ``tl.dot`` each. Products are float32 (``input_precision="ieee"``: the codes are small
integers, the query and the scales float32; the interpreter's bfloat16 dot is wrong, and
tf32 would round the query to 10 bits), the softmax is online in float32 (running maximum,
sum and accumulators, flash-attention style). Mixed slots (``slot_mixing``) are read with the
mixed query q Q and their weighted values unmixed once at the end, (w V Q) Q^T.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# float32 products: "tf32x3" on a GPU (three tensor-core passes, float32's accuracy within a few
# ulps, and code that compiles in seconds where "ieee"'s unrolled FMAs take minutes); the
# interpreter computes in float32 whatever it is told
PRECISION = tl.constexpr("ieee" if os.environ.get("TRITON_INTERPRET") == "1" else "tf32x3")


@triton.jit
def _nibbles(x):
    """int4 bytes -> (low, high) nibbles as signed float32."""
    x = x.to(tl.int32)
    lo = ((x & 15) ^ 8) - 8
    hi = ((x >> 4) ^ 8) - 8
    return lo.to(tl.float32), hi.to(tl.float32)


@triton.jit
def _dot(a, b):
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _keys(kc, ks, slot, smask, ch, hmask, half, gsk, kc_sc, ks_ss, KEY_INT8: tl.constexpr):
    """Dequantised keys of ``slot`` [BS]: (channels ch [BH] of the low half, of the high half),
    each [BH, BS] float32 (masked entries 0). kc, ks: the group's codes and scales."""
    mask = hmask[:, None] & smask[None, :]
    if KEY_INT8:
        lo = tl.load(kc + ch[:, None] * kc_sc + slot[None, :], mask=mask, other=0).to(tl.float32)
        hi = tl.load(kc + (ch[:, None] + half) * kc_sc + slot[None, :], mask=mask, other=0).to(tl.float32)
    else:
        lo, hi = _nibbles(tl.load(kc + ch[:, None] * kc_sc + slot[None, :], mask=mask, other=0))
    s_lo = tl.load(ks + slot[None, :] * ks_ss + (ch // gsk)[:, None], mask=mask, other=0).to(tl.float32)
    s_hi = tl.load(ks + slot[None, :] * ks_ss + ((ch + half) // gsk)[:, None], mask=mask, other=0).to(tl.float32)
    return lo * s_lo, hi * s_hi


@triton.jit
def _values(vc, vs, slot, smask, ch, hmask, half, gsv, vc_ss, vs_ss):
    """Dequantised values of ``slot`` [BS]: (low half, high half), each [BS, BH] float32."""
    mask = smask[:, None] & hmask[None, :]
    lo, hi = _nibbles(tl.load(vc + slot[:, None] * vc_ss + ch[None, :], mask=mask, other=0))
    s_lo = tl.load(vs + slot[:, None] * vs_ss + (ch // gsv)[None, :], mask=mask, other=0).to(tl.float32)
    s_hi = tl.load(vs + slot[:, None] * vs_ss + ((ch + half) // gsv)[None, :], mask=mask, other=0).to(tl.float32)
    return lo * s_lo, hi * s_hi


@triton.jit
def _online(m_i, l_i, logits):
    """One block of the online softmax: logits [BR, BN] (-inf: not read) -> (new maximum,
    new sum, the block's weights, the factor the old accumulators take)."""
    m_new = tl.maximum(m_i, tl.max(logits, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(logits - m_safe[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), p, alpha


@triton.jit
def _plain_query(q, rows_ok, ch, hmask, half, q_sr, q_sd, BR: tl.constexpr):
    """A group's R query heads as halves [BR, BH] float32."""
    r = tl.arange(0, BR)
    mask = rows_ok[:, None] & hmask[None, :]
    lo = tl.load(q + r[:, None] * q_sr + ch[None, :] * q_sd, mask=mask, other=0).to(tl.float32)
    hi = tl.load(q + r[:, None] * q_sr + (ch[None, :] + half) * q_sd, mask=mask, other=0).to(tl.float32)
    return lo, hi


@triton.jit
def _mix_tile(mix, ch, hmask, d, row_off, col_off):
    """Q's block [BH, BH]: rows c + row_off, columns j + col_off."""
    mask = hmask[:, None] & hmask[None, :]
    return tl.load(mix + (ch[:, None] + row_off) * d + ch[None, :] + col_off, mask=mask, other=0).to(tl.float32)


@triton.jit
def _mixed(q_lo, q_hi, mix, ch, hmask, half, d):
    """(q_lo | q_hi) Q as halves: each output half from both input halves."""
    lo = _dot(q_lo, _mix_tile(mix, ch, hmask, d, 0, 0)) + _dot(q_hi, _mix_tile(mix, ch, hmask, d, half, 0))
    hi = _dot(q_lo, _mix_tile(mix, ch, hmask, d, 0, half)) + _dot(q_hi, _mix_tile(mix, ch, hmask, d, half, half))
    return lo, hi


@triton.jit
def _query(q, rows_ok, ch, hmask, half, q_sr, q_sd, mix, d, MIXED: tl.constexpr, BR: tl.constexpr):
    """A group's R query heads (rows of q, q_sr apart) in the slots' basis, as halves
    [BR, BH] float32: q Q where the slots are mixed (mix [d, d] row-major), else q."""
    lo, hi = _plain_query(q, rows_ok, ch, hmask, half, q_sr, q_sd, BR)
    if MIXED:
        lo, hi = _mixed(lo, hi, mix, ch, hmask, half, d)
    return lo, hi


@triton.jit
def _slot_block(
    qm_lo, qm_hi, m_i, l_i, acc_lo, acc_hi, slot, smask,
    kc, ks, vc, vs, bias,
    ch, hmask, half, gsk, gsv, kc_sc, ks_ss, vc_ss, vs_ss, scaling,
    KEY_INT8: tl.constexpr,
):  # fmt: skip
    """One block of slots [BS] (smask: which lanes hold one) into the online softmax: their
    logits q.k * scaling + bias, their weighted values."""
    k_lo, k_hi = _keys(kc, ks, slot, smask, ch, hmask, half, gsk, kc_sc, ks_ss, KEY_INT8)
    b = tl.load(bias + slot, mask=smask, other=float("-inf"))
    logits = (_dot(qm_lo, k_lo) + _dot(qm_hi, k_hi)) * scaling + b[None, :]
    logits = tl.where(smask[None, :], logits, float("-inf"))
    m_i, l_i, p, alpha = _online(m_i, l_i, logits)
    v_lo, v_hi = _values(vc, vs, slot, smask, ch, hmask, half, gsv, vc_ss, vs_ss)
    acc_lo = acc_lo * alpha[:, None] + _dot(p, v_lo)
    acc_hi = acc_hi * alpha[:, None] + _dot(p, v_hi)
    return m_i, l_i, acc_lo, acc_hi


@triton.jit
def _read_slots(
    qm_lo, qm_hi, m_i, l_i, acc_lo, acc_hi, p0, n,
    order, kc, ks, vc, vs, bias,
    ch, hmask, half, gsk, gsv, kc_sc, ks_ss, vc_ss, vs_ss, scaling,
    HAS_ORDER: tl.constexpr, KEY_INT8: tl.constexpr, BS: tl.constexpr,
):  # fmt: skip
    """The online softmax over the slots listed at positions [p0, p0 + n) of ``order`` (or,
    without one, slots p0 ..)."""
    for s0 in range(0, n, BS):
        j = s0 + tl.arange(0, BS)
        smask = j < n
        if HAS_ORDER:
            slot = tl.load(order + p0 + j, mask=smask, other=0)
        else:
            slot = p0 + j
        m_i, l_i, acc_lo, acc_hi = _slot_block(
            qm_lo, qm_hi, m_i, l_i, acc_lo, acc_hi, slot, smask, kc, ks, vc, vs, bias,
            ch, hmask, half, gsk, gsv, kc_sc, ks_ss, vc_ss, vs_ss, scaling, KEY_INT8,
        )  # fmt: skip
    return m_i, l_i, acc_lo, acc_hi


@triton.jit
def _read_units(
    qm_lo, qm_hi, m_i, l_i, acc_lo, acc_hi, u_start, u_size,
    order, kc, ks, vc, vs, bias,
    ch, hmask, half, gsk, gsv, kc_sc, ks_ss, vc_ss, vs_ss, scaling,
    HAS_ORDER: tl.constexpr, KEY_INT8: tl.constexpr, BS: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """The online softmax over the slots of BC units (their lists at positions
    [u_start[k], u_start[k] + u_size[k]) of ``order``, u_size 0 for none), packed end to end
    into blocks of BS: a block holds slots of several small units (pages of a few slots)."""
    k_ids = tl.arange(0, BC)
    ends = tl.cumsum(u_size, 0)
    shift = u_start - (ends - u_size)  # position = lane + shift of the lane's unit
    W = tl.sum(u_size, 0)
    for s0 in range(0, W, BS):
        j = s0 + tl.arange(0, BS)
        smask = j < W
        k = tl.sum((ends[None, :] <= j[:, None]).to(tl.int32), 1)  # the unit whose run holds lane j
        pos = j + tl.sum(tl.where(k_ids[None, :] == k[:, None], shift[None, :], 0), 1)
        if HAS_ORDER:
            slot = tl.load(order + pos, mask=smask, other=0)
        else:
            slot = pos
        slot = tl.where(smask, slot, 0)
        m_i, l_i, acc_lo, acc_hi = _slot_block(
            qm_lo, qm_hi, m_i, l_i, acc_lo, acc_hi, slot, smask, kc, ks, vc, vs, bias,
            ch, hmask, half, gsk, gsv, kc_sc, ks_ss, vc_ss, vs_ss, scaling, KEY_INT8,
        )  # fmt: skip
    return m_i, l_i, acc_lo, acc_hi


@triton.jit
def _unmix_tile(mix, ch, hmask, d, row_off, col_off):
    """Q^T's block [BH, BH]: rows c + row_off, columns j + col_off (Q^T[c, j] = Q[j, c])."""
    mask = hmask[:, None] & hmask[None, :]
    return tl.load(mix + (ch[None, :] + col_off) * d + ch[:, None] + row_off, mask=mask, other=0).to(tl.float32)


@triton.jit
def _finish(acc_lo, acc_hi, pl_lo, pl_hi, inv, orow, rows_ok, ch, hmask, half, mix, d, MIXED: tl.constexpr):
    """out = ((acc_lo | acc_hi) Q^T + (pl_lo | pl_hi)) * inv: the slots' part (mixed basis)
    unmixed, the exact part added, each row at its pointer ``orow`` [rows] (contiguous
    channels), stored in the output's dtype."""
    if MIXED:  # (each output half from both input halves)
        out_lo = _dot(acc_lo, _unmix_tile(mix, ch, hmask, d, 0, 0)) + _dot(
            acc_hi, _unmix_tile(mix, ch, hmask, d, half, 0)
        )
        out_hi = _dot(acc_lo, _unmix_tile(mix, ch, hmask, d, 0, half))
        out_hi += _dot(acc_hi, _unmix_tile(mix, ch, hmask, d, half, half))
    else:
        out_lo = acc_lo
        out_hi = acc_hi
    mask = rows_ok[:, None] & hmask[None, :]
    ty = orow.dtype.element_ty
    tl.store(orow[:, None] + ch[None, :], ((out_lo + pl_lo) * inv[:, None]).to(ty), mask=mask)
    tl.store(orow[:, None] + ch[None, :] + half, ((out_hi + pl_hi) * inv[:, None]).to(ty), mask=mask)


# ---------------------------------------------------------------------- the decode read
@triton.jit
def decode_partials(
    q, q_sb, q_sh, q_sd,
    kk, kk_sb, kk_sh, vv, vv_sb, vv_sh, own_ok, ok_sb,
    ek, ek_sb, ek_sh, ek_sl, ev, ev_sb, ev_sh, ev_sl, eok, eok_sb, eok_sl,
    kc, kc_sg, kc_sc, ks, ks_sg, ks_ss, vc, vc_sg, vc_ss, vs, vs_sg, vs_ss, bias, bias_sg, mix,
    order, order_sg, start, size, chosen, take,
    uk, uv, ulw,
    part_m, part_l, part_acc,
    H, R, L, S, d, half, gsk, gsv, NB, M, U, CHUNK, UCHUNK, NS, NP, scaling,
    MIXED: tl.constexpr, KEY_INT8: tl.constexpr, SPARSE: tl.constexpr, HAS_ORDER: tl.constexpr,
    HAS_UNITS: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr, BS: tl.constexpr,
    BM: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """One group's decode read, split: program (g, p) puts its share's running maximum [BR],
    sum [BR] and weighted values [BR, 2, BH] (mixed basis for slots and units, plain for the
    exact entries) into the partial buffers. p < NS: slots (dense: positions [p CHUNK, ..);
    sparse: chosen units p BC .. p BC + BC - 1, those among the first ``take`` with ids in
    [0, NB)); p = NS: the sinks, window and the token itself; p > NS (HAS_UNITS): UCHUNK of
    the units, those the read skips. NP programs a group in all."""
    g = tl.program_id(0)
    p = tl.program_id(1)
    b = g // H
    h = g % H
    r = tl.arange(0, BR)
    rows_ok = r < R
    ch = tl.arange(0, BH)
    hmask = ch < half
    m_i = tl.full([BR], float("-inf"), tl.float32)
    l_i = tl.zeros([BR], tl.float32)
    acc_lo = tl.zeros([BR, BH], tl.float32)
    acc_hi = tl.zeros([BR, BH], tl.float32)
    qg = q + b * q_sb + h * R * q_sh
    if p < NS:
        qm_lo, qm_hi = _query(qg, rows_ok, ch, hmask, half, q_sh, q_sd, mix, d, MIXED, BR)
        if SPARSE:  # chosen units p BC .. p BC + BC - 1, those among the first `take` with ids in [0, NB)
            c = p * BC + tl.arange(0, BC)
            unit = tl.load(chosen + g * M + c, mask=c < M, other=-1)
            ok = (c < tl.load(take + g)) & (unit >= 0) & (unit < NB)
            at = tl.where(ok, unit, 0)
            u_size = tl.where(ok, tl.load(size + g * NB + at), 0)
            u_start = tl.load(start + g * NB + at)
            m_i, l_i, acc_lo, acc_hi = _read_units(
                qm_lo, qm_hi, m_i, l_i, acc_lo, acc_hi, u_start, u_size,
                order + g * order_sg, kc + g * kc_sg, ks + g * ks_sg, vc + g * vc_sg, vs + g * vs_sg,
                bias + g * bias_sg, ch, hmask, half, gsk, gsv, kc_sc, ks_ss, vc_ss, vs_ss, scaling,
                HAS_ORDER, KEY_INT8, BS, BC,
            )  # fmt: skip
        else:
            p0 = p * CHUNK
            m_i, l_i, acc_lo, acc_hi = _read_slots(
                qm_lo, qm_hi, m_i, l_i, acc_lo, acc_hi, p0, tl.minimum(CHUNK, S - p0),
                order, kc + g * kc_sg, ks + g * ks_sg, vc + g * vc_sg, vs + g * vs_sg, bias + g * bias_sg,
                ch, hmask, half, gsk, gsv, kc_sc, ks_ss, vc_ss, vs_ss, scaling,
                False, KEY_INT8, BS,
            )  # fmt: skip
    elif p == NS:  # the exact entries and the token, plain basis
        q_lo, q_hi = _plain_query(qg, rows_ok, ch, hmask, half, q_sh, q_sd, BR)
        ekg = ek + b * ek_sb + h * ek_sh
        evg = ev + b * ev_sb + h * ev_sh
        for l0 in range(0, L, BS):
            ll = l0 + tl.arange(0, BS)
            lmask = ll < L
            ok = tl.load(eok + b * eok_sb + ll * eok_sl, mask=lmask, other=0) != 0
            kmask = hmask[:, None] & lmask[None, :]
            k_lo = tl.load(ekg + ll[None, :] * ek_sl + ch[:, None], mask=kmask, other=0).to(tl.float32)
            k_hi = tl.load(ekg + ll[None, :] * ek_sl + ch[:, None] + half, mask=kmask, other=0).to(tl.float32)
            logits = (_dot(q_lo, k_lo) + _dot(q_hi, k_hi)) * scaling
            logits = tl.where((ok & lmask)[None, :], logits, float("-inf"))
            m_i, l_i, w, alpha = _online(m_i, l_i, logits)
            vmask = lmask[:, None] & hmask[None, :]
            v_lo = tl.load(evg + ll[:, None] * ev_sl + ch[None, :], mask=vmask, other=0).to(tl.float32)
            v_hi = tl.load(evg + ll[:, None] * ev_sl + ch[None, :] + half, mask=vmask, other=0).to(tl.float32)
            acc_lo = acc_lo * alpha[:, None] + _dot(w, v_lo)
            acc_hi = acc_hi * alpha[:, None] + _dot(w, v_hi)
        own = tl.load(own_ok + b * ok_sb) != 0
        kg = kk + b * kk_sb + h * kk_sh
        vg = vv + b * vv_sb + h * vv_sh
        k_lo = tl.load(kg + ch, mask=hmask, other=0).to(tl.float32)
        k_hi = tl.load(kg + ch + half, mask=hmask, other=0).to(tl.float32)
        s = (tl.sum(q_lo * k_lo[None, :], 1) + tl.sum(q_hi * k_hi[None, :], 1)) * scaling
        s = tl.where(own, s, float("-inf"))
        m_new = tl.maximum(m_i, s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        w1 = tl.exp(s - m_safe)
        l_i = l_i * alpha + w1
        m_i = m_new
        v_lo = tl.where(own, tl.load(vg + ch, mask=hmask, other=0).to(tl.float32), 0.0)
        v_hi = tl.where(own, tl.load(vg + ch + half, mask=hmask, other=0).to(tl.float32), 0.0)
        acc_lo = acc_lo * alpha[:, None] + w1[:, None] * v_lo[None, :]
        acc_hi = acc_hi * alpha[:, None] + w1[:, None] * v_hi[None, :]
    elif HAS_UNITS:  # units [(p - NS - 1) UCHUNK, + UCHUNK) the read skips, one entry each (mixed basis)
        qm_lo, qm_hi = _query(qg, rows_ok, ch, hmask, half, q_sh, q_sd, mix, d, MIXED, BR)
        count = tl.minimum(tl.load(take + g), M)
        u_first = (p - NS - 1) * UCHUNK
        for u0 in range(u_first, tl.minimum(u_first + UCHUNK, U), BS):
            uu = u0 + tl.arange(0, BS)
            umask = uu < U
            lw = tl.load(ulw + g * U + uu, mask=umask, other=float("-inf"))
            taken = tl.zeros([BS], tl.int32)
            for c0 in range(0, count, BM):  # (the chosen units, BM at a time)
                c = c0 + tl.arange(0, BM)
                picked = tl.load(chosen + g * M + c, mask=c < count, other=-1)
                taken = tl.maximum(taken, tl.max((uu[:, None] == picked[None, :]).to(tl.int32), 1))
            keep = umask & (taken == 0) & (lw > float("-inf"))
            kmask = hmask[:, None] & umask[None, :]
            k_lo = tl.load(uk + (g * U + uu[None, :]) * d + ch[:, None], mask=kmask, other=0)
            k_hi = tl.load(uk + (g * U + uu[None, :]) * d + ch[:, None] + half, mask=kmask, other=0)
            logits = (_dot(qm_lo, k_lo) + _dot(qm_hi, k_hi)) * scaling + lw[None, :]
            logits = tl.where(keep[None, :], logits, float("-inf"))
            m_i, l_i, w, alpha = _online(m_i, l_i, logits)
            vmask = umask[:, None] & hmask[None, :]
            v_lo = tl.load(uv + (g * U + uu[:, None]) * d + ch[None, :], mask=vmask, other=0)
            v_hi = tl.load(uv + (g * U + uu[:, None]) * d + ch[None, :] + half, mask=vmask, other=0)
            acc_lo = acc_lo * alpha[:, None] + _dot(w, v_lo)
            acc_hi = acc_hi * alpha[:, None] + _dot(w, v_hi)
    at = (g * NP + p) * BR + r
    tl.store(part_m + at, m_i)
    tl.store(part_l + at, l_i)
    base = part_acc + at[:, None] * (2 * BH) + ch[None, :]
    tl.store(base, acc_lo)
    tl.store(base + BH, acc_hi)


@triton.jit
def decode_combine(
    part_m, part_l, part_acc, out, o_sb, o_sh, mix,
    H, R, d, half, NS, NP,
    MIXED: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr,
):  # fmt: skip
    """The second of the pair: one group's partials merged into one softmax (partial NS, the
    exact entries', in the plain basis; the others in the slots'), unmixed and written in the
    output's layout; a head with nothing to read gets zeros."""
    g = tl.program_id(0)
    b = g // H
    h = g % H
    r = tl.arange(0, BR)
    rows_ok = r < R
    ch = tl.arange(0, BH)
    hmask = ch < half
    top = tl.full([BR], float("-inf"), tl.float32)
    for p in range(0, NP):
        top = tl.maximum(top, tl.load(part_m + (g * NP + p) * BR + r))
    safe = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([BR], tl.float32)
    acc_lo = tl.zeros([BR, BH], tl.float32)
    acc_hi = tl.zeros([BR, BH], tl.float32)
    pl_lo = tl.zeros([BR, BH], tl.float32)
    pl_hi = tl.zeros([BR, BH], tl.float32)
    for p in range(0, NP):
        at = (g * NP + p) * BR + r
        f = tl.exp(tl.load(part_m + at) - safe)
        total += tl.load(part_l + at) * f
        base = part_acc + at[:, None] * (2 * BH) + ch[None, :]
        lo = tl.load(base) * f[:, None]
        hi = tl.load(base + BH) * f[:, None]
        exact = p == NS  # (the exact entries' partial: plain basis)
        pl_lo += tl.where(exact, lo, 0.0)
        pl_hi += tl.where(exact, hi, 0.0)
        acc_lo += tl.where(exact, 0.0, lo)
        acc_hi += tl.where(exact, 0.0, hi)
    inv = tl.where(total > 0, 1.0 / tl.where(total > 0, total, 1.0), 0.0)
    orow = out + b * o_sb + (h * R + r) * o_sh
    _finish(acc_lo, acc_hi, pl_lo, pl_hi, inv, orow, rows_ok, ch, hmask, half, mix, d, MIXED)


# ---------------------------------------------------------------------- ranking units
@triton.jit
def unit_best(
    qm, kc, kc_sg, kc_sc, ks, ks_sg, ks_ss, bias, bias_sg, order, order_sg, start, size, best,
    qi, f, rows,
    R, d, half, gsk, U, n, scaling,
    PARTIAL: tl.constexpr, KEY_INT8: tl.constexpr, HAS_ORDER: tl.constexpr, NGK: tl.constexpr,
    BR: tl.constexpr, BH: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, BU: tl.constexpr,
):  # fmt: skip
    """Each unit's ranking score, program (g, i) units i BU .. i BU + BU - 1: the largest over
    the unit's slots and the R heads of the logit q.k * scaling + bias (read_rank="best"; qm
    [G, R, d] float32 the query in the slots' basis), or with PARTIAL of the partial logit over
    the n key-code rows ``rows`` [G, n] (read_rank="partial": qi [G, R, 2n] the rounded query,
    integers, f [G, R] its scale times the scaling; per scale group the integer sum, then
    times the slot's scale) -> best [G, U], -inf for a unit with no slot. The program reads
    the positions of ``order`` its units' lists span (an index lists units one after another:
    one stretch), each lane scored once and given to the unit whose list holds it."""
    g = tl.program_id(0)
    uu = tl.program_id(1) * BU + tl.arange(0, BU)
    umask = uu < U
    r = tl.arange(0, BR)
    rows_ok = r < R
    u_start = tl.load(start + g * U + uu, mask=umask, other=0)
    u_size = tl.load(size + g * U + uu, mask=umask, other=0)
    u_end = u_start + u_size
    first = tl.min(tl.where(u_size > 0, u_start, 2147483647), 0)
    last = tl.max(tl.where(u_size > 0, u_end, 0), 0)
    kcg = kc + g * kc_sg
    ksg = ks + g * ks_sg
    top = tl.full([BU], float("-inf"), tl.float32)
    if PARTIAL:
        jj = tl.arange(0, BN)
        jmask = jj < n
        rw = tl.load(rows + g * n + jj, mask=jmask, other=0)
        qmask = rows_ok[:, None] & jmask[None, :]
        q_lo = tl.load(qi + (g * R + r[:, None]) * 2 * n + jj[None, :], mask=qmask, other=0)
        q_hi = tl.load(qi + (g * R + r[:, None]) * 2 * n + n + jj[None, :], mask=qmask, other=0)
        fr = tl.load(f + g * R + r, mask=rows_ok, other=0)
        g_lo = rw // gsk
        g_hi = (rw + half) // gsk
    else:
        ch = tl.arange(0, BH)
        hmask = ch < half
        qmask = rows_ok[:, None] & hmask[None, :]
        q_lo = tl.load(qm + (g * R + r[:, None]) * d + ch[None, :], mask=qmask, other=0)
        q_hi = tl.load(qm + (g * R + r[:, None]) * d + ch[None, :] + half, mask=qmask, other=0)
    for s0 in range(first, last, BS):
        pos = s0 + tl.arange(0, BS)
        smask = pos < last
        if HAS_ORDER:
            slot = tl.load(order + g * order_sg + pos, mask=smask, other=0)
        else:
            slot = pos
        b = tl.load(bias + g * bias_sg + slot, mask=smask, other=float("-inf"))
        if PARTIAL:
            cmask = jmask[:, None] & smask[None, :]
            if KEY_INT8:
                lo = tl.load(kcg + rw[:, None] * kc_sc + slot[None, :], mask=cmask, other=0).to(tl.float32)
                hi = tl.load(kcg + (rw[:, None] + half) * kc_sc + slot[None, :], mask=cmask, other=0).to(tl.float32)
            else:
                lo, hi = _nibbles(tl.load(kcg + rw[:, None] * kc_sc + slot[None, :], mask=cmask, other=0))
            total = tl.zeros([BR, BS], tl.float32)
            for grp in tl.static_range(NGK):  # (integer sums, exact in float32; then the group's scale)
                part = _dot(tl.where((g_lo == grp)[None, :], q_lo, 0.0), lo)
                part += _dot(tl.where((g_hi == grp)[None, :], q_hi, 0.0), hi)
                sc = tl.load(ksg + slot * ks_ss + grp, mask=smask, other=0).to(tl.float32)
                total += part * sc[None, :]
            logits = total * fr[:, None] + b[None, :]
        else:
            k_lo, k_hi = _keys(kcg, ksg, slot, smask, ch, hmask, half, gsk, kc_sc, ks_ss, KEY_INT8)
            logits = (_dot(q_lo, k_lo) + _dot(q_hi, k_hi)) * scaling + b[None, :]
        lane = tl.max(tl.where(rows_ok[:, None], logits, float("-inf")), 0)  # [BS] each position's best head
        held = (pos[:, None] >= u_start[None, :]) & (pos[:, None] < u_end[None, :]) & smask[:, None]  # [BS, BU]
        top = tl.maximum(top, tl.max(tl.where(held, lane[:, None], float("-inf")), 0))
    tl.store(best + g * U + uu, top, mask=umask)


# ---------------------------------------------------------------------- the chunk read
@triton.jit
def chunk_read(
    q, q_sb, q_sh, q_st, q_sd,
    kk, kk_sb, kk_sh, kk_st, vv, vv_sb, vv_sh, vv_st, valid, va_sb, va_st,
    ek, ek_sb, ek_sh, ek_sl, ev, ev_sb, ev_sh, ev_sl, eok, eok_sb, eok_sl,
    kc, kc_sg, kc_sc, ks, ks_sg, ks_ss, vc, vc_sg, vc_ss, vs, vs_sg, vs_ss, bias, bias_sg, mix,
    out, o_sb, o_st, o_sh,
    H, R, T, L, S, d, half, gsk, gsv, scaling,
    MIXED: tl.constexpr, KEY_INT8: tl.constexpr,
    BM: tl.constexpr, BH: tl.constexpr, BS: tl.constexpr,
):  # fmt: skip
    """A prefill chunk's read of the whole pool (every bucket), the exact entries and the
    chunk itself (causal), one softmax in float32: program (g, i) the BM query rows
    i BM .. of group g, row = t R + r (token t, query head r of the KV head)."""
    g = tl.program_id(0)
    i0 = tl.program_id(1) * BM
    b = g // H
    h = g % H
    row = i0 + tl.arange(0, BM)
    rows_ok = row < T * R
    t = row // R
    rr = row % R
    ch = tl.arange(0, BH)
    hmask = ch < half
    qrow = q + b * q_sb + (h * R + rr) * q_sh + t * q_st  # [BM] pointers
    qmask = rows_ok[:, None] & hmask[None, :]
    q_lo = tl.load(qrow[:, None] + ch[None, :] * q_sd, mask=qmask, other=0).to(tl.float32)
    q_hi = tl.load(qrow[:, None] + (ch[None, :] + half) * q_sd, mask=qmask, other=0).to(tl.float32)
    if MIXED:
        qm_lo, qm_hi = _mixed(q_lo, q_hi, mix, ch, hmask, half, d)
    else:
        qm_lo = q_lo
        qm_hi = q_hi
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc_lo = tl.zeros([BM, BH], tl.float32)
    acc_hi = tl.zeros([BM, BH], tl.float32)
    # the pool: every slot, mixed basis
    m_i, l_i, acc_lo, acc_hi = _read_slots(
        qm_lo, qm_hi, m_i, l_i, acc_lo, acc_hi, 0, S,
        kc, kc + g * kc_sg, ks + g * ks_sg, vc + g * vc_sg, vs + g * vs_sg, bias + g * bias_sg,
        ch, hmask, half, gsk, gsv, kc_sc, ks_ss, vc_ss, vs_ss, scaling,
        False, KEY_INT8, BS,
    )  # fmt: skip
    pl_lo = tl.zeros([BM, BH], tl.float32)
    pl_hi = tl.zeros([BM, BH], tl.float32)
    # the exact entries (plain basis; their accumulators share the running maximum)
    ekg = ek + b * ek_sb + h * ek_sh
    evg = ev + b * ev_sb + h * ev_sh
    for l0 in range(0, L, BS):
        ll = l0 + tl.arange(0, BS)
        lmask = ll < L
        ok = (tl.load(eok + b * eok_sb + ll * eok_sl, mask=lmask, other=0) != 0) & lmask
        kmask = hmask[:, None] & lmask[None, :]
        k_lo = tl.load(ekg + ll[None, :] * ek_sl + ch[:, None], mask=kmask, other=0).to(tl.float32)
        k_hi = tl.load(ekg + ll[None, :] * ek_sl + ch[:, None] + half, mask=kmask, other=0).to(tl.float32)
        logits = tl.where(ok[None, :], (_dot(q_lo, k_lo) + _dot(q_hi, k_hi)) * scaling, float("-inf"))
        m_i, l_i, w, alpha = _online(m_i, l_i, logits)
        vmask = lmask[:, None] & hmask[None, :]
        v_lo = tl.load(evg + ll[:, None] * ev_sl + ch[None, :], mask=vmask, other=0).to(tl.float32)
        v_hi = tl.load(evg + ll[:, None] * ev_sl + ch[None, :] + half, mask=vmask, other=0).to(tl.float32)
        acc_lo = acc_lo * alpha[:, None]
        acc_hi = acc_hi * alpha[:, None]
        pl_lo = pl_lo * alpha[:, None] + _dot(w, v_lo)
        pl_hi = pl_hi * alpha[:, None] + _dot(w, v_hi)
    # the chunk, causally, up to the block's last token
    kg = kk + b * kk_sb + h * kk_sh
    vg = vv + b * vv_sb + h * vv_sh
    last = tl.minimum((i0 + BM - 1) // R + 1, T)
    for j0 in range(0, last, BS):
        jj = j0 + tl.arange(0, BS)
        jmask = jj < T
        ok = (tl.load(valid + b * va_sb + jj * va_st, mask=jmask, other=0) != 0) & jmask
        kmask = hmask[:, None] & jmask[None, :]
        k_lo = tl.load(kg + jj[None, :] * kk_st + ch[:, None], mask=kmask, other=0).to(tl.float32)
        k_hi = tl.load(kg + jj[None, :] * kk_st + ch[:, None] + half, mask=kmask, other=0).to(tl.float32)
        seen = ok[None, :] & (jj[None, :] <= t[:, None])
        logits = tl.where(seen, (_dot(q_lo, k_lo) + _dot(q_hi, k_hi)) * scaling, float("-inf"))
        m_i, l_i, w, alpha = _online(m_i, l_i, logits)
        vmask = (ok & jmask)[:, None] & hmask[None, :]
        v_lo = tl.load(vg + jj[:, None] * vv_st + ch[None, :], mask=vmask, other=0).to(tl.float32)
        v_hi = tl.load(vg + jj[:, None] * vv_st + ch[None, :] + half, mask=vmask, other=0).to(tl.float32)
        acc_lo = acc_lo * alpha[:, None]
        acc_hi = acc_hi * alpha[:, None]
        pl_lo = pl_lo * alpha[:, None] + _dot(w, v_lo)
        pl_hi = pl_hi * alpha[:, None] + _dot(w, v_hi)
    inv = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)
    orow = out + b * o_sb + t * o_st + (h * R + rr) * o_sh
    _finish(acc_lo, acc_hi, pl_lo, pl_hi, inv, orow, rows_ok, ch, hmask, half, mix, d, MIXED)
