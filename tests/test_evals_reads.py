"""``armkv eval reads``: the slots it says a sparse read skips are the ones the read skips."""

import argparse

import pytest
import torch

from armkv.errors import ArmkvError
from armkv.evals import reads
from test_sparse_read import _chunk, _layer_with_memory


def _settings(**overrides):
    args = argparse.Namespace(**{"ranks": "partial", "page_split": "1", "partial_share": "0.25", **overrides})
    return reads.settings_from(args)


def _full_probs(layer, query, key, valid, scaling, exact_k, exact_valid):
    """The full read's attention on each slot, [B, Hq, S], from the dequantised keys (the reference)."""
    st = layer.reader.readable()
    B, Hq, _, d = query.shape
    H = key.shape[1]
    R, S = Hq // H, st.slots
    keys = st.kv(torch.float32)[0].reshape(B, H, S, d).repeat_interleave(R, 1)
    bias = layer.reader.bias().float().repeat_interleave(R, 1)
    q = query.float()[:, :, 0]
    slots = torch.einsum("bhd,bhsd->bhs", q, keys) * scaling + bias
    exact = torch.einsum("bhd,bhld->bhl", q, exact_k.float().repeat_interleave(R, 1)) * scaling
    exact = exact.masked_fill(~exact_valid[:, None], float("-inf"))
    own = (q * key.float()[:, :, 0].repeat_interleave(R, 1)).sum(-1, keepdim=True) * scaling
    own = own.masked_fill(~valid[:, :, None].expand(B, 1, 1).transpose(1, 2), float("-inf"))
    return torch.softmax(torch.cat([slots, exact, own], -1), -1)[..., :S]


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("rank", ["partial", "best"])
def test_missed_mass_is_the_attention_on_the_slots_the_sparse_read_skips(split, rank):
    overrides = {"read_rank": rank, "slot_mixing": False, "read_pages": True, "page_split": split}
    model, layer = _layer_with_memory(torch.float32, overrides)
    query, key, value, valid, positions = _chunk(model, layer, torch.float32, 1, padded=0)
    exact_k, exact_v, exact_valid = layer.exact()
    m, scaling = 3, 0.3
    layer.reader.m, layer.reader.route_k = torch.tensor([m, m]), m
    settings = [
        {
            "name": "s",
            "rank": rank,
            "page_split": split,
            "partial_share": layer.config.partial_share if rank == "partial" else None,
        }
    ]
    with torch.no_grad():
        missed, share = reads.missed_mass(layer, query, key, valid, scaling, exact_k, exact_valid, settings, m)["s"]
        # the slots the layer's own masked read takes at this M (its reference read)
        best = layer.reader.bucket_scores(query, scaling)
        _, _, occupied, _ = layer.reader.slots()
        mask = layer.reader._masks_for(query, best, occupied, query.shape[1] // key.shape[1])[0][:, :, 0]  # [B, Hq, S]
        p = _full_probs(layer, query, key, valid, scaling, exact_k, exact_valid)
    B, Hq = query.shape[:2]
    torch.testing.assert_close(missed.view(B, Hq), (p * ~mask).sum(-1), rtol=1e-4, atol=1e-5)
    assert 0 < share <= 1 and (missed > 0).any()
    # reading every page misses nothing
    everything = reads.missed_mass(
        layer, query, key, valid, scaling, exact_k, exact_valid, settings, layer.memory.router.num_buckets * 2
    )
    assert float(everything["s"][0].abs().max()) < 1e-6 and everything["s"][1] == pytest.approx(1.0)


def test_tree_missed_mass_is_the_attention_the_tree_read_skips():
    """``tree``: the slots of the buckets the layer's own tree read (read_rank="tree") takes."""
    model, layer = _layer_with_memory(torch.float32, {"read_rank": "tree", "slot_mixing": False})
    query, key, value, valid, positions = _chunk(model, layer, torch.float32, 1, padded=0)
    exact_k, exact_v, exact_valid = layer.exact()
    m, scaling = 3, 0.3
    layer.reader.m, layer.reader.route_k = torch.tensor([m, m]), m
    settings = reads.settings_from(argparse.Namespace(ranks="tree", page_split="1", partial_share="0.25"))
    with torch.no_grad():
        args = (layer, query, key, valid, scaling, exact_k, exact_valid, settings, m)
        choices = reads._sparse_choices(*args, position=positions)
        missed, share = reads.missed_mass(*args, choices=choices)["tree"]
        q_pre = layer.rotary.unrotate(query, positions.unsqueeze(1))
        _, _, occupied, _ = layer.reader.slots()
        mask = layer.reader._masks_for(q_pre, None, occupied, query.shape[1] // key.shape[1])[0][:, :, 0]
        p = _full_probs(layer, query, key, valid, scaling, exact_k, exact_valid)
        cost = reads.read_cost(layer, settings[0], choices[1]["tree"][0], query.shape[-1], m)
        best = {"name": "b", "rank": "best", "page_split": 1, "partial_share": None}
        every = reads._sparse_choices(*args[:7], [best], layer.memory.router.num_buckets, position=positions)
        cost_all = reads.read_cost(layer, best, every[1]["b"][0], query.shape[-1], m)
    B, Hq = query.shape[:2]
    torch.testing.assert_close(missed.view(B, Hq), (p * ~mask).sum(-1), rtol=1e-4, atol=1e-5)
    assert 0 < share < 1 and (missed > 0).any()
    assert 0 < cost and 0 < cost_all


def test_bytes_read_counts_the_ranking_and_the_slots_taken():
    from types import SimpleNamespace

    from armkv.evals.read_cost import bytes_read, router_bytes
    from armkv.memory.route import Router

    G, S, d = 2, 10, 8
    state = SimpleNamespace(
        key=torch.zeros(G, d // 2, S, dtype=torch.uint8),  # int4: d / 2 bytes a slot
        key_scale=torch.zeros(G, S, 1, dtype=torch.bfloat16),  # 2 bytes a slot
        value=torch.zeros(G, S, d // 2, dtype=torch.uint8),
        value_scale=torch.zeros(G, S, 1, dtype=torch.bfloat16),
        count=torch.tensor([[1] * 8 + [0] * 2, [1] * 10]),
    )
    taken = torch.zeros(G, S, dtype=torch.bool)
    taken[0, :3] = True
    slot = 4 + 2 + 4 + 2
    assert bytes_read(state, "best", taken, d) == 18 * (4 + 2) + 3 * slot
    assert bytes_read(state, "partial", taken, d, rows=1) == 18 * (1 + 2) + 3 * slot
    router = Router(2, d, depth=2, branching=4)  # 5 nodes of 4 children
    assert router_bytes(router, 16) == 2 * 5 * 4 * (d * 4 + 4)
    assert router_bytes(router, 2) == 2 * (1 + 2) * 4 * (d * 4 + 4)  # the beam: at most 2 nodes a level
    assert bytes_read(state, "tree", taken, d, router, 16) == router_bytes(router, 16) + 3 * slot


def test_settings_are_checked_before_anything_runs():
    names = [s["name"] for s in _settings(ranks="partial,best", page_split="1,4", partial_share="0.125,0.25")]
    assert names == [
        "partial, pages/1, rows 0.125",
        "partial, pages/1, rows 0.25",
        "partial, pages/4, rows 0.125",
        "partial, pages/4, rows 0.25",
        "best, pages/1",
        "best, pages/4",
    ]
    assert [s["name"] for s in _settings(ranks="tree,partial", page_split="1,4")] == [
        "tree",
        "partial, pages/1, rows 0.25",
        "partial, pages/4, rows 0.25",
    ]
    for bad in ({"ranks": "leaves"}, {"page_split": "0"}, {"page_split": "x"}, {"partial_share": "1.5"}):
        with pytest.raises(ArmkvError):
            _settings(**bad)


def test_eval_reads_refuses_read_options_it_sets(tmp_path, monkeypatch):
    from armkv.cli import build_parser

    monkeypatch.setattr("armkv.evals.common.load", lambda args: pytest.fail("the model must not load"))
    args = build_parser().parse_args(["eval", "reads", "--output", str(tmp_path / "r"), "--option", "arm.top_m=fixed"])
    with pytest.raises(ArmkvError, match="eval reads sets how the cache reads"):
        reads.main(args)


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("rank", ["partial", "best"])
def test_output_errors_are_those_of_the_layers_own_reads(split, rank):
    """The output errors eval reads reports for a setting are those of the layer's own masked
    read at that M and ranking, without and with ``read_summaries``, against its read of
    every bucket."""
    overrides = {"read_rank": rank, "slot_mixing": False, "read_pages": True, "page_split": split}
    model, layer = _layer_with_memory(torch.float32, overrides)
    query, key, value, valid, positions = _chunk(model, layer, torch.float32, 1, padded=0)
    exact = layer.exact()
    m, scaling = 3, 0.3
    layer.reader.m, layer.reader.route_k = torch.tensor([m, m]), m
    settings = [
        {
            "name": "s",
            "rank": rank,
            "page_split": split,
            "partial_share": layer.config.partial_share if rank == "partial" else None,
        }
    ]
    with torch.no_grad():
        error, summarised = reads.output_errors(
            layer, query, key, value, valid, scaling, *exact[:2], exact[2], settings, m
        )["s"]
        every = layer.reader.masked(query, key, value, valid, positions, scaling, *exact, reads_all=True)[:, 0]
        plain = layer.reader.masked(query, key, value, valid, positions, scaling, *exact, reads_all=False)[:, 0]
        layer.config.read_summaries = True
        with_summaries = layer.reader.masked(query, key, value, valid, positions, scaling, *exact, reads_all=False)[
            :, 0
        ]
    relative = lambda o: ((o - every).norm(dim=-1) / every.norm(dim=-1)).flatten()  # noqa: E731
    torch.testing.assert_close(error, relative(plain), rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(summarised, relative(with_summaries), rtol=1e-3, atol=1e-5)
    assert (error > 0).any() and summarised.mean() < error.mean()
