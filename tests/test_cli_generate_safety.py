"""``armkv generate`` never loses a user's work and checks what it can before the model loads:
resume, atomic output, interrupted reruns, the output and input paths, budgets, options,
JSONL edges, stdin/stdout, sampling, and the empty-output hint."""

import io
import json

import pytest

import armkv.hf.model
from armkv.hf.runner import Runner
from conftest import generate, requests, write_requests


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rerun_resumes_and_keeps_earlier_results(tmp_path, tiny_model_dir, calls):
    out = tmp_path / "out.jsonl"
    assert (
        generate(
            tiny_model_dir, write_requests(tmp_path / "a.jsonl", requests(2)), out, "--method", "sink", "--budget", "16"
        )
        == 0
    )
    first = lines(out)
    assert calls.n == 2
    assert (
        generate(
            tiny_model_dir, write_requests(tmp_path / "b.jsonl", requests(3)), out, "--method", "sink", "--budget", "16"
        )
        == 0
    )
    assert calls.n == 3  # only the new id was answered
    after = lines(out)
    assert after[:2] == first and [r["id"] for r in after] == ["r0", "r1", "r2"]
    assert not (tmp_path / "out.jsonl.partial").exists()
    assert generate(tiny_model_dir, tmp_path / "b.jsonl", out, "--method", "sink", "--budget", "16") == 0
    assert calls.n == 3 and lines(out) == after  # nothing left to do


def test_other_settings_are_refused_before_the_model_loads(tmp_path, tiny_model_dir, capsys, monkeypatch):
    out = tmp_path / "out.jsonl"
    src = write_requests(tmp_path / "in.jsonl", requests(2))
    assert generate(tiny_model_dir, src, out, "--method", "sink", "--budget", "16") == 0
    before = out.read_text()
    monkeypatch.setattr(armkv.hf.model, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    assert generate(tiny_model_dir, src, out, "--method", "sink", "--budget", "32") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "holds results for budget=16, not 32" in err and "--overwrite" in err
    assert out.read_text() == before


def test_overwrite_replaces(tmp_path, tiny_model_dir):
    out = tmp_path / "out.jsonl"
    src = write_requests(tmp_path / "in.jsonl", requests(2))
    assert generate(tiny_model_dir, src, out, "--method", "sink", "--budget", "16") == 0
    assert generate(tiny_model_dir, src, out, "--method", "sink", "--budget", "32", "--overwrite") == 0
    assert [r["settings"]["budget"] for r in lines(out)] == [32, 32]


def test_interrupted_rerun_never_leaves_fewer_results(tmp_path, tiny_model_dir, calls, capsys):
    out = tmp_path / "out.jsonl"
    src = write_requests(tmp_path / "in.jsonl", requests(4))
    calls.stop_after = 3
    assert generate(tiny_model_dir, src, out, "--method", "sink", "--budget", "16") == 130
    assert [r["id"] for r in lines(out)] == ["r0", "r1", "r2"]  # the interrupted run kept what it finished
    # an interrupted --overwrite that finished fewer than the output held leaves the output as it was
    calls.stop_after = calls.n + 1
    assert generate(tiny_model_dir, src, out, "--method", "sink", "--budget", "32", "--overwrite") == 130
    assert [r["id"] for r in lines(out)] == ["r0", "r1", "r2"]
    assert "keeps its 3 earlier results" in capsys.readouterr().err
    # resuming the old settings is refused (the .partial holds the other's), with what to do
    assert generate(tiny_model_dir, src, out, "--method", "sink", "--budget", "16") == 2
    assert "out.jsonl.partial holds results for budget=32, not 16" in capsys.readouterr().err
    # the --overwrite again resumes its own: interrupted at once, then to the end
    calls.stop_after = calls.n
    assert generate(tiny_model_dir, src, out, "--method", "sink", "--budget", "32", "--overwrite") == 130
    assert [r["settings"]["budget"] for r in lines(out)] == [16, 16, 16]
    n = calls.n
    calls.stop_after = None
    assert generate(tiny_model_dir, src, out, "--method", "sink", "--budget", "32", "--overwrite") == 0
    assert calls.n == n + 3  # r0 came from the interrupted --overwrite
    assert [(r["id"], r["settings"]["budget"]) for r in lines(out)] == [(f"r{i}", 32) for i in range(4)]
    assert not (tmp_path / "out.jsonl.partial").exists()


def test_a_killed_run_is_resumed_from_its_partial_file(tmp_path, tiny_model_dir, calls):
    """A run killed hard leaves OUTPUT.partial (whole lines, maybe one cut short); the next run takes its results."""
    out = tmp_path / "out.jsonl"
    src = write_requests(tmp_path / "in.jsonl", requests(3))
    assert generate(tiny_model_dir, src, out, "--method", "sink", "--budget", "16") == 0
    done = out.read_text().splitlines()
    out.unlink()
    (tmp_path / "out.jsonl.partial").write_text(done[0] + "\n" + done[1][:20], encoding="utf-8")
    n = calls.n
    assert generate(tiny_model_dir, src, out, "--method", "sink", "--budget", "16") == 0
    assert calls.n == n + 2 and [r["id"] for r in lines(out)] == ["r0", "r1", "r2"]


@pytest.mark.parametrize(
    "setup,extra,message",
    [
        ("dir", ["--method", "full"], "is a folder; name a file in it"),
        ("under_file", ["--method", "full"], "is a file, not a folder"),
        ("same", ["--method", "full"], "is the --input file"),
        (None, ["--method", "sink", "--budget", "1000000000"], "is more than the model's 1024 positions"),
        (None, ["--method", "kivi", "--budget", "1000000000"], "is more than the model's 1024 positions"),
        (None, ["--method", "arm", "--budget", "1000000000"], "is more than the model's 1024 positions"),
        (None, ["--method", "sink", "--budget", "3"], "too small"),
        (
            None,
            ["--method", "arm", "--option", "arm.slot_formt=int8"],
            "method 'arm' has no option slot_formt; its options: adapter,",
        ),
        (
            None,
            ["--method", "kivi", "--option", "kivi.bitz=2"],
            "its options: bits, group, residual, sinks, value_group",
        ),
        (None, ["--method", "kivi", "--option", "kivi.bits=3"], "--option kivi.bits=3: expected one of 2, 4"),
        (None, ["--method", "kivi", "--option", "sink.sinks=2"], "this run's method is 'kivi', not 'sink'"),
        (None, ["--method", "kivi", "--option", "bits=2"], "expected METHOD.KEY=VALUE"),
        (None, ["--method", "arm", "--adapter", "no/such/folder"], "is not a folder"),
        (None, ["--method", "nope"], "unknown method 'nope'"),
        (None, ["--method", "full", "--chunk", "0"], "--chunk 0 must be >= 1"),
        (None, ["--method", "full", "--max-new-tokens", "0"], "must be >= 1"),
        (None, ["--method", "full", "--temperature", "-1"], "--temperature -1.0 must be a finite number >= 0"),
        (None, ["--method", "full", "--top-p", "1.5"], "--top-p 1.5 must be in (0, 1]"),
        (None, ["--method", "full", "--temperature", "0", "--top-k", "5"], "--temperature 0 is greedy"),
    ],
)
def test_bad_input_is_one_line_before_the_model_loads(
    tmp_path, tiny_model_dir, capsys, no_model, setup, extra, message
):
    src = write_requests(tmp_path / "in.jsonl", requests(1))
    out = tmp_path / "out.jsonl"
    if setup == "dir":
        out = tmp_path / "folder"
        out.mkdir()
    elif setup == "under_file":
        (tmp_path / "plain").write_text("x")
        out = tmp_path / "plain" / "out.jsonl"
    elif setup == "same":
        out = src
    before = src.read_text()
    assert generate(tiny_model_dir, src, out, *extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("armkv generate: error:") and message in err[0], err
    assert src.read_text() == before


def test_budget_for_full_is_a_warning_and_bounded_methods_default_to_512(tmp_path, tiny_model_dir, capsys):
    src = write_requests(tmp_path / "in.jsonl", requests(1))
    assert generate(tiny_model_dir, src, tmp_path / "full.jsonl", "--method", "full", "--budget", "64") == 0
    assert "--budget 64 does not apply to method 'full'" in capsys.readouterr().err
    assert lines(tmp_path / "full.jsonl")[0]["settings"]["budget"] is None
    assert generate(tiny_model_dir, src, tmp_path / "swa.jsonl", "--method", "swa") == 0
    assert lines(tmp_path / "swa.jsonl")[0]["settings"]["budget"] == 512


def test_jsonl_edges_are_reported_with_line_numbers_before_the_model_loads(tmp_path, tiny_model_dir, capsys):
    src = tmp_path / "in.jsonl"
    body = (
        "\n".join(
            [
                json.dumps({"id": "a", "prompt": "The sky is blue."}),
                "[1, 2, 3]",
                json.dumps({"id": "b", "prompt": ""}),
                json.dumps({"id": "c", "context": "", "question": ""}),
                json.dumps({"id": "a", "prompt": "again"}),
                json.dumps({"id": 1, "prompt": "The grass is green."}),
                json.dumps({"id": "1", "prompt": "The grass is green."}),
            ]
        )
        + "\n"
    )
    src.write_bytes(b"\xef\xbb\xbf" + body.encode("utf-8"))  # a UTF-8 byte-order mark, as some editors save
    out = tmp_path / "out.jsonl"
    assert generate(tiny_model_dir, src, out, "--method", "full") == 1  # the skipped lines are counted at the end
    err = capsys.readouterr().err
    assert "4 skipped in the input of 7 requests" in err.strip().splitlines()[-1]
    assert "in.jsonl:1" not in err  # the mark does not cost the first line
    assert "in.jsonl:2: skipped, a request is a JSON object with an 'id', not list [1, 2, 3]" in err
    assert "in.jsonl:3: skipped, request 'b': the prompt is empty" in err
    assert "in.jsonl:4: skipped, request 'c': the prompt is empty" in err
    assert "in.jsonl:5: skipped, id 'a' repeats line 1" in err
    assert [r["id"] for r in lines(out)] == ["a", 1, "1"]


def test_stdin_to_stdout(tmp_path, tiny_model_dir, capsys, monkeypatch):
    data = "".join(json.dumps(r) + "\n" for r in requests(2)).encode("utf-8")
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))
    assert generate(tiny_model_dir, "-", "-", "--method", "sink", "--budget", "16") == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["id"] for r in out] == ["r0", "r1"] and all(r["method"] == "sink" for r in out)
    assert not list(tmp_path.iterdir())


def test_sampling_is_seeded_per_request(tmp_path, tiny_model_dir):
    src = write_requests(tmp_path / "in.jsonl", requests(3))
    sample = ["--method", "full", "--temperature", "1.5", "--top-k", "50", "--seed", "7"]
    assert generate(tiny_model_dir, src, tmp_path / "a.jsonl", *sample) == 0
    a = lines(tmp_path / "a.jsonl")
    assert a[0]["settings"]["sampling"] == {"temperature": 1.5, "top_p": None, "top_k": 50, "seed": 7}
    # the last request alone gives the answer it gave after the others (a resumed run equals a whole one)
    assert (
        generate(
            tiny_model_dir, write_requests(tmp_path / "last.jsonl", requests(3)[2:]), tmp_path / "b.jsonl", *sample
        )
        == 0
    )
    assert lines(tmp_path / "b.jsonl")[0]["output"] == a[2]["output"]
    # sampling differs from greedy somewhere over a few seeds (a random tiny model, temperature 1.5)
    assert generate(tiny_model_dir, src, tmp_path / "g.jsonl", "--method", "full") == 0
    greedy = [r["output"] for r in lines(tmp_path / "g.jsonl")]
    sampled = []
    for seed in range(4):
        out = tmp_path / f"s{seed}.jsonl"
        assert generate(tiny_model_dir, src, out, "--method", "full", "--temperature", "1.5", "--seed", str(seed)) == 0
        sampled += [r["output"] for r in lines(out)]
    assert any(s != g for s, g in zip(sampled, greedy * 4))


def test_empty_outputs_get_a_chat_hint(tmp_path, tiny_model_dir, capsys, monkeypatch):
    real = Runner.generate

    def empty(self, reqs, *a, **k):
        return [{**r, "output": ""} for r in real(self, reqs, *a, **k)]

    monkeypatch.setattr(Runner, "generate", empty)
    src = write_requests(tmp_path / "in.jsonl", requests(2))
    assert generate(tiny_model_dir, src, tmp_path / "out.jsonl", "--method", "full") == 0
    assert "note: 2 of 2 outputs are empty" in capsys.readouterr().err
    assert generate(tiny_model_dir, src, tmp_path / "chat.jsonl", "--method", "full", "--chat") == 0
    assert "outputs are empty" not in capsys.readouterr().err


def test_a_run_that_produces_nothing_leaves_no_output(tmp_path, tiny_model_dir, monkeypatch):
    def broken(*a, **k):
        raise armkv.errors.ArmkvError("the model cannot load")

    import armkv.errors

    monkeypatch.setattr(armkv.hf.model, "load_model", broken)
    assert (
        generate(
            tiny_model_dir,
            write_requests(tmp_path / "in.jsonl", requests(1)),
            tmp_path / "out.jsonl",
            "--method",
            "full",
        )
        == 2
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_an_output_without_settings_is_not_mixed(tmp_path, tiny_model_dir, capsys, no_model):
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"id": "r0", "method": "sink", "output": "x"}) + "\n")
    assert generate(tiny_model_dir, write_requests(tmp_path / "in.jsonl", requests(2)), out, "--method", "sink") == 2
    assert "holds a result without the settings and request hash it was made under" in capsys.readouterr().err
    assert json.loads(out.read_text())["output"] == "x"
