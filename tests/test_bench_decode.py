"""``armkv bench decode`` on a tiny Llama: the JSON line, bounded bytes, the floor, one-line errors.

No timing is asserted: latencies only have to be there, finite and positive.
"""

import json
import math

import pytest
import torch

from armkv.bench.decode import DecodeBench, markdown, run_bench
from armkv.cli import main as cli_main
from armkv.errors import ArmkvError
from conftest import tiny_model

METHODS = ["full", "swa", "sink", "kivi", "arm"]
LENGTHS = [128, 192, 256]
GEN = [8, 16]


def small_bench(**overrides) -> DecodeBench:
    fields = dict(methods=METHODS, lengths=LENGTHS, gen_lengths=GEN, budget=64, chunk=32, repeats=2, warmup=1)
    fields.update(overrides)
    return DecodeBench(**fields)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def result(one_thread):
    model = tiny_model("llama")
    return run_bench(model, small_bench(), progress=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    return path


def test_result_schema(result):
    for key in ("decode_ms_per_token", "cache_bytes", "prefill_tokens_per_s"):
        assert set(result[key]) == set(METHODS)
        for method in METHODS:
            assert set(result[key][method]) == set(LENGTHS)
            for value in result[key][method].values():
                assert value > 0 and math.isfinite(value)
    for method in METHODS:  # every method here is an armkv cache: its attention timed apart
        assert all(v > 0 and math.isfinite(v) for v in result["attention_ms_per_token"][method].values())
    # within it ARM's reads of its memory, timed apart (the window's update and the writes outside)
    for length, attention in result["attention_ms_per_token"]["arm"].items():
        assert 0 < result["read_ms_per_token"]["arm"][length] < attention
    assert all(v is None for m in METHODS if m != "arm" for v in result["read_ms_per_token"][m].values())
    assert "ARM's reads of its memory" in markdown(result)
    # the default policy reads every bucket: ARM's reads touch every occupied slot; the others have none
    assert set(result["read_share"]["arm"].values()) == {1.0}
    assert all(v is None for m in METHODS if m != "arm" for v in result["read_share"][m].values())
    assert "Share of ARM's occupied slots" in markdown(result)
    assert all(v is None for m in METHODS for v in result["dense_read_ratio"][m].values())  # (no sparse read to pair)
    assert result["threads"] == torch.get_num_threads()
    assert result["device"] == "cpu"
    assert set(result["gen"]["cache_bytes"]["arm"]) == set(GEN)


def test_floor_measured(result):
    floor = result["floor_ms_per_token"]
    assert isinstance(floor, float) and floor > 0 and math.isfinite(floor)


def test_bounded_cache_bytes_stop_growing(result):
    # every length is well past the budget of 64: the window methods are full from the first,
    # and arm's slot pool, which is allocated as it fills, has stopped growing by the last two
    for method in ("swa", "sink", "kivi"):
        sizes = set(result["cache_bytes"][method].values())
        assert len(sizes) == 1, (method, result["cache_bytes"][method])
    arm = result["cache_bytes"]["arm"]
    assert arm[128] <= arm[192] == arm[256], arm
    full = result["cache_bytes"]["full"]
    assert full[256] == 2 * full[128]  # grows with the prompt
    assert result["cache_bytes"]["arm"][256] < full[256]


def test_positions_put_back():
    model = tiny_model("llama")
    limit = model.config.max_position_embeddings
    run_bench(model, small_bench(methods=["swa"], lengths=[limit + 40], gen_lengths=[4]), progress=False)
    assert model.config.max_position_embeddings == limit


def test_max_full_length_skips_unbounded_only():
    model = tiny_model("llama")
    out = run_bench(model, small_bench(methods=["full", "swa"], max_full_length=150), progress=False)
    assert out["skipped"] == {"full": [192, 256], "swa": []}
    assert out["decode_ms_per_token"]["full"][256] is None
    assert out["decode_ms_per_token"]["swa"][256] > 0
    assert "skipped at 192, 256" in markdown(out)
    json.dumps(out)


def test_beyond_full_fill_times_decode_without_prefill(one_thread):
    out = run_bench(
        tiny_model("llama"), small_bench(methods=["full"], max_full_length=150, beyond_full="fill"), progress=False
    )
    assert out["filled"]["full"] == [192, 256]
    assert out["prefill_tokens_per_s"]["full"][256] is None
    assert out["decode_ms_per_token"]["full"][256] > 0
    # the filled cache holds what a prefilled one would: bytes linear in the length
    assert out["cache_bytes"]["full"][256] == 2 * out["cache_bytes"]["full"][128]
    assert "random keys and values" in markdown(out)
    with pytest.raises(ArmkvError, match="fills the full and native caches only"):
        small_bench(methods=["offload"], beyond_full="fill")


def test_cli_last_line_is_the_json(model_dir, tmp_path, capsys):
    argv = [
        "bench",
        "decode",
        "--model",
        str(model_dir),
        "--methods",
        "full,arm",
        "--budget",
        "64",
        "--lengths",
        "96,128",
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
        "--no-progress",
        "--output",
        str(tmp_path / "out"),
    ]
    assert cli_main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    doc = json.loads(lines[-1])
    assert set(doc) >= {
        "decode_ms_per_token",
        "floor_ms_per_token",
        "cache_bytes",
        "prefill_tokens_per_s",
        "threads",
        "device",
    }
    assert set(doc["decode_ms_per_token"]["arm"]) == {"96", "128"}
    assert doc["threads"] == 1
    assert any(line.startswith("| method |") for line in lines)
    for name in ("results.json", "table.md", "decode.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    assert not (tmp_path / "out" / "results.partial.json").exists()


def test_checkpoint_sees_every_point(one_thread):
    seen = []
    run_bench(
        tiny_model("llama"),
        small_bench(methods=["swa"]),
        progress=False,
        checkpoint=lambda r: seen.append(sum(v is not None for v in r["decode_ms_per_token"]["swa"].values())),
    )
    assert seen == [0, 1, 2, 3]  # after the generation curve, then after each prompt length


def test_cli_json_flag_prints_one_line(model_dir, capsys):
    argv = [
        "bench",
        "decode",
        "--model",
        str(model_dir),
        "--methods",
        "swa",
        "--budget",
        "16",
        "--lengths",
        "24",
        "--gen-lengths",
        "4",
        "--chunk",
        "8",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--json",
        "--no-progress",
    ]
    assert cli_main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0])["cache_bytes"]["swa"]["24"] > 0


def test_merge_runs(one_thread, tmp_path, capsys):
    model = tiny_model("llama")
    a = run_bench(model, small_bench(methods=["full"], lengths=[128]), progress=False)
    b = run_bench(model, small_bench(methods=["swa"], lengths=[128, 256]), progress=False)
    paths = []
    for name, doc in (("a", a), ("b", b)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(doc))
    assert cli_main(["bench", "decode", "--merge", *map(str, paths), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(doc["decode_ms_per_token"]) == {"full", "swa"}
    assert set(doc["decode_ms_per_token"]["swa"]) == {"128", "256"}
    assert len(doc["floor_runs"]) == 2
    b["threads"] = a["threads"] + 1
    paths[1].write_text(json.dumps(b))
    assert cli_main(["bench", "decode", "--merge", *map(str, paths)]) == 2
    assert "differ in threads" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--methods", "full,nope"], "unknown method 'nope'"),
        (["--lengths", "1024,200000"], "beyond the limit of 131072"),
        (["--lengths", "1k,x"], "expected comma-separated integers"),
        (["--methods", "swa", "--budget", "0"], "--budget 0 must be"),
        (["--methods", "swa", "--option", "kivi.bits=2"], "'kivi' is not among --methods swa"),
        (["--methods", "arm", "--option", "sync=32"], "expected METHOD.KEY=VALUE"),
        (["--methods", "swa", "--prompt-file", "no/such.txt"], "--prompt-file no/such.txt: no such file"),
        (["--methods", "swa", "--prompt-file", __file__], "needs the model's tokenizer"),  # (the tiny model has none)
    ],
)
def test_bad_input_is_one_line(model_dir, capsys, extra, message):
    argv = ["bench", "decode", "--model", str(model_dir), "--no-progress", *extra]
    assert cli_main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert err[0].startswith("armkv bench: error:")
    assert captured.out == ""


def test_options_reach_the_method(one_thread):
    """--option METHOD.KEY=VALUE is given to that method's cache (here fp32 slots instead of
    k4v4: fewer slots in the same budget, so other bytes), recorded in the settings and the table."""
    model = tiny_model("llama")
    plain = run_bench(model, small_bench(methods=["arm", "swa"], lengths=[128]), progress=False)
    fp32 = run_bench(
        model,
        small_bench(methods=["arm", "swa"], lengths=[128], options={"arm": {"slot_format": "model"}}),
        progress=False,
    )
    assert fp32["cache_bytes"]["arm"][128] != plain["cache_bytes"]["arm"][128]
    assert fp32["cache_bytes"]["swa"] == plain["cache_bytes"]["swa"]
    assert fp32["settings"]["options"] == {"arm": {"slot_format": "model"}}
    assert 'arm options: {"slot_format": "model"}' in markdown(fp32)
    with pytest.raises(ArmkvError, match="no_such_option"):
        run_bench(
            model, small_bench(methods=["arm"], lengths=[128], options={"arm": {"no_such_option": 1}}), progress=False
        )


def test_sparse_reads_touch_a_share_of_the_memory(one_thread):
    """At M = 1/8 of the buckets ARM's decode reads touch part of its slots; the figure is
    there for each prompt length, and transformers' own cache has none."""
    model = tiny_model("llama")
    options = {"arm": {"top_m": "fixed", "m_fixed": "1/8", "read_rank": "partial", "slot_mixing": False}}
    res = run_bench(model, small_bench(methods=["arm", "native"], lengths=[256], options=options), progress=False)
    assert 0 < res["read_share"]["arm"][256] < 1
    assert 0 < res["read_ms_per_token"]["arm"][256] < res["attention_ms_per_token"]["arm"][256]
    assert res["read_share"]["native"][256] is None and res["attention_ms_per_token"]["native"][256] is None
    assert res["read_ms_per_token"]["native"][256] is None
    # each sparse read timed beside the dense read of the same state (figures, no timing asserted)
    assert 0 < res["paired_read_ms_per_token"]["arm"][256] and 0 < res["dense_read_ms_per_token"]["arm"][256]
    assert res["dense_read_ratio"]["arm"][256] > 0 and res["dense_read_ratio"]["native"][256] is None
    assert "Dense read / sparse read" in markdown(res)


def test_prompts_from_a_text(tiny_model_dir, tmp_path, capsys, one_thread):
    """--prompt-file: the prompts are the text's tokens under the model's tokenizer, repeated
    to each length, recorded in the settings; a file with no text is refused before timing."""
    from armkv.bench.decode import Session, prompt_tokens

    text = tmp_path / "text.txt"
    text.write_text("The grass is green. The sky is blue.")
    ids = prompt_tokens(str(text), str(tiny_model_dir))
    assert 3 < len(ids) < 40
    bench = small_bench(methods=["arm"], lengths=[96], prompt_ids=ids, prompt_name="text.txt")
    prompt = Session(tiny_model("llama"), bench).prompt(2 * len(ids) + 1)
    assert prompt[0].tolist() == ids + ids + ids[:1]
    argv = [
        "bench",
        "decode",
        "--model",
        str(tiny_model_dir),
        "--methods",
        "arm",
        "--lengths",
        "96",
        "--gen-lengths",
        "8",
        "--budget",
        "64",
        "--chunk",
        "32",
        "--repeats",
        "2",
        "--warmup",
        "1",
        "--prompt-file",
        str(text),
        "--json",
        "--no-progress",
    ]
    assert cli_main(argv) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["settings"]["prompt"] == "text.txt" and res["read_share"]["arm"]["96"] == 1.0
    (tmp_path / "empty.txt").write_text("")
    assert cli_main([*argv[:-4], "--prompt-file", str(tmp_path / "empty.txt"), "--no-progress"]) == 2
    assert "no tokens in it" in capsys.readouterr().err


def test_bad_config_in_python():
    with pytest.raises(ArmkvError, match="names a method twice"):
        small_bench(methods=["swa", "swa"])
    with pytest.raises(ArmkvError, match="--gen-lengths 0"):
        small_bench(gen_lengths=[0])
    with pytest.raises(ArmkvError, match="--clock 'cycles'"):
        small_bench(clock="cycles")


def test_process_clock(one_thread):
    out = run_bench(tiny_model("llama"), small_bench(methods=["swa"], clock="process"), progress=False)
    assert out["settings"]["clock"] == "process"
    assert out["floor_ms_per_token"] > 0 and out["decode_ms_per_token"]["swa"][256] > 0


def test_ops_missing_or_present(capsys):
    import importlib.util

    from armkv.bench import cli

    if importlib.util.find_spec("armkv.bench.ops") is None:
        assert cli_main(["bench", "ops"]) == 2
        assert "not available" in capsys.readouterr().err
    else:
        assert "ops" in cli.BENCHES


def test_bench_ops_times_the_int4_read_against_pytorch(capsys, one_thread):
    """`armkv bench ops` end to end at toy sizes: its last line is JSON, and the int4 read's
    two paths agree where the kernel is built."""
    import json

    from armkv.memory.kernels import int4_read

    assert (
        cli_main(
            [
                "bench",
                "ops",
                "--tokens",
                "64",
                "--chunk",
                "32",
                "--slots",
                "16",
                "--buckets",
                "16",
                "--queries",
                "4",
                "--int4-slots",
                "37,8",
                "--sparse-budgets",
                "256",
                "--sparse-queries",
                "1,3",
                "--repeats",
                "1",
                "--json",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    int4 = result["int4_read_us_per_layer"]
    if int4_read() is None:
        assert int4 == {}
    else:
        assert set(int4) == {"37", "8"}
        assert all(r["max_abs_diff"] < 1e-3 and r["fused_us"] > 0 for r in int4.values())
    sparse = result["sparse_read_us_per_layer"]["256"]
    # every ranking timed, each equal to its masked reference; with summaries their build timed too
    assert set(sparse) == {"best", "partial", "tree", "partial-pages", "partial-pages-summaries"}
    assert all(
        row[t]["max_abs_diff"] < 1e-4 and row[t]["sparse_us"] > 0 for row in sparse.values() for t in ("T1", "T3")
    )
    assert (
        sparse["partial-pages-summaries"]["summaries_build_ms"] > 0
        and "summaries_build_ms" not in sparse["partial-pages"]
    )
    chunk = result["chunk_read_ms_per_layer"]
    assert set(chunk) == {"37", "8"}  # this torch has the CPU flash op (test_methods checks the split form)
    assert all(r["max_abs_diff"] < 1e-4 and r["split_ms"] > 0 and r["one_call_ms"] > 0 for r in chunk.values())


def test_bench_ops_refuses_an_unknown_ranking_before_timing(capsys):
    """A misspelt --sparse-ranks fails at once with the rankings there are, not after the scan timing."""
    assert cli_main(["bench", "ops", "--sparse-ranks", "best,partal"]) == 2
    err = capsys.readouterr().err
    assert (
        "--sparse-ranks partal" in err
        and "best, partial, tree, best-pages, partial-pages" in err
        and "scan of" not in err
    )
    assert cli_main(["bench", "ops", "--sparse-ranks", "tree-pages"]) == 2  # the tree ranks whole buckets
    assert "--sparse-ranks tree-pages" in capsys.readouterr().err
