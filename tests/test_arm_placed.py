"""ARM's state placed in storage a serving engine owns (``ARMLayer.place``, ``memory.arena``):
the same outputs, final state and bytes as the layer on its own tensors, and nothing kept
outside the storage between calls."""

import pytest
import torch

from armkv.memory.arena import ALIGN, carve, layout_bytes, within
from armkv.memory.rope import Rotary
from armkv.methods.base import ModelInfo, get_method
from armkv.methods.buffers import ExactBuffer
from armkv.vllm.feed import RequestMemory, held_tensors

D = 32
ROTARY = Rotary(1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)))
PROMPT, NEW, CHUNK = 173, 37, 32


def info(dtype=torch.float32, heads=(4, 2)) -> ModelInfo:
    return ModelInfo(
        num_layers=2, num_heads=heads[0], num_kv_heads=heads[1], head_dim=D, max_positions=4096, dtype=dtype
    )


def make(method: str, budget: int, dtype=torch.float32, **options):
    return get_method(method).make_layer(1, info(dtype), ROTARY, budget, CHUNK, adapter="random", **options)


def tokens(n: int, dtype, batch: int = 1, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 4, n, D, generator=g).to(dtype)
    k = torch.randn(batch, 2, n, D, generator=g).to(dtype)
    v = torch.randn(batch, 2, n, D, generator=g).to(dtype)
    return q, k, v


def run(layer, q, k, v, settle: bool):
    """The prompt in one call, then one token a call (the HF path), settling after each call."""
    B, n = q.shape[0], q.shape[2]
    outs = []
    for lo, hi in [(0, PROMPT)] + [(t, t + 1) for t in range(PROMPT, n)]:
        positions = torch.arange(lo, hi).expand(B, -1)
        outs.append(
            layer.attend(
                q[:, :, lo:hi],
                k[:, :, lo:hi],
                v[:, :, lo:hi],
                torch.ones(B, hi - lo, dtype=torch.bool),
                positions,
                D**-0.5,
            )
        )
        if settle:
            layer.settle()
    return torch.cat(outs, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "method,budget,options", [("arm", 64, {}), ("arm", 97, {"slot_format": "int8"}), ("fifo", 48, {})]
)
def test_placed_equals_own_tensors(method, budget, options, dtype):
    q, k, v = tokens(PROMPT + NEW, dtype)
    own = make(method, budget, dtype, **options)
    placed = make(method, budget, dtype, **options)
    storage = torch.full(
        (placed.storage_bytes() + 40,), 7, dtype=torch.uint8
    )  # (not zero: the layer zeroes what it needs)
    block = storage[: placed.storage_bytes()]
    placed.place(block)
    a, b = run(own, q, k, v, settle=False), run(placed, q, k, v, settle=True)
    assert torch.equal(a, b)
    # the same state: the next token reads the same; the placed pool holds its largest rung from
    # the start (a pool of its own grows to it as it fills), both within the budget's bytes
    nq, nk, nv = tokens(1, dtype, seed=5)
    step = [nq, nk, nv, torch.ones(1, 1, dtype=torch.bool), torch.tensor([[PROMPT + NEW]]), D**-0.5]
    assert torch.equal(own.attend(*step), placed.attend(*step))
    placed.settle()
    S = own.state.slots  # (a pool of its own may not have grown whole yet: its slots are a prefix)
    assert torch.equal(own.state.count, placed.state.count[:, :S]) and not placed.state.count[:, S:].any()
    assert torch.equal(own.state.value, placed.state.value[:, :S])
    assert own.pool.slots == placed.pool.slots and own.pool.slot_format == placed.pool.slot_format
    assert own.peak_bytes <= placed.peak_bytes <= info(dtype).budget_bytes(budget)
    if own.state.slots == own.pool.slots:  # (the pool of its own is whole: the same bytes)
        assert own.pool.nbytes() == placed.pool.nbytes()
    # everything the layer keeps between calls lies in its storage (the shared mixing matrix aside)
    held = held_tensors(RequestMemory(placed, CHUNK))
    assert held and all(within(t, block) for t in held.values()), [p for p, t in held.items() if not within(t, block)]
    assert storage[-40:].eq(7).all()  # nothing written past it


def test_storage_is_the_budget_plus_bookkeeping():
    """The placed storage: the budget's keys and values (exact tokens, waiting tokens, the pool at
    its largest rung), within the budget's bytes, plus the exact tokens' positions, validity and
    the rows' M (bytes no method counts against a budget) and alignment."""
    for budget in (64, 97, 512):
        layer = make("arm", budget)
        layout = layer.storage_layout()
        bookkeeping = {n for n in layout if n.endswith(("valid", "pos", "head")) or n == "m"}
        kv = sum(torch.empty(s, dtype=d).nbytes for n, (s, d) in layout.items() if n not in bookkeeping)
        kv -= ALIGN * 8  # (the pool region's room for aligning its tensors)
        c = layer.config
        assert kv <= info().budget_bytes(budget)
        assert kv == (c.sinks + c.window + c.sync) * info().token_bytes() + layer.pool.region_bytes(2) - ALIGN * 8
        extra = layer.storage_bytes() - kv
        assert 0 < extra <= 9 * (c.sinks + c.window + c.sync) + 16 + ALIGN * (len(layout) + 8)


def test_placed_in_pieces_and_batch_rows():
    """Fed in an engine's pieces (whole chunks), and for a batch of 3 rows, placed equals own."""
    q, k, v = tokens(PROMPT + NEW, torch.float32, batch=3)
    own, placed = make("arm", 64), make("arm", 64)
    storage = torch.zeros(placed.storage_bytes(3), dtype=torch.uint8)
    placed.place(storage, batch=3)
    assert torch.equal(run(own, q, k, v, settle=False), run(placed, q, k, v, settle=True))
    one_q, one_k, one_v = (t[0].transpose(0, 1) for t in tokens(PROMPT + NEW, torch.float32))
    own, placed = RequestMemory(make("arm", 64), CHUNK), make("arm", 64)
    storage = torch.zeros(placed.storage_bytes(), dtype=torch.uint8)
    placed = RequestMemory(placed.place(storage), CHUNK)
    pos = 0
    for n in [64, 96, PROMPT - 160] + [1] * NEW:
        args = (one_q[pos : pos + n], one_k[pos : pos + n], one_v[pos : pos + n], pos, PROMPT, D**-0.5)
        assert torch.equal(own.step(*args), placed.step(*args))
        placed.layer.settle()
        pos += n
    assert all(within(t, storage) for t in held_tensors(placed).values())


def test_place_errors():
    layer = make("arm", 64)
    with pytest.raises(ValueError, match="too small"):
        layer.place(torch.zeros(layer.storage_bytes() - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        layer.place(torch.zeros(layer.storage_bytes(), dtype=torch.int8))
    q, k, v = tokens(8, torch.float32)
    layer.attend(q, k, v, torch.ones(1, 8, dtype=torch.bool), torch.arange(8)[None], 1.0)
    with pytest.raises(Exception, match="before its first chunk"):
        layer.place(torch.zeros(layer.storage_bytes(), dtype=torch.uint8))


def test_carve_and_buffer_in_given_tensors():
    layout = {"a": ((3, 5), torch.float32), "b": ((7,), torch.bool), "c": ((2, 3), torch.long)}
    storage = torch.zeros(layout_bytes(layout), dtype=torch.uint8)
    views = carve(storage, layout)
    assert [tuple(t.shape) for t in views.values()] == [(3, 5), (7,), (2, 3)]
    assert all(within(t, storage) and t.data_ptr() % ALIGN == 0 for t in views.values())
    views["c"].fill_(-1)
    assert storage.ne(0).sum() == 6 * 8
    spec = ExactBuffer.layout(2, 5, 1, 2, D, torch.float32)
    storage = torch.ones(layout_bytes(spec), dtype=torch.uint8)
    given = ExactBuffer(2, 5, 1, 2, D, tensors=carve(storage, spec))
    own = ExactBuffer(2, 5, 1, 2, D)
    _, k, v = tokens(9, torch.float32)
    for buf in (given, own):
        buf.push(k, v, torch.ones(1, 9, dtype=torch.bool), torch.arange(9)[None])
    assert all(torch.equal(a, b) for a, b in zip(given.kv(), own.kv()))
    assert all(within(t, storage) for t in given.tensors().values())
