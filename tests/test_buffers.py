"""ExactBuffer against a naive per-row Python reference, at odd sizes and random left padding."""

import pytest
import torch

from armkv.methods.buffers import ExactBuffer


class NaiveBuffer:
    """Per-row lists: the first `sinks` valid tokens and the last `window` valid ones."""

    def __init__(self, sinks, window, batch):
        self.sinks, self.window = sinks, window
        self.rows = [{"sinks": [], "window": []} for _ in range(batch)]

    def push(self, key, value, valid, positions):
        lost = []
        for b, row in enumerate(self.rows):
            out = []
            for t in range(key.shape[2]):
                if not valid[b, t]:
                    continue
                tok = (key[b, :, t], value[b, :, t], int(positions[b, t]))
                if len(row["sinks"]) < self.sinks:
                    row["sinks"].append(tok)
                    continue
                row["window"].append(tok)
                if len(row["window"]) > self.window:
                    out.append(row["window"].pop(0))
            lost.append(out)
        return lost


def random_chunk(batch, heads, t, d, start, generator):
    key = torch.randn(batch, heads, t, d, generator=generator)
    value = torch.randn(batch, heads, t, d, generator=generator)
    valid = torch.rand(batch, t, generator=generator) > 0.3
    positions = start[:, None] + valid.long().cumsum(1) - 1
    return key, value, valid, positions


def check_equal(buf, ref):
    keys, values, valid, positions = buf.kv()
    assert (keys.transpose(1, 2)[~valid] == 0).all() and (values.transpose(1, 2)[~valid] == 0).all(), (
        "entries without a token are zero"
    )
    for b, row in enumerate(ref.rows):
        # sinks first; the window in time order after a chunk push, in ring order after
        # decode steps: compare in time order
        sinks = [i for i in range(buf.sinks) if valid[b, i]]
        window = sorted(
            (i for i in range(buf.sinks, valid.shape[1]) if valid[b, i]), key=lambda i: int(positions[b, i])
        )
        got = sinks + window
        want = row["sinks"] + row["window"]
        assert len(got) == len(want)
        for i, (k, v, p) in zip(got, want):
            assert torch.equal(keys[b, :, i], k) and torch.equal(values[b, :, i], v) and int(positions[b, i]) == p


@pytest.mark.parametrize("sinks,window", [(0, 5), (3, 7), (4, 1), (2, 0), (5, 13)])
@pytest.mark.parametrize(
    "chunks",
    [[1] * 7, [3] * 7, [11] * 7, [1, 1, 1, 4, 1, 1, 1, 1, 1, 11, 1, 1, 2, 1], [2, 1, 1, 1, 1, 1, 1, 1, 3, 1, 1, 1]],
    ids=["decode", "chunk3", "chunk11", "decode-then-chunks", "decode-fills-the-sinks"],
)
@pytest.mark.parametrize("fused", [True, False], ids=["fused-push", "torch-push"])
def test_push_matches_naive(sinks, window, chunks, nan_empty, fused):
    """Chunk pushes, one-token pushes (the ring) and both in turn (the ring put back in order;
    sinks that a chunk left part-empty filled by decode steps, which skip the sink update only
    once a chunk push has seen every sink hold a token)."""
    g = torch.Generator().manual_seed(sinks * 100 + window * 10 + len(chunks) + chunks[0])
    batch, heads, d = 3, 2, 5
    buf = ExactBuffer(sinks, window, batch, heads, d)
    buf.fused_push = fused  # the decode push's kernel (where built) or its PyTorch reference
    ref = NaiveBuffer(sinks, window, batch)
    start = torch.zeros(batch, dtype=torch.long)
    for chunk in chunks:
        key, value, valid, positions = random_chunk(batch, heads, chunk, d, start, g)
        start = positions[:, -1] + 1
        lost = buf.push(key, value, valid, positions)
        want = ref.push(key, value, valid, positions)
        # a one-token push always returns one entry (valid or not): decoding needs no host sync
        assert lost.size == (1 if chunk == 1 else max(len(w) for w in want))
        for b, w in enumerate(want):
            idx = [i for i in range(lost.size) if lost.valid[b, i]]
            assert idx == list(range(lost.size - len(w), lost.size)), "overflow is left-padded"
            for i, (k, v, p) in zip(idx, w):
                assert torch.equal(lost.key[b, :, i], k) and torch.equal(lost.value[b, :, i], v)
                assert int(lost.positions[b, i]) == p
        assert (lost.key.transpose(1, 2)[~lost.valid] == 0).all() and (
            lost.value.transpose(1, 2)[~lost.valid] == 0
        ).all()
        check_equal(buf, ref)


def test_left_padding_never_stored():
    buf = ExactBuffer(2, 4, 2, 1, 3)
    key = torch.arange(2 * 6 * 3, dtype=torch.float).view(2, 1, 6, 3)
    valid = torch.tensor([[False, False, False, True, True, True], [True] * 6])
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    lost = buf.push(key, key, valid, positions)
    assert lost.valid.sum(1).tolist() == [0, 0]
    assert buf.sink_valid.sum(1).tolist() == [2, 2]
    assert buf.win_valid.sum(1).tolist() == [1, 4]
    assert buf.sink_pos[0].tolist() == [0, 1] and buf.win_pos[0, -1].item() == 2


def test_fixed_size_and_bytes():
    buf = ExactBuffer(4, 8, 2, 3, 16)
    before = buf.state_bytes()
    assert before == 2 * 2 * 3 * 12 * 16 * 4
    ptr = buf.win_k.data_ptr()
    for _ in range(5):
        buf.push(
            torch.randn(2, 3, 9, 16),
            torch.randn(2, 3, 9, 16),
            torch.ones(2, 9, dtype=torch.bool),
            torch.zeros(2, 9, dtype=torch.long),
        )
    assert buf.state_bytes() == before and buf.win_k.data_ptr() == ptr
