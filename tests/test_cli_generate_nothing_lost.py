"""``armkv generate`` and ``armkv eval`` under two writers, a changed request, a bad string, a special
file, and every option value checked before the model loads: each case either works or gives a
one-line error before the model loads, with nothing lost and no traceback."""

import io
import json
import os
import stat
import subprocess
import sys
import threading

import pytest
import torch

import armkv.hf.model
from armkv.cli import main
from conftest import generate, requests, write_requests


def strict(line):
    return json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in an output line"))


def lines(path):
    return [strict(line) for line in path.read_text().splitlines()]


def answers(records):
    """What a result says, without its timings."""
    return [(r["id"], r["output"], r["settings"], r["hash"]) for r in records]


def one_error(capsys, message):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("armkv ") and "error:" in err[0] and message in err[0], err
    return err[0]


SINK = ("--method", "sink", "--budget", "16")


# ---------------------------------------------------------------------- two writers, locks


def test_a_second_writer_is_refused_and_the_first_completes(tmp_path, tiny_model_dir, calls, capsys):
    src = write_requests(tmp_path / "in.jsonl", requests(3))
    out = tmp_path / "out.jsonl"
    second = {}

    def start_another(n):
        if n == 1:  # while the first run writes its second result
            second["code"] = generate(tiny_model_dir, src, out, *SINK)
            second["err"] = capsys.readouterr().err

    calls.hook = start_another
    assert generate(tiny_model_dir, src, out, *SINK) == 0
    assert second["code"] == 2
    assert "is being written by another armkv run (pid" in second["err"] and "name another --output" in second["err"]
    calls.hook = None
    assert generate(tiny_model_dir, src, tmp_path / "alone.jsonl", *SINK) == 0
    assert answers(lines(out)) == answers(lines(tmp_path / "alone.jsonl"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alone.jsonl", "in.jsonl", "out.jsonl"]


def test_two_processes_on_one_output(tmp_path, tiny_model_dir):
    """Two real processes started together: one is refused (or finds the work done), the output is a lone run's."""
    src = write_requests(tmp_path / "in.jsonl", requests(4))
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    argv = [sys.executable, "-m", "armkv.cli", "generate", "--model", str(tiny_model_dir), "--input", str(src)]
    argv += ["--output", str(out), "--max-new-tokens", "3", "--chunk", "8", *SINK]
    runs = [subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=600), p.stderr.read()) for p in runs]
    assert all("Traceback" not in err for _, err in results), results
    codes = sorted(code for code, _ in results)
    refused = [err for code, err in results if code == 2]
    assert codes in ([0, 2], [0, 0]), results
    assert all("is being written by another armkv run" in err for err in refused)
    assert generate(tiny_model_dir, src, tmp_path / "alone.jsonl", *SINK) == 0
    assert answers(lines(out)) == answers(lines(tmp_path / "alone.jsonl"))


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path, tiny_model_dir, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "out.jsonl"
    (tmp_path / "out.jsonl.lock").write_text(f"{dead.pid}\n")
    assert generate(tiny_model_dir, write_requests(tmp_path / "in.jsonl", requests(1)), out, *SINK) == 0
    assert f"was left by a run that ended without removing it (pid {dead.pid}" in capsys.readouterr().err
    assert [r["id"] for r in lines(out)] == ["r0"] and not (tmp_path / "out.jsonl.lock").exists()


def test_a_run_that_adds_nothing_leaves_the_output_as_it_was(tmp_path, tiny_model_dir, monkeypatch):
    out = tmp_path / "out.jsonl"
    assert generate(tiny_model_dir, write_requests(tmp_path / "a.jsonl", requests(1)), out, *SINK) == 0
    out.write_bytes(out.read_bytes().replace(b", ", b",  "))  # spelt unlike armkv writes it: must stay so
    before, mtime = out.read_bytes(), out.stat().st_mtime_ns
    monkeypatch.setattr(armkv.hf.model, "load_model", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    assert generate(tiny_model_dir, write_requests(tmp_path / "b.jsonl", requests(2)), out, *SINK) == 130
    assert out.read_bytes() == before and out.stat().st_mtime_ns == mtime
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "b.jsonl", "out.jsonl"]


@pytest.mark.parametrize("how", ["error", "interrupt"])
def test_the_lock_is_released_on_every_exit(tmp_path, tiny_model_dir, monkeypatch, how):
    def broken(*a, **k):
        if how == "error":
            raise armkv.errors.ArmkvError("the model cannot load")
        raise KeyboardInterrupt

    import armkv.errors

    monkeypatch.setattr(armkv.hf.model, "load_model", broken)
    out = tmp_path / "out.jsonl"
    assert generate(tiny_model_dir, write_requests(tmp_path / "in.jsonl", requests(1)), out, *SINK) in (2, 130)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


# ---------------------------------------------------------------------- existing outputs read strictly


@pytest.mark.parametrize(
    "content,message",
    [
        (b"hello\n", "out.jsonl:1 is not an armkv generate result (not JSON)"),
        (b"hello", "out.jsonl:1 is not an armkv generate result (not JSON)"),
        (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", "out.jsonl:1 is not an armkv generate result (not UTF-8 text)"),
        (b'{"id": "r0", "output": NaN}\n', "out.jsonl:1 is not an armkv generate result (not JSON)"),
        (b"[" * 100_000 + b"\n", "out.jsonl:1 is not an armkv generate result (not JSON)"),
        (b'{"a": 1}\n', "not a result: a JSON object with 'id' and 'output'"),
    ],
)
def test_an_output_that_is_not_results_is_refused_and_kept(
    tmp_path, tiny_model_dir, capsys, no_model, content, message
):
    out = tmp_path / "out.jsonl"
    out.write_bytes(content)
    assert generate(tiny_model_dir, write_requests(tmp_path / "in.jsonl", requests(1)), out, *SINK) == 2
    assert "--overwrite" in one_error(capsys, message)
    assert out.read_bytes() == content
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]


def test_a_leftover_partial_that_is_not_results_says_what_to_do(tmp_path, tiny_model_dir, capsys, no_model):
    (tmp_path / "out.jsonl.partial").write_text("notes\nmore notes\n")
    src = write_requests(tmp_path / "in.jsonl", requests(1))
    assert generate(tiny_model_dir, src, tmp_path / "out.jsonl", *SINK) == 2
    one_error(capsys, "out.jsonl.partial:1 is not an armkv generate result (not JSON); it is not one this tool wrote")
    assert (tmp_path / "out.jsonl.partial").read_text() == "notes\nmore notes\n"


def test_a_partial_of_other_settings_says_what_to_do(tmp_path, tiny_model_dir, calls, capsys):
    src = write_requests(tmp_path / "in.jsonl", requests(2))
    out = tmp_path / "out.jsonl"
    assert generate(tiny_model_dir, src, out, *SINK) == 0
    os.replace(out, tmp_path / "out.jsonl.partial")
    capsys.readouterr()
    assert generate(tiny_model_dir, src, out, "--method", "sink", "--budget", "32") == 2
    one_error(capsys, "rerun its command to finish it, or delete")


# ---------------------------------------------------------------------- special files


def test_dev_null_is_written_to_and_stays_a_device(tmp_path, tiny_model_dir):
    before = os.stat("/dev/null")
    assert generate(tiny_model_dir, write_requests(tmp_path / "in.jsonl", requests(2)), "/dev/null", *SINK) == 0
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and after.st_rdev == before.st_rdev
    assert not os.path.exists("/dev/null.partial") and not os.path.exists("/dev/null.lock")


def test_dev_full_is_never_read_and_fails_in_one_line(tmp_path, tiny_model_dir, capsys):
    assert generate(tiny_model_dir, write_requests(tmp_path / "in.jsonl", requests(2)), "/dev/full", *SINK) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        "armkv generate: error: --output /dev/full: cannot write to /dev/full (No space left on device)"
    )


def test_a_fifo_is_written_to_directly(tmp_path, tiny_model_dir):
    fifo = tmp_path / "results.fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    assert generate(tiny_model_dir, write_requests(tmp_path / "in.jsonl", requests(2)), fifo, *SINK) == 0
    reader.join(timeout=60)
    assert [strict(line)["id"] for line in got[0].splitlines()] == ["r0", "r1"]
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "results.fifo"]


def test_a_closed_standard_output_is_one_line(tmp_path, tiny_model_dir, capsys, monkeypatch):
    class Closed(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("sys.stdout", Closed())
    assert generate(tiny_model_dir, write_requests(tmp_path / "in.jsonl", requests(2)), "-", *SINK) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "error: standard output was closed after 0 results" in err


def test_an_output_symlink_is_written_through(tmp_path, tiny_model_dir):
    (tmp_path / "real").mkdir()
    link = tmp_path / "out.jsonl"
    link.symlink_to(tmp_path / "real" / "results.jsonl")
    assert generate(tiny_model_dir, write_requests(tmp_path / "in.jsonl", requests(1)), link, *SINK) == 0
    assert link.is_symlink() and [r["id"] for r in lines(tmp_path / "real" / "results.jsonl")] == ["r0"]
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["results.jsonl"]


# ---------------------------------------------------------------------- --overwrite and the input


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_the_input_is_never_the_partial_file(tmp_path, tiny_model_dir, capsys, no_model, overwrite):
    partial = write_requests(tmp_path / "out.jsonl.partial", requests(2))
    before = partial.read_text()
    assert generate(tiny_model_dir, partial, tmp_path / "out.jsonl", *SINK, *overwrite) == 2
    err = one_error(capsys, "is where this run writes its partial results for --output")
    assert "--overwrite" not in err
    assert partial.read_text() == before


def test_overwrite_with_fewer_requests_replaces_exactly(tmp_path, tiny_model_dir, calls):
    out = tmp_path / "out.jsonl"
    assert generate(tiny_model_dir, write_requests(tmp_path / "a.jsonl", requests(4)), out, *SINK) == 0
    src = write_requests(tmp_path / "b.jsonl", requests(2))
    assert generate(tiny_model_dir, src, out, "--method", "sink", "--budget", "32", "--overwrite") == 0
    assert [(r["id"], r["settings"]["budget"]) for r in lines(out)] == [("r0", 32), ("r1", 32)]
    n = calls.n
    assert generate(tiny_model_dir, src, out, "--method", "sink", "--budget", "32") == 0
    assert calls.n == n  # done: no loop
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "b.jsonl", "out.jsonl"]


# ---------------------------------------------------------------------- changed requests


def test_a_changed_request_is_answered_again(tmp_path, tiny_model_dir, calls, capsys):
    out = tmp_path / "out.jsonl"
    assert generate(tiny_model_dir, write_requests(tmp_path / "in.jsonl", requests(2)), out, *SINK) == 0
    first = lines(out)
    changed = [requests(2)[0], {"id": "r1", "prompt": "The grass is green."}]
    assert generate(tiny_model_dir, write_requests(tmp_path / "in.jsonl", changed), out, *SINK) == 0
    assert calls.n == 3
    assert "1 request(s) changed since their results" in capsys.readouterr().err
    after = lines(out)
    assert answers(after)[0] == answers(first)[0] and after[1]["id"] == "r1" and after[1]["hash"] != first[1]["hash"]
    assert generate(tiny_model_dir, src := tmp_path / "in.jsonl", out, *SINK) == 0 and calls.n == 3
    assert src.exists()


def test_an_output_without_request_hashes_is_not_mixed(tmp_path, tiny_model_dir, capsys, no_model):
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"id": "r0", "output": "x"}) + "\n")
    assert generate(tiny_model_dir, write_requests(tmp_path / "in.jsonl", requests(1)), out, *SINK) == 2
    one_error(capsys, "without the settings and request hash it was made under")


# ---------------------------------------------------------------------- bad requests


def test_bad_strings_and_lines_are_skipped_and_counted(tmp_path, tiny_model_dir, calls, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text(
        "\n".join(
            [
                json.dumps({"id": "a", "prompt": "The sky is blue."}),
                '{"id": "b\\ud800", "prompt": "The sky is blue."}',
                '{"id": "c", "prompt": "The sky \\udfff is blue."}',
                '{"id": NaN, "prompt": "The sky is blue."}',
                json.dumps({"id": "d", "prompt": "The sky is blue.", "question": "What colour?"}),
                "[" * 100_000,
                json.dumps({"id": "e", "prompt": "The grass is green."}),
            ]
        )
        + "\n",
        encoding="utf-8",
    )
    out = tmp_path / "out.jsonl"
    assert generate(tiny_model_dir, src, out, *SINK) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "in.jsonl:2: skipped, 'id' holds a lone surrogate (\\ud800), not text" in err
    assert "in.jsonl:3: skipped, 'prompt' holds a lone surrogate (\\udfff), not text" in err
    assert "in.jsonl:4: skipped, not JSON (NaN is not a JSON number" in err
    assert "in.jsonl:5: skipped, request 'd': 'question' and 'answer_prefix' go with a 'context'" in err
    assert "in.jsonl:6: skipped, not JSON (nested too deeply)" in err
    assert "5 skipped in the input of 7 requests" in err.strip().splitlines()[-1]
    assert [r["id"] for r in lines(out)] == ["a", "e"] and calls.n == 2
    assert generate(tiny_model_dir, src, out, *SINK) == 1 and calls.n == 2  # a rerun does not stop on them either


def test_a_failing_request_is_skipped_and_counted(tmp_path, tiny_model_dir, capsys):
    src = write_requests(tmp_path / "in.jsonl", [{"id": "long", "prompt": "The sky is blue. " * 400}, *requests(1)])
    assert generate(tiny_model_dir, src, tmp_path / "out.jsonl", *SINK) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "1 failed of 2 requests" in err[-1]
    assert [r["id"] for r in lines(tmp_path / "out.jsonl")] == ["r0"]


# ---------------------------------------------------------------------- option and sampling values


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--method", "arm", "--option", "arm.chunk=64"], "--option arm.chunk=...: give it as --chunk 64"),
        (["--method", "arm", "--option", "arm.sinks=abc"], "--option arm.sinks=abc: expected an integer >= 0"),
        (["--method", "arm", "--option", "arm.window=abc"], "--option arm.window=abc: expected an integer >= 1"),
        (["--method", "sink", "--option", "sink.sinks=-1"], "--option sink.sinks=-1: expected an integer >= 0"),
        (["--method", "sink", "--option", "sink.sinks=2.5"], "--option sink.sinks=2.5: expected an integer >= 0"),
        (["--method", "arm", "--option", "arm.read_pages=maybe"], "arm.read_pages=maybe: expected true or false"),
        (["--method", "arm", "--option", "arm.tau=NaN"], "--option arm.tau=NaN: expected a number > 0"),
        (["--method", "arm", "--option", "arm.read=fast"], "--option arm.read=fast: expected one of dense, sparse"),
        (["--method", "kivi", "--option", "kivi.group=0"], "--option kivi.group=0: expected an integer >= 1"),
        (["--method", "full", "--temperature", "nan"], "--temperature nan must be a finite number >= 0"),
        (["--method", "full", "--temperature", "inf"], "--temperature inf must be a finite number >= 0"),
        (["--method", "full", "--top-p", "nan"], "--top-p nan must be in (0, 1]"),
        (["--method", "full", "--temperature", "1", "--seed", str(10**23)], "must be in [0, 2**64)"),
        (["--method", "full", "--temperature", "1", "--seed", "-1"], "--seed -1 must be in [0, 2**64)"),
        (["--method", "full", "--model", "NOWEIGHTS"], "holds no weights (*.safetensors)"),
        (["--method", "arm", "--adapter", "NANADAPTER"], "holds NaN or infinite values"),
    ],
)
def test_values_are_checked_before_the_model_loads(tmp_path, tiny_model_dir, capsys, no_model, extra, message):
    noweights = tmp_path / "noweights"
    noweights.mkdir()
    (noweights / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    if "NANADAPTER" in extra:
        from armkv.config import ARMConfig
        from armkv.memory.module import ARMModel

        arm = ARMModel(ARMConfig(depth=1, slots=8), num_layers=2, num_kv_heads=2, head_dim=16)
        with torch.no_grad():
            next(p for p in arm.parameters() if p.is_floating_point()).fill_(float("nan"))
        arm.save(tmp_path / "nan-adapter")
    swap = {"NOWEIGHTS": str(noweights), "NANADAPTER": str(tmp_path / "nan-adapter")}
    extra = [swap.get(a, a) for a in extra]
    model = extra[extra.index("--model") + 1] if "--model" in extra else tiny_model_dir
    extra = [a for i, a in enumerate(extra) if a != "--model" and (i == 0 or extra[i - 1] != "--model")]
    src = write_requests(tmp_path / "in.jsonl", requests(1))
    assert generate(model, src, tmp_path / "out.jsonl", *extra) == 2
    one_error(capsys, message)
    assert not (tmp_path / "out.jsonl").exists()


def test_requests_sharing_a_prompt_draw_their_own_samples(tmp_path, tiny_model_dir):
    src = write_requests(tmp_path / "in.jsonl", requests(3, prompt="The sky is blue."))
    sample = ["--method", "full", "--temperature", "1.5", "--seed", str(2**64 - 1)]
    assert generate(tiny_model_dir, src, tmp_path / "a.jsonl", *sample) == 0
    outputs = [r["output"] for r in lines(tmp_path / "a.jsonl")]
    assert len(set(outputs)) > 1, outputs
    assert lines(tmp_path / "a.jsonl")[0]["settings"]["sampling"]["seed"] == 2**64 - 1


# ---------------------------------------------------------------------- the sparse-read preset


SPARSE = [
    "arm.slot_mixing=false",
    "arm.top_m=fixed",
    "arm.m_fixed=1/8",
    "arm.read_rank=partial",
    "arm.read_pages=true",
    "arm.read_summaries=true",
]


def test_the_sparse_read_preset_is_its_six_options():
    from armkv.methods.adapters import resolve_arm
    from armkv.methods.base import ModelInfo
    from armkv.options import options_for

    preset = options_for("arm", ["arm.read=sparse"], "random")
    assert preset == options_for("arm", SPARSE, "random")
    info = ModelInfo(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_positions=1024)
    six = options_for("arm", SPARSE)
    runtime = resolve_arm(info, 192, "random", overrides=options_for("arm", ["arm.read=sparse"]))[1]
    assert runtime == resolve_arm(info, 192, "random", overrides=six)[1]
    assert runtime.fixed_m < runtime.num_buckets and runtime.read_pages and runtime.read_summaries
    assert options_for("arm", ["arm.read=dense"]) == options_for("arm", []) == {}
    assert options_for("arm", ["arm.read=sparse", "arm.read_pages=false"])["read_pages"] is False
    assert options_for("arm", ["arm.read_pages=false", "arm.read=sparse"])["read_pages"] is False


def test_the_sparse_read_preset_generates_as_its_six_options(tmp_path, tiny_model_dir):
    src = write_requests(tmp_path / "in.jsonl", requests(2, prompt="The magic number is 1234567. {i} " * 30))
    arm = ["--method", "arm", "--budget", "192", "--adapter", "random", "--max-new-tokens", "6"]
    assert generate(tiny_model_dir, src, tmp_path / "preset.jsonl", *arm, "--option", "arm.read=sparse") == 0
    six = [a for option in SPARSE for a in ("--option", option)]
    assert generate(tiny_model_dir, src, tmp_path / "six.jsonl", *arm, *six) == 0
    preset, options = lines(tmp_path / "preset.jsonl"), lines(tmp_path / "six.jsonl")
    assert answers(preset) == answers(options)
    assert [r["cache_bytes"] for r in preset] == [r["cache_bytes"] for r in options]


def test_the_option_table_matches_the_methods():
    import inspect

    from armkv.methods.adapters import RUNTIME_FIELDS
    from armkv.methods.base import get_method
    from armkv.options import OPTIONS

    skip = {"layer_idx", "info", "rotary", "budget", "chunk", "horizon", "arm", "arm_overrides"}
    for method in ("full", "offload", "swa", "sink", "kivi"):
        params = inspect.signature(get_method(method).make_layer).parameters
        assert set(OPTIONS[method]) == {k for k, p in params.items() if k not in skip and p.kind != p.VAR_KEYWORD}
    assert set(OPTIONS["arm"]) == (RUNTIME_FIELDS - {"chunk"}) | {"adapter", "layer_weights"}
    assert set(OPTIONS["fifo"]) == {"adapter"}


# ---------------------------------------------------------------------- eval


@pytest.mark.parametrize(
    "argv,setup,message",
    [
        (["eval", "ruler", "--output", "FILE"], "file", "is a file; this tool writes a folder of results there"),
        (["eval", "ruler", "--output", "FILE/sub"], "file", "is a file, not a folder"),
        (["eval", "ruler", "--output", "DONE", "--budget", "64"], "done", "holds results for budget=128, not 64"),
        (["eval", "ruler", "--output", "DONE", "--option", "arm.sinks=abc"], None, "expected an integer >= 0"),
        (["eval", "ruler", "--output", "DONE", "--model", "NOWEIGHTS"], None, "holds no weights"),
        (["eval", "ablation", "--output", "FILE"], "file", "is a file; this tool writes a folder of results there"),
    ],
)
def test_eval_checks_before_the_model_loads(tmp_path, tiny_model_dir, capsys, no_model, argv, setup, message):
    (tmp_path / "file").write_text("mine\n")
    done = tmp_path / "done"
    if setup == "done":
        done.mkdir()
        (done / "config.json").write_text(json.dumps({"eval": "ruler", "budget": 128}))
    noweights = tmp_path / "noweights"
    noweights.mkdir()
    (noweights / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    swap = {"FILE": str(tmp_path / "file"), "FILE/sub": str(tmp_path / "file" / "sub"), "DONE": str(done)}
    swap["NOWEIGHTS"] = str(noweights)
    argv = [swap.get(a, a) for a in argv]
    if "--model" not in argv:
        argv += ["--model", str(tiny_model_dir)]
    assert main([*argv, "--lengths", "256", "--samples", "1"]) == 2
    one_error(capsys, message)
    assert (tmp_path / "file").read_text() == "mine\n"
