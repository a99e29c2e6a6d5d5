"""Shipped model shapes, the ``native`` row (transformers' own cache) and batch > 1 in
``armkv bench decode``. Big shapes are checked on the meta device or shrunk; nothing is timed."""

import json
import math

import pytest
import torch

from armkv.bench.decode import NATIVE, DecodeBench, Session, run_bench
from armkv.cli import main as cli_main
from armkv.errors import ArmkvError
from armkv.hf.model import TOY_WIDTHS as SHRINK
from armkv.hf.model import build_model_from_config, load_model_config, shipped_model_configs

# The published architectures: (model_type, layers, hidden, intermediate, heads, kv heads,
# head_dim, vocab, tied embeddings, parameters).
PUBLISHED = {
    "llama-3.1-8b": ("llama", 32, 4096, 14336, 32, 8, 128, 128256, False, 8_030_261_248),
    "llama-3.2-1b": ("llama", 16, 2048, 8192, 32, 8, 64, 128256, True, 1_235_814_400),
    "qwen3-8b": ("qwen3", 36, 4096, 12288, 32, 8, 128, 151936, False, 8_190_735_360),
    "mistral-7b": ("mistral", 32, 4096, 14336, 32, 8, 128, 32768, False, 7_248_023_552),
    "smollm2-135m": ("llama", 30, 576, 1536, 9, 3, 64, 49152, True, 134_515_008),
}


pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_shipped_names():
    assert set(shipped_model_configs()) == set(PUBLISHED)
    for path in shipped_model_configs().values():
        assert path.stat().st_size < 4096  # hyper-parameters only


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shipped_config_is_the_published_shape(name):
    model_type, layers, hidden, inter, heads, kv, head_dim, vocab, tied, params = PUBLISHED[name]
    config = load_model_config(name)
    assert config.model_type == model_type
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (layers, hidden, inter)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (heads, kv, head_dim)
    assert (config.vocab_size, config.tie_word_embeddings) == (vocab, tied)
    if name.startswith("llama-3"):
        assert config.rope_parameters["rope_type"] == "llama3"
        assert config.rope_parameters["rope_theta"] == 500000.0
    # laid out on the meta device: the published parameter count, no memory taken
    model = build_model_from_config(name, torch.bfloat16, "meta")
    assert type(model).__name__ == config.architectures[0]
    assert sum(p.numel() for p in model.parameters()) == params
    assert model.device.type == "meta" and model.dtype == torch.bfloat16


@pytest.mark.parametrize("name", sorted(PUBLISHED))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shrunk_shipped_shape_builds_and_runs(name, dtype):
    model = build_model_from_config(name, dtype, "cpu", seed=3, **SHRINK)
    assert model.dtype == dtype and not model.training
    assert model.config._attn_implementation == "sdpa"
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    assert norms and all(bool((p == 1).all()) for p in norms)
    weights = model.model.layers[0].mlp.up_proj.weight.float()
    assert 0.015 < weights.std().item() < 0.025  # the config's initializer_range, 0.02
    rotary = model.model.rotary_emb
    torch.manual_seed(3)
    plain = type(rotary)(load_model_config(name, **SHRINK))  # the RoPE table built the usual way
    assert torch.equal(rotary.inv_freq, plain.inv_freq.to(rotary.inv_freq.dtype))
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    logits = model(torch.randint(3, 256, (2, 9))).logits
    assert logits.shape == (2, 9, 256) and logits.dtype == dtype and bool(logits.isfinite().all())


def test_seeded_builds():
    a = build_model_from_config("llama-3.2-1b", torch.float32, "cpu", seed=1, **SHRINK)
    b = build_model_from_config("llama-3.2-1b", torch.float32, "cpu", seed=1, **SHRINK)
    c = build_model_from_config("llama-3.2-1b", torch.float32, "cpu", seed=2, **SHRINK)
    pairs = list(zip(a.state_dict().values(), b.state_dict().values(), c.state_dict().values()))
    assert all(torch.equal(x, y) for x, y, _ in pairs)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_config_file_and_folder(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({**json.loads(shipped_model_configs()["qwen3-8b"].read_text()), **SHRINK})
    )
    for where in (tmp_path, tmp_path / "config.json"):
        model = build_model_from_config(where, torch.float32, "cpu")
        assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.num_hidden_layers == 2


def test_bad_config_is_one_line_error(tmp_path):
    with pytest.raises(ArmkvError, match="llama-3.1-8b, llama-3.2-1b, mistral-7b, qwen3-8b, smollm2-135m"):
        load_model_config("llama-9b")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ArmkvError, match="not a readable JSON"):
        load_model_config(tmp_path / "bad.json")
    (tmp_path / "odd.json").write_text(json.dumps({"model_type": "no-such-arch"}))
    with pytest.raises(ArmkvError, match="'no-such-arch' is not one this transformers knows"):
        load_model_config(tmp_path / "odd.json")


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--model-config", "llama-9b"],
            "neither a shipped name (llama-3.1-8b, llama-3.2-1b, mistral-7b, qwen3-8b, smollm2-135m)",
        ),
        (["--model-config", "llama-3.2-1b", "--model", "somewhere"], "not both"),
        (["--model-config", "llama-3.2-1b", "--batch", "0"], "--batch 0 must be >= 1"),
        (["--model-config", "llama-3.2-1b", "--option", "native.cache=paged"], "expected one of dynamic, static"),
        (["--model-config", "llama-3.2-1b", "--option", "native.chunk=0"], "native.chunk=0"),
        (["--model-config", "llama-3.2-1b", "--option", "native.bits=4"], "takes only cache= and chunk="),
    ],
)
def test_bad_input_fails_before_the_model_is_built(capsys, monkeypatch, extra, message):
    import armkv.hf.model

    monkeypatch.setattr(armkv.hf.model, "build_model_from_config", lambda *a, **k: pytest.fail("model built"))
    assert cli_main(["bench", "decode", "--no-progress", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def tiny(name="llama-3.2-1b", **overrides):
    return build_model_from_config(name, torch.float32, "cpu", seed=0, **{**SHRINK, **overrides})


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-8b", "mistral-7b"])
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_native_cache_gives_the_full_caches_logits(name, kind):
    """transformers' own cache and armkv's full cache hold the same context, so a chunked
    prefill and decode at batch 2 gives the same logits through either."""
    model = tiny(name)
    bench = DecodeBench(
        methods=[NATIVE, "full"], lengths=[40], budget=64, chunk=16, batch=2, options={NATIVE: {"cache": kind}}
    )
    session = Session(model, bench)
    ids = session.random_ids(40)
    logits = {}
    with torch.inference_mode():
        for method in (NATIVE, "full"):
            cache = session.cache(method, 48)
            rows = []
            for s in range(0, 40, 16):
                pos = torch.arange(s, min(s + 16, 40))[None]
                rows.append(model(input_ids=ids[:, s : s + 16], position_ids=pos, past_key_values=cache).logits)
            token = rows[-1][:, -1:].argmax(-1)
            for i in range(3):
                out = model(input_ids=token, position_ids=torch.tensor([[40 + i]]), past_key_values=cache).logits
                rows.append(out)
                token = out.argmax(-1)
            logits[method] = torch.cat(rows, 1)
            assert type(cache).__name__ == (
                {"dynamic": "DynamicCache", "static": "StaticCache"}[kind] if method == NATIVE else "ArmkvCache"
            )
    assert logits[NATIVE].shape == (2, 43, 256)
    torch.testing.assert_close(logits[NATIVE], logits["full"], atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def batch_results(one_thread):
    """The same tiny shape at batch 1 and 2: native, full and arm at one budget."""
    model = tiny()
    fields = dict(
        methods=[NATIVE, "full", "arm"], lengths=[96, 160], gen_lengths=[8], budget=64, chunk=32, repeats=2, warmup=1
    )
    return {b: run_bench(model, DecodeBench(**fields, batch=b), progress=False) for b in (1, 2)}


def test_native_row_and_batch_figures(batch_results):
    for batch, result in batch_results.items():
        assert result["settings"]["batch"] == batch
        assert result["settings"]["native_cache"] == "dynamic" and result["settings"]["native_chunk"] is None
        for method in (NATIVE, "full", "arm"):
            for n in (96, 160):
                ms = result["decode_ms_per_token"][method][n]
                assert ms > 0 and math.isfinite(ms)
                assert result["decode_tokens_per_s"][method][n] == pytest.approx(batch * 1e3 / ms)
                assert result["prefill_tokens_per_s"][method][n] > 0
                assert result["peak_cache_bytes"][method][n] >= result["cache_bytes"][method][n]
    one, two = batch_results[1], batch_results[2]
    for method in (NATIVE, "full", "arm"):
        for n in (96, 160):
            # the budget is per sequence: two sequences hold twice the bytes
            assert two["cache_bytes"][method][n] == 2 * one["cache_bytes"][method][n], (method, n)
    # transformers' cache holds what armkv's full cache holds; arm holds less at the longer prompt
    assert one["cache_bytes"][NATIVE] == one["cache_bytes"]["full"]
    assert two["cache_bytes"]["arm"][160] < two["cache_bytes"]["full"][160]


def test_native_static_and_fill(one_thread):
    """A static native cache holds its whole length from the start; --beyond-full fill gives
    native and full random KV of the prompt's length (same bytes, no prefill figure)."""
    model = tiny()
    fields = dict(
        methods=[NATIVE, "full"],
        lengths=[64, 96],
        gen_lengths=[4],
        budget=64,
        chunk=32,
        repeats=2,
        warmup=1,
        batch=2,
        max_full_length=80,
        beyond_full="fill",
    )
    dynamic = run_bench(model, DecodeBench(**fields), progress=False)
    static = run_bench(model, DecodeBench(**fields, options={NATIVE: {"cache": "static", "chunk": 16}}), progress=False)
    assert dynamic["filled"] == static["filled"] == {NATIVE: [96], "full": [96]}
    assert dynamic["prefill_tokens_per_s"][NATIVE][96] is None and dynamic["decode_ms_per_token"][NATIVE][96] > 0
    assert dynamic["cache_bytes"][NATIVE] == dynamic["cache_bytes"]["full"]
    token_bytes = dynamic["cache_bytes"]["full"][64] // 64
    # static: sized for the prompt and the decode steps that follow it
    assert static["cache_bytes"][NATIVE] == {n: token_bytes * (n + 3) for n in (64, 96)}
    assert static["settings"]["native_cache"] == "static" and static["settings"]["native_chunk"] == 16


def test_compiled_runs_default_to_a_static_native_cache():
    bench = DecodeBench(methods=[NATIVE], lengths=[8])
    assert bench.native_option("cache") == "dynamic"
    bench.compile = True  # a compiled step needs fixed cache shapes
    assert bench.native_option("cache") == "static"
    bench.options = {NATIVE: {"cache": "dynamic"}}
    assert bench.native_option("cache") == "dynamic"


def test_cli_model_config_batch_and_native(tmp_path, capsys):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({**json.loads(shipped_model_configs()["mistral-7b"].read_text()), **SHRINK}))
    argv = [
        "bench",
        "decode",
        "--model-config",
        str(config),
        "--methods",
        "native,full,arm",
        "--budget",
        "64",
        "--lengths",
        "96",
        "--gen-lengths",
        "8",
        "--chunk",
        "32",
        "--repeats",
        "2",
        "--warmup",
        "1",
        "--threads",
        "1",
        "--batch",
        "3",
        "--no-progress",
    ]
    assert cli_main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    doc = json.loads(lines[-1])
    assert set(doc["decode_ms_per_token"]) == {NATIVE, "full", "arm"}
    assert doc["settings"]["model"] == str(config) and doc["settings"]["batch"] == 3
    assert doc["decode_tokens_per_s"]["arm"]["96"] > 0 and doc["peak_cache_bytes"]["arm"]["96"] > 0
    text = "\n".join(lines)
    assert "batch 3" in text and "native: transformers' dynamic cache, prompt in one forward" in text
    assert any(line.startswith("| native |") for line in lines)
