"""armkv.vllm's feeding of one request's tokens to its cache layer, free of vLLM: however an
engine splits the prompt into pieces, and when it recomputes a preempted request from token
0, the outputs and the memory equal the HF path's (the prompt in one call, then one token at
a time), and the memory stays within its budget."""

import pytest
import torch

from armkv.memory.rope import Rotary
from armkv.methods.base import ModelInfo, get_method
from armkv.vllm.feed import RequestMemory
from armkv.vllm.settings import parse_settings

INFO = ModelInfo(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, max_positions=4096)
ROTARY = Rotary(1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32)))
PROMPT, NEW, CHUNK = 150, 40, 64


def make(method: str, budget: int | None, dtype=torch.float32):
    info = ModelInfo(**{**INFO.__dict__, "dtype": dtype})
    options = {"adapter": "random"} if method != "full" else {}
    return get_method(method).make_layer(1, info, ROTARY, budget, CHUNK, **options)


def tokens(dtype=torch.float32, n=PROMPT + NEW):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n, 4, 32, generator=g).to(dtype)
    k = torch.randn(n, 2, 32, generator=g).to(dtype)
    v = torch.randn(n, 2, 32, generator=g).to(dtype)
    return q, k, v


def hf_path(layer, q, k, v):
    """The HF path: the prompt in one attend (chunks of P inside), then one token a call."""
    outs = []
    for lo, hi in [(0, PROMPT)] + [(t, t + 1) for t in range(PROMPT, q.shape[0])]:
        four = [t[lo:hi].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        positions = torch.arange(lo, hi).unsqueeze(0)
        outs.append(layer.attend(*four, torch.ones(1, hi - lo, dtype=torch.bool), positions, 32**-0.5)[0])
    return torch.cat(outs)


def engine_path(memory, q, k, v, pieces):
    outs, pos = [], 0
    for n in pieces:
        outs.append(memory.step(q[pos : pos + n], k[pos : pos + n], v[pos : pos + n], pos, PROMPT, 32**-0.5))
        pos += n
    return torch.cat(outs)


# pieces an engine may schedule: split chunks, odd sizes, a piece that ends the prompt, a
# preempted request's recompute that crosses from the prompt into its generated tokens
SPLITS = {
    "one piece": [PROMPT] + [1] * NEW,
    "pieces of 7": [7] * (PROMPT // 7) + [PROMPT % 7] + [1] * NEW,
    "odd pieces": [1, 63, 2, 30, 54] + [1] * NEW,
    "recomputed": [PROMPT + NEW - 5] + [1] * 5,
    "recomputed in pieces": [100, PROMPT + NEW - 105] + [1] * 5,
}


@pytest.mark.parametrize("method,budget", [("arm", 48), ("fifo", 48), ("full", None)])
@pytest.mark.parametrize("split", list(SPLITS))
def test_pieces_equal_hf_path(method, budget, split):
    q, k, v = tokens()
    ref_layer = make(method, budget)
    ref = hf_path(ref_layer, q, k, v)
    memory = RequestMemory(make(method, budget), CHUNK)
    out = engine_path(memory, q, k, v, SPLITS[split])
    # a recompute's outputs before its last token are not used (the state is what matters)
    first = PROMPT + NEW - 5 if split.startswith("recomputed") else 0
    torch.testing.assert_close(out[first:], ref[first:], atol=2e-5, rtol=1e-4)
    # the memories are equal: the next token reads the same, and they hold the same bytes
    nxt = tokens(n=PROMPT + NEW + 1)
    tail = [t[-1:] for t in nxt]
    a = memory.step(*tail, PROMPT + NEW, PROMPT, 32**-0.5)
    four = [t.transpose(0, 1).unsqueeze(0) for t in tail]
    b = ref_layer.attend(*four, torch.ones(1, 1, dtype=torch.bool), torch.tensor([[PROMPT + NEW]]), 32**-0.5)[0]
    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    assert memory.layer.state_bytes() == ref_layer.state_bytes()
    if budget is not None:
        assert memory.layer.peak_bytes <= INFO.budget_bytes(budget)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pieces_equal_hf_path_narrow_dtypes(dtype):
    q, k, v = tokens(dtype)
    ref = hf_path(make("arm", 48, dtype), q, k, v)
    out = engine_path(RequestMemory(make("arm", 48, dtype), CHUNK), q, k, v, SPLITS["odd pieces"])
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


def test_out_of_step_is_an_error():
    memory = RequestMemory(make("arm", 48), CHUNK)
    q, k, v = tokens()
    memory.step(q[:10], k[:10], v[:10], 0, PROMPT, 1.0)
    with pytest.raises(Exception, match="out of step"):
        memory.step(q[:1], k[:1], v[:1], 20, PROMPT, 1.0)


def test_settings():
    s = parse_settings('{"method": "arm", "budget": 512, "adapter": "random", "options": ["arm.slot_format=int8"]}')
    assert (s.method, s.budget, s.options) == ("arm", 512, {"adapter": "random", "slot_format": "int8"})
    assert parse_settings(s.to_env()) == s
    assert parse_settings('{"method": "full"}').budget is None
    for bad, match in [
        ("{", "not JSON"),
        ('{"method": "kivi"}', "does not serve"),
        ('{"budget": 5, "speed": 1}', "unknown key"),
        ('{"method": "arm", "options": ["kivi.bits=2"]}', "kivi"),
    ]:
        with pytest.raises(Exception, match=match):
            parse_settings(bad)


def test_engine_vllm_without_vllm_names_the_command():
    from armkv.tools import vllm_engine

    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(Exception, match="pip install 'armkv\\[vllm\\]'") as e:
            vllm_engine.require_vllm()
        assert vllm_engine.VLLM_ENV_COMMAND in str(e.value) and "\n" not in str(e.value)
    else:
        vllm_engine.require_vllm()


def _has_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--methods", "full,kivi"], "--engine vllm serves the methods arm, fifo, full, not 'kivi'"),
        (["--methods", "arm", "--compile"], "--compile is the HF path's"),
    ],
)
def test_eval_ruler_engine_vllm_refuses_what_it_does_not_run(tmp_path, capsys, extra, message):
    from armkv.cli import main

    out = tmp_path / "out"
    assert main(["eval", "ruler", "--engine", "vllm", "--lengths", "1k", "--output", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


@pytest.mark.skipif(_has_vllm(), reason="vLLM is installed here")
def test_eval_ruler_engine_vllm_without_vllm_names_the_command(tmp_path, capsys):
    from armkv.cli import main
    from armkv.tools.vllm_engine import VLLM_ENV_COMMAND

    out = tmp_path / "out"
    assert main(["eval", "ruler", "--engine", "vllm", "--methods", "full,arm", "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and VLLM_ENV_COMMAND in err[0] and "armkv eval ruler --engine vllm" in err[0], err
    assert not out.exists()


def test_eval_ruler_engine_is_an_option_with_hf_the_default():
    from armkv.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["eval", "ruler", "--output", "o"]).engine == "hf"
    assert parser.parse_args(["eval", "ruler", "--output", "o", "--engine", "vllm"]).engine == "vllm"
    with pytest.raises(SystemExit):
        parser.parse_args(["eval", "ruler", "--output", "o", "--engine", "sglang"])
