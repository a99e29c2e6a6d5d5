"""ARM-specific behaviour of the cache method (the generic matrix in test_hf / test_methods
covers every registered method, arm and fifo included)."""

import pytest
import torch

from armkv.config import slot_bytes
from armkv.errors import ArmkvError
from armkv.hf.attach import make_cache
from conftest import DEVICES, DTYPES, TOLERANCE, dtype_id, tiny_model


def _run(model, ids, **kw):
    cache = make_cache(model, "arm", chunk=16, **kw)
    with torch.no_grad():
        logits = model(ids, past_key_values=cache, use_cache=True).logits
    return logits, cache


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_large_memory_reads_equal_exact_attention(dtype, device):
    """Distinct tokens in a memory with room for all: each token written alone into its slot
    (in float32, stored in the model's dtype) and every bucket read, so the logits are exact
    attention's, within the dtype's conftest.TOLERANCE."""
    model = tiny_model("llama", dtype=dtype, device=device)
    torch.manual_seed(0)
    ids = torch.stack([torch.randperm(100)[:90] for _ in range(2)]).to(device)  # distinct tokens: no merges
    with torch.no_grad():
        ref = model(ids).logits
    logits, cache = _run(model, ids, budget=512, arm_overrides={"sync": 1, "slot_format": "model"})
    torch.testing.assert_close(logits, ref, **TOLERANCE[dtype])
    assert cache.layers[0].diagnostics()["tokens_per_slot"] == 1.0
    assert cache.layers[0].state.key.dtype == dtype  # the "model" format: the model's dtype


@pytest.mark.parametrize(
    "overrides",
    [
        {"position_mode": "fixed"},
        {"sync": 1},
        {"write": "mean"},
        {"top_m": "fixed", "m_fixed": 1},
        {"empty_slot_rule": False},
        {"log_count_bias": False},
        {"pool": "paper"},
        {"slot_format": "bfloat16"},
        {"slot_format": "int8"},
        {"slot_format": "k8v4"},
        {"slot_format": "k4v4"},
        {"protect_recent": 0.5},
        {"lazy_merge": False},
        {"slot_ladder": "k8v4"},
        {"slot_ladder": "bfloat16,int8,k8v4"},
    ],
)
def test_ablation_switches_run_within_budget(overrides):
    model = tiny_model("llama").eval()
    ids = torch.randint(0, 100, (1, 200))
    logits, cache = _run(model, ids, budget=48, arm_overrides=overrides)
    assert torch.isfinite(logits).all()
    info_budget = (
        48 * 2 * model.config.num_key_value_heads * (model.config.hidden_size // model.config.num_attention_heads) * 4
    )
    assert all(layer.peak_bytes <= info_budget for layer in cache.layers)


@pytest.mark.parametrize("slot_format,tol", [("bfloat16", 3e-2), ("int8", 3e-2), ("k8v4", 6e-2), ("k4v4", 2e-1)])
def test_packed_slots_buy_more_slots_and_read_close_to_exact(slot_format, tol):
    model = tiny_model("llama").eval()
    ids = torch.stack([torch.randperm(100)[:90] for _ in range(2)])  # distinct tokens: no merges
    with torch.no_grad():
        ref = model(ids).logits
    logits, cache = _run(model, ids, budget=512, arm_overrides={"sync": 1, "slot_format": slot_format})
    torch.testing.assert_close(logits, ref, rtol=tol, atol=tol)  # only the storage rounding differs
    _, plain = _run(model, ids, budget=512, arm_overrides={"sync": 1, "slot_format": "model"})
    layer, base = cache.layers[0], plain.layers[0]
    assert layer.slots > 1.8 * base.slots  # the same bytes hold more slots
    assert layer.state.key.element_size() < 4
    kv, d = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    assert layer.peak_bytes <= 2 * 512 * 2 * kv * d * 4  # two sequences within the budget in bytes


def test_slot_ladder_keeps_precise_codes_until_a_write_would_merge(monkeypatch):
    """slot_ladder="int8,k8v4": the pool starts as int8 slots (fewer in the same bytes) and
    climbs to k8v4 and then k4v4 (the configured format) only when a write would otherwise
    have to merge; every climb re-packs every slot (the same tokens, positions and counts,
    the codes of the coarser format) and keeps the state within the bytes of the budget.
    While a context fits the first rung the cache reads exactly as an int8 pool of that size."""
    from armkv.memory.pool import SlotPool
    from armkv.memory.state import MemoryState

    model = tiny_model("llama").eval()
    kv, d = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    bound = 2 * 96 * 2 * kv * d * 4  # two sequences, budget 96
    climbs, writes = [], []
    make_room = SlotPool.climb

    def checked_room(self, packed, valid, dtype):
        rung = self.rung
        out = make_room(self, packed, valid, dtype)
        if self.rung != rung:
            # the climb keeps every slot: floats of the new codes equal the old floats re-packed
            old = packed.unpack(torch.float32)
            G, S, _ = old.key.shape
            new = out.unpack(torch.float32)
            assert out.slots == self.rungs[self.rung][1] > S
            assert torch.equal(new.count[:, :S], old.count) and torch.equal(new.pos[:, :S], old.pos)
            assert torch.equal(new.bucket[:, :S], old.bucket) and (new.count[:, S:] == 0).all()
            assert (new.bucket[:, S:] == -1).all() and (new.key[:, S:] == 0).all()
            want = MemoryState(old.key, old.value, old.pos, old.count, old.bucket).pack(self.slot_format, mix=True)
            torch.testing.assert_close(
                out.unpack(torch.float32).key[:, :S], want.unpack(torch.float32).key, rtol=0, atol=1e-6
            )
            climbs.append(self.rung)
        writes.append((self.rung, len(self.rungs) - 1, int((out.count == 0).sum(1).min()), int(valid.sum(1).max())))
        return out

    monkeypatch.setattr(SlotPool, "climb", checked_room)
    torch.manual_seed(4)
    ids = torch.stack([torch.randperm(100)[:90] for _ in range(2)])  # distinct tokens
    ladder = make_cache(model, "arm", budget=96, chunk=16, arm_overrides={"slot_ladder": "int8,k8v4"})
    layer = ladder.layers[0]
    assert [f for f, _ in layer.pool.rungs] == ["int8", "k8v4", "k4v4"]
    assert layer.pool.rungs[0][1] < layer.pool.rungs[1][1] < layer.pool.rungs[2][1]
    with torch.no_grad():
        short = model(ids[:, :60], past_key_values=ladder, use_cache=True).logits
    assert not climbs and layer.pool.rung == 0 and layer.state.key.dtype == torch.int8 and layer.state.count.max() == 1
    # a part-filled pool holds only what it has grown to, nothing reserved
    whole = layer.state.groups * max(s * slot_bytes(f, layer.info.head_dim, 4) for f, s in layer.pool.rungs)
    assert layer.pool.reserve is None and layer.state.nbytes() < whole
    # the same reads as a plain int8 pool with the first rung's slots
    plain = make_cache(
        model, "arm", budget=96, chunk=16, arm_overrides={"slot_format": "int8", "slots": layer.pool.rungs[0][1]}
    )
    with torch.no_grad():
        torch.testing.assert_close(short, model(ids[:, :60], past_key_values=plain, use_cache=True).logits)
        model(ids[:, 60:], past_key_values=ladder, use_cache=True)
        long = torch.randint(0, 100, (2, 300))
        model(long, past_key_values=ladder, use_cache=True)
    assert climbs and all(lyr.pool.rung == 2 and lyr.state.key.dtype == torch.uint8 for lyr in ladder.layers)
    assert layer.state.nbytes() + layer.pool.reserve.nbytes == whole  # the largest rung's footprint once whole
    # no rung but the last ever wrote with fewer free slots than tokens (which would merge)
    assert all(free >= need for rung, last, free, need in writes if rung < last)
    assert all(lyr.peak_bytes <= bound for lyr in ladder.layers)


@pytest.mark.parametrize("overrides", [{}, {"slot_format": "model"}, {"top_m": "fixed", "m_fixed": 2}])
def test_reads_stop_at_the_last_slot_any_row_holds(overrides, monkeypatch):
    """Writes fill the lowest free slots first, so reads (prefill chunks and decode steps)
    take only the first ``reach`` slots; the free ones past it would take no weight. The
    logits equal those of reading every slot, with rows of different lengths (padding)."""
    from armkv.memory.pool import SlotPool

    model = tiny_model("llama").eval()
    torch.manual_seed(5)
    ids = torch.randint(0, 100, (2, 70))
    mask = torch.ones_like(ids)
    mask[1, :25] = 0

    def run():
        cache = make_cache(model, "arm", budget=160, chunk=16, arm_overrides=dict(overrides))
        with torch.no_grad():
            out = [model(ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits]
            token = out[0][:, -1:].argmax(-1)
            for _ in range(20):
                mask_step = torch.cat([mask, torch.ones(2, len(out), dtype=mask.dtype)], 1)
                out.append(model(token, attention_mask=mask_step, past_key_values=cache, use_cache=True).logits)
                token = out[-1][:, -1:].argmax(-1)
        return out, cache

    got, cache = run()
    layer = cache.layers[0]
    assert 0 < layer.pool.reach < layer.slots  # the pool is part-filled: reads skip its tail
    assert (layer.state.count[:, layer.pool.reach :] == 0).all()
    monkeypatch.setattr(SlotPool, "readable", lambda self, whole=False: self.state)
    want, _ = run()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_diagnostics_report_exact_tokens():
    model = tiny_model("llama").eval()
    ids = torch.randint(0, 100, (1, 200))
    _, cache = _run(model, ids, budget=48)
    d = cache.layers[0].diagnostics(torch.tensor([0, 199]))  # a sink and the newest token
    assert d["exact_share"] == 1.0 and 0 < d["slots_used"] <= d["slots"]


def test_adapter_options_are_checked(tmp_path):
    model = tiny_model("llama").eval()
    with pytest.raises(ArmkvError, match="not a folder"):
        make_cache(model, "arm", budget=64, adapter=str(tmp_path / "nope"))
    with pytest.raises(ArmkvError, match="change the adapter"):
        make_cache(model, "arm", budget=64, arm_overrides={"depth": 5})
    with pytest.raises(ArmkvError, match="slot_ladder.*'int3' is not one of"):
        make_cache(model, "arm", budget=64, arm_overrides={"slot_ladder": "k8v4,int3"})
    paper = make_cache(model, "arm", budget=64, arm_overrides={"slot_ladder": "k8v4", "pool": "paper"})
    assert [len(layer.pool.rungs) for layer in paper.layers] == [1] * len(
        paper.layers
    )  # fixed slots a bucket: no ladder


def test_shipped_adapters_load_for_the_default_model_shape():
    """The shipped adapter fits SmolLM2-135M (30 layers, 3 KV heads, head size 64) and is what
    --method arm uses when no adapter is named; it is the only one that ships."""
    from armkv.memory.module import ARMModel
    from armkv.methods.arm import DEFAULT_ADAPTER_ORDER, SHIPPED_ADAPTERS, shipped_adapter
    from armkv.methods.base import ModelInfo

    info = ModelInfo(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_positions=8192)
    assert (
        shipped_adapter(info).name.endswith("-" + DEFAULT_ADAPTER_ORDER[0]) and DEFAULT_ADAPTER_ORDER[0] == "calibrated"
    )
    assert DEFAULT_ADAPTER_ORDER == ("calibrated",)
    (folder,) = SHIPPED_ADAPTERS.iterdir()
    assert folder.name.endswith("-calibrated")
    ARMModel.load(folder).check_fits(30, 3, 64)


def test_the_calibrated_adapters_shares_are_the_default_rule_on_its_scores():
    """The shipped calibrated adapter's budget shares are what calibrate's default rule
    (lift-late, docs/design.md) gives for the retrieval scores stored with them."""
    from armkv.memory.module import ARMModel
    from armkv.methods.arm import SHIPPED_ADAPTERS, retrieval_layer_weights

    (folder,) = SHIPPED_ADAPTERS.glob("*-calibrated")
    config = ARMModel.load(folder).config
    assert config.layer_weights == retrieval_layer_weights(config.meta["retrieval_scores"])


F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize(
    "overrides,dtype",
    [
        ({"slot_format": "k8v4"}, F32),
        ({"slot_format": "k8v4", "slot_mixing": False}, F32),
        ({"slot_format": "model"}, F32),
        ({"slot_format": "k4v4", "log_count_bias": False}, F32),
        ({"slot_ladder": "int8,k8v4"}, F32),
        ({"slot_format": "k4v4"}, BF16),
        ({"slot_format": "model"}, BF16),
    ],
    ids=lambda x: dtype_id(x) if isinstance(x, torch.dtype) else None,
)
def test_decode_read_equals_the_chunk_read(overrides, dtype):
    """The decode step's own read (one query, nothing the size of the state copied, mixed
    slots read with the mixed query) against the general joint-softmax read, on a state with
    merged slots, waiting tokens, an unfilled row and a padding token; in bfloat16 within
    two roundings of the output (the two reads round the logits and weights differently)."""
    model = tiny_model("llama", dtype=dtype)
    torch.manual_seed(1)
    ids = torch.randint(0, 100, (2, 157))
    mask = torch.ones_like(ids)
    mask[1, :120] = 0  # row 1: a shorter, left-padded prompt
    # eager merging: merged slots in a pool that still has room
    cache = make_cache(model, "arm", budget=48, chunk=16, arm_overrides={"sync": 5, "lazy_merge": False, **overrides})
    with torch.no_grad():
        out = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        for _ in range(3):  # leave tokens waiting to be written
            model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    layer = cache.layers[1]
    assert layer.pending is not None and layer.state.count.max() > 1  # merged slots, waiting tokens
    B, H = layer.buffer.sink_k.shape[:2]
    Hq, d = model.config.num_attention_heads, layer.buffer.sink_k.shape[-1]
    query, key, value = (torch.randn(B, h, 1, d).to(dtype) for h in (Hq, H, H))
    valid = torch.tensor([[True], [False]])  # row 1 decodes a padding token
    positions = torch.full((B, 1), 160)
    exact = layer.exact()
    fast = layer.reader.dense(query, key, value, valid, 0.3, *exact)
    ref = layer.reader.masked(query, key, value, valid, positions, 0.3, *exact, reads_all=True)
    assert fast.dtype == dtype
    tol = 1e-5 if dtype == F32 else 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(fast, ref, rtol=tol, atol=tol)
    # the fused kernel (quantised slots on a CPU) against the PyTorch ops it replaces
    torch.testing.assert_close(
        fast, layer.reader.dense(query, key, value, valid, 0.3, *exact, fused=False), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize(
    "overrides",
    [
        {"slot_format": "k4v4"},
        {"slot_format": "k8v4", "slot_mixing": False},
        {"slot_format": "int8"},
        {"slot_format": "bfloat16"},
        {"slot_format": "model", "position_mode": "fixed"},
        {"slot_format": "k4v4", "sync": 1},
        {"slot_ladder": "int8,k8v4"},
    ],
)
def test_incremental_repack_equals_packing_every_slot(overrides, monkeypatch):
    """A write re-packs only the slots it changed (SlotPool.restored); at every write of a
    prefill and of decoding, with merges and a padded row, the result must equal packing the
    whole pool again (SlotPool.stored): the same codes, and scales equal but for the last
    bit (an unchanged slot's key, un-rotated and rotated again, may round its absmax
    differently; the incremental write keeps its codes and scale as they were)."""
    from armkv.memory.pool import SlotPool

    checked = []
    restored = SlotPool.restored

    def both(self, packed, before, after):
        want = self.stored(after)
        got = restored(self, packed, before, after)
        for name in ("key", "value", "key_scale", "value_scale", "pos", "count", "bucket"):
            a, b = getattr(got, name), getattr(want, name)
            if name.endswith("scale") and a is not None:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
            elif a is not None and a.is_floating_point() and name in ("key", "value"):
                torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-6)  # bf16 / model slots
            else:
                assert (a is None and b is None) or torch.equal(a, b), name
        assert got.mixed == want.mixed
        checked.append(int((after.count != before.count).sum()))
        return got

    monkeypatch.setattr(SlotPool, "restored", both)
    model = tiny_model("llama").eval()
    torch.manual_seed(2)
    ids = torch.randint(0, 100, (2, 157))
    mask = torch.ones_like(ids)
    mask[1, :100] = 0
    cache = make_cache(model, "arm", budget=48, chunk=16, arm_overrides={"lazy_merge": False, **overrides})
    with torch.no_grad():
        out = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(20):
            token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    assert len(checked) > 10 and max(checked) > 0
    assert cache.layers[1].state.count.max() > 1  # merges happened


@pytest.mark.parametrize("overrides", [{}, {"position_mode": "fixed"}, {"slot_mixing": False}])
def test_fused_write_passes_equal_their_pytorch_forms(overrides, monkeypatch):
    """At every write of a prefill and of decoding (k4v4 slots, merges, a padded row), the
    pool as the write reads it (SlotPool.write_form) from the fused kernel equals the
    PyTorch form (dequantise, unmix, un-rotate), and so do the neighbour searches of the full
    pool (write.banded_neighbours, tested on its own in tests/test_kernels.py)."""
    from armkv.memory import kernels
    from armkv.memory.pool import SlotPool

    if kernels.int4_read() is None:
        pytest.skip("the fused kernels could not be built here")
    checked = []
    write_form = SlotPool.write_form

    def both(self, packed, dtype, fused=True):
        got, want = write_form(self, packed, dtype), write_form(self, packed, dtype, fused=False)
        for name in ("key", "value", "pos", "count", "bucket"):
            torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-5)
        assert got.key_scale is None and not got.mixed and got.bucket.dtype == torch.long
        checked.append(int((packed.count > 0).sum()))
        return got

    monkeypatch.setattr(SlotPool, "write_form", both)
    model = tiny_model("llama").eval()
    torch.manual_seed(3)
    ids = torch.randint(0, 100, (2, 157))
    mask = torch.ones_like(ids)
    mask[1, :100] = 0
    cache = make_cache(model, "arm", budget=48, chunk=16, arm_overrides={"slot_format": "k4v4", **overrides})
    with torch.no_grad():
        out = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(20):
            token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    assert len(checked) > 10 and max(checked) > 0


@pytest.mark.parametrize(
    "overrides",
    [{}, {"slot_format": "k4v4"}, {"empty_slot_rule": False}, {"slot_format": "model", "position_mode": "fixed"}],
)
def test_a_roomy_write_skips_the_unpack_and_leaves_the_same_state(overrides, monkeypatch):
    """A write whose tokens all fit in free slots reads no stored slot, so _flush gives it
    zero keys and values (SlotPool.roomy_form) in place of un-packing the pool: the states
    after a padded prefill (the ladder climbing, then merges) and 12 decode steps, and the
    logits, equal those of the run that un-packs at every write."""
    from armkv.memory.pool import SlotPool

    roomy = []
    form = SlotPool.roomy_form
    monkeypatch.setattr(SlotPool, "roomy_form", lambda self, *a: roomy.append(1) or form(self, *a))
    model = tiny_model("llama").eval()
    torch.manual_seed(5)
    ids = torch.randint(0, 100, (2, 181))
    mask = torch.ones_like(ids)
    mask[1, :57] = 0
    runs = []
    for skip in (True, False):
        cache = make_cache(model, "arm", budget=48, chunk=16, arm_overrides=overrides)
        for layer in cache.layers:
            layer.pool.skip_roomy_unpack = skip
        logits = []
        with torch.no_grad():
            out = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            for _ in range(12):
                mask = torch.cat([mask, torch.ones_like(token)], 1)
                out = model(token, attention_mask=mask, past_key_values=cache, use_cache=True)
                logits.append(out.logits)
                token = out.logits[:, -1:].argmax(-1)
        runs.append((torch.cat(logits, 1), [layer.state for layer in cache.layers]))
        mask = mask[:, : ids.shape[1]]
        if skip:
            assert roomy, "no write was roomy"
            taken = len(roomy)
    assert len(roomy) == taken  # the reference run never took the shortcut
    (got, got_states), (want, want_states) = runs
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert any(int(st.count.max()) > 1 for st in want_states)  # merges happened after the roomy writes
    for a, b in zip(got_states, want_states):
        for name in ("key", "value", "pos", "count", "bucket", "key_scale", "value_scale"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None)
            if x is not None:
                assert torch.equal(x, y), name


@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=dtype_id)
def test_arm_parameters_stay_float32_on_the_models_device(dtype):
    """A half-precision model: the memory's parameters stay float32 (shared with other caches
    of the adapter, not cast), the memory computes in float32, the slots are stored in their
    format (codes, or the model's dtype), the exact buffer in the model's dtype."""
    model = tiny_model("llama", dtype=dtype)
    cache = make_cache(model, "arm", budget=48, chunk=16, arm_overrides={"sync": 4})
    with torch.no_grad():
        model(torch.randint(3, 100, (1, 120)), past_key_values=cache, use_cache=True)
    layer = cache.layers[0]
    assert {p.dtype for p in layer.memory.parameters()} == {torch.float32} and layer.work_dtype == torch.float32
    assert layer.buffer.k.dtype == dtype and layer.state.key.dtype == torch.uint8  # k4v4 codes
    assert layer.state.count.max() > 1  # the write ran (and merged)
    assert layer.state_bytes() <= 48 * 2 * 2 * 16 * 2  # the budget in the model's bytes (2 KV heads of 16)


def test_arm_parameters_are_copied_to_another_device_once():
    """Shipped or random ARM parameters are copied to the model's device (once per device,
    shared); parameters the caller gave (being trained) are never copied: an error instead."""
    from armkv.config import ARMConfig
    from armkv.memory.module import ARMModel
    from armkv.methods.arm import arm_on_device

    arm = ARMModel(ARMConfig(), 2, 2, 16)
    assert arm_on_device(arm, "cpu") is arm
    moved = arm_on_device(arm, "meta")  # a device with no data: what a copy to a GPU does, without one
    assert moved is not arm and arm_on_device(arm, "meta") is moved
    assert next(moved.parameters()).device.type == "meta" and next(arm.parameters()).device.type == "cpu"
    with pytest.raises(ArmkvError, match="arm.to"):
        arm_on_device(arm, "meta", given=True)


@pytest.mark.parametrize("slot_format", ["k4v4", "model"])
def test_decoding_from_a_short_prompt_writes_nothing_without_failing(slot_format):
    """A prompt shorter than the window: the first `sync` decode steps push out no token, so
    the write every `sync` steps changes no slot (the incremental re-pack gets no rows)."""
    model = tiny_model("llama").eval()
    cache = make_cache(model, "arm", budget=96, chunk=16, arm_overrides={"slot_format": slot_format, "sync": 4})
    token = torch.tensor([[5, 7]])
    with torch.no_grad():
        for _ in range(12):
            token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    layer = cache.layers[0]
    assert layer.state.count.sum() == 0 and layer.seen == 13


def test_layer_weights_share_the_model_budget_unevenly_within_its_total():
    """layer_weights gives each layer a share of num_layers * budget: the weighted layers hold
    more slots, the others fewer, and all of them together stay within the total in bytes."""
    model = tiny_model("llama").eval()
    L = model.config.num_hidden_layers
    ids = torch.randint(0, 100, (1, 200))
    weights = ",".join(["0.5"] + ["1.5"] * (L - 1)) if L > 1 else "1"
    _, cache = _run(model, ids, budget=96, arm_overrides={"layer_weights": weights})
    _, even = _run(model, ids, budget=96)
    kv, d = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    total = L * 96 * 2 * kv * d * 4
    assert sum(layer.peak_bytes for layer in cache.layers) <= total
    if L > 1:
        assert cache.layers[0].slots < even.layers[0].slots < cache.layers[1].slots
    # every layer writes at the same decode steps: the whole budget's sync, whatever its share
    assert {layer.config.sync for layer in cache.layers} == {even.layers[0].config.sync}
    with pytest.raises(ArmkvError, match="layer_weights"):
        _run(model, ids, budget=96, arm_overrides={"layer_weights": "1,2,3"})


def test_a_larger_sync_or_window_is_paid_for_with_slots():
    """sinks, window and sync given as options are held within the same bytes: the pool
    shrinks by what the exact part grows."""
    from armkv.config import slot_bytes

    model = tiny_model("llama").eval()
    base = make_cache(model, "arm", budget=96, arm_overrides={"layer_weights": "even", "slot_ladder": ""}).layers[0]
    more = make_cache(
        model, "arm", budget=96, arm_overrides={"layer_weights": "even", "slot_ladder": "", "sync": 20, "window": 30}
    ).layers[0]
    c0, c1 = base.config, more.config
    assert (c1.sync, c1.window) == (20, 30)
    d = model.config.hidden_size // model.config.num_attention_heads
    token = 2 * d * 4
    assert c1.slots == (96 - c1.sinks - c1.window - c1.sync) * token // slot_bytes(c1.slot_format, d, 4) < c0.slots
    assert c1.state_bytes(d) <= 96 * 2 * d * 4


def test_other_methods_take_a_horizon_without_complaint():
    """make_cache(horizon=N) goes only to a factory that takes it (sink, swa); arm ignores it."""
    model = tiny_model("llama").eval()
    for method in ("sink", "arm"):
        make_cache(model, method, budget=96, chunk=16, horizon=120)
    with pytest.raises(ArmkvError, match="fit_shares_to_length"):
        make_cache(model, "arm", budget=96, chunk=16, fit_shares_to_length=True)  # a removed option


def test_adapters_saved_with_removed_config_fields_still_load(tmp_path):
    """An adapter whose config carries fields armkv no longer has (never read, or options that
    lost: config.REMOVED_FIELDS) loads as if they were absent; any other unknown field is
    still a one-line error naming it."""
    import json

    from armkv.config import REMOVED_FIELDS, ARMConfig
    from armkv.memory.module import ARMModel

    arm = ARMModel(ARMConfig(depth=1, branching=2, slots=8), num_layers=2, num_kv_heads=1, head_dim=8)
    folder = arm.save(tmp_path / "old")
    meta = json.loads((folder / "adapter_config.json").read_text())
    meta["arm_config"].update(balance_alpha=0.01, budget_penalty=0.01, merge_metric="ward")
    assert set(meta["arm_config"]) >= REMOVED_FIELDS
    (folder / "adapter_config.json").write_text(json.dumps(meta))
    loaded = ARMModel.load(folder)
    assert loaded.config == arm.config
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), arm.state_dict().values()))
    meta["arm_config"]["no_such_field"] = 1
    (folder / "adapter_config.json").write_text(json.dumps(meta))
    with pytest.raises(ArmkvError, match="no_such_field"):
        ARMModel.load(folder)
