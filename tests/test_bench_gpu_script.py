"""scripts/gpu_bench.py, the prepared GPU benchmark, in its CPU dry run: every run is its own
process, a failing run is recorded and the others go on, and three files come back."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_bench.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(tmp_path, *args, timeout=600):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    return done


def test_the_plan_is_the_issue_s_matrix():
    gpu = load_script()
    runs = dict(gpu.plan(gpu.REAL | {"model_config": "llama-3.1-8b"}))
    assert sorted(runs) == sorted(
        [f"{kind}-{m}" for kind in ("eager", "compiled") for m in ("native", "full", "sink", "arm")]
        + [f"batch{b}-{m}" for b in (8, 32) for m in ("full", "arm")]
        + [f"{s}sparse-{r}" for s in ("", "smollm2-") for r in ("every", "pages")]
        + ["reads"]
    )
    assert list(runs)[:6] == ["eager-arm", "eager-full", "compiled-native", "compiled-full", "compiled-arm", "reads"]
    for name, args in runs.items():
        assert len([a for a in args if a.startswith("--") and a != "--option"]) == len(
            {a for a in args if a.startswith("--")} - {"--option"}
        )
        settings = dict(zip(args, args[1:]))
        if name == "reads":  # one layer's read alone: Llama-3.1-8B's attention shape, batch 1, 8 and 32
            assert settings["--dtype"] == "bfloat16" and settings["--device"] == "cuda"
            assert settings["--shape"] == "32,8,128" and settings["--batches"] == "1,8,32"
            assert settings["--budgets"] == "1024,4096" and settings["--contexts"] == "4k,32k,128k"
            continue
        assert settings["--dtype"] == "bfloat16" and settings["--device"] == "cuda" and settings["--chunk"] == "1024"
        if "sparse" in name:  # budget 4096, unmixed slots; every bucket, or pages of M = N_b / 8
            assert settings["--model-config"] == ("smollm2-135m" if name.startswith("smollm2") else "llama-3.1-8b")
            assert settings["--budget"] == "4096" and settings["--methods"] == "arm" and "arm.slot_mixing=false" in args
            assert settings["--lengths"] == ("16k" if name.startswith("smollm2") else "32k")
            assert ("arm.m_fixed=1/8" in args and "arm.read_pages=true" in args) == name.endswith("pages")
            continue
        assert settings["--model-config"] == "llama-3.1-8b" and settings["--budget"] == "1024"
        assert settings["--methods"] == name.split("-")[1]
        assert ("--compile" in args) == name.startswith("compiled")
        # past 32k the compiled unbounded methods decode over random KV (their prefill is the eager runs')
        assert ("--beyond-full" in args) == (name in ("compiled-native", "compiled-full"))
        if name.startswith("batch"):
            assert settings["--lengths"] == "32k" and settings["--batch"] == name[5:].split("-")[0]
        else:
            assert settings["--lengths"] == "4,1k,32k,128k"
    # the dry run has the same runs, names and options
    dry = dict(gpu.plan(gpu.DRY | {"model_config": "tiny.json"}))
    assert list(dry) == list(runs)
    assert all([a for a in dry[n] if a.startswith("--")] == [a for a in runs[n] if a.startswith("--")] for n in runs)


def test_transformers_range():
    gpu = load_script()
    assert gpu.in_range("5.20.0") and gpu.in_range("5.24.0") and gpu.in_range("5.23.0.dev0")
    assert not gpu.in_range("5.17.0") and not gpu.in_range("5.25.0") and not gpu.in_range("4.57.1")


def test_the_range_is_armkvs():
    from armkv.hf.compat import SUPPORTED

    assert load_script().TRANSFORMERS_RANGE == SUPPORTED


def test_dry_run_records_each_run(tmp_path):
    """Two runs that work on this CPU, each its own process: both recorded with their results,
    and the three files come back."""
    done = run(tmp_path, "--dry-run", "--only", "eager-native,batch8-arm")
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(summary["runs"]) == {"eager-native", "batch8-arm"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_bench.json", "gpu_bench.log", "tables.md"]
    doc = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert doc["dry_run"] is True and doc["transformers"]["transformers"]
    native = doc["runs"]["eager-native"]
    assert native["exit_code"] == 0 and native["result_kind"] == "complete"
    result = native["result"]
    assert set(result["decode_ms_per_token"]) == {"native"}
    assert set(result["decode_ms_per_token"]["native"]) == {"4", "96", "160"}
    assert result["prefill_tokens_per_s"]["native"]["160"] > 0
    batch = doc["runs"]["batch8-arm"]["result"]
    assert batch["settings"]["batch"] == 2 and batch["decode_tokens_per_s"]["arm"]["96"] > 0
    tables = (tmp_path / "tables.md").read_text()
    assert "## eager-native" in tables and "| native |" in tables and "## batch8-arm" in tables


def test_a_failing_run_is_recorded(tmp_path):
    """A run whose ``bench decode`` fails (here: an option this build does not have, as
    ``--compile`` was on older builds) is recorded with its exit code and log, without a result;
    its table says so."""
    gpu = load_script()
    record, text = gpu.run_one("eager-native", ["--no-such-option"], dict(os.environ), 120, tmp_path)
    assert record["exit_code"] == 2 and "--no-such-option" in record["log_tail"] and text
    assert "result" not in record and record["seconds"] >= 0
    assert "exit 2" in gpu.table("eager-native", record, tmp_path / "eager-native")


def test_dry_run_of_a_sparse_run_reads_a_share_of_the_slots(tmp_path):
    """sparse-pages on the tiny shape: ARM at M = N_b / 8 reading pages, its options in the
    result's settings, and its decode reads touching a share of the occupied slots."""
    done = run(tmp_path, "--dry-run", "--only", "sparse-pages")
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads((tmp_path / "gpu_bench.json").read_text())["runs"]["sparse-pages"]
    assert record["exit_code"] == 0 and record["result_kind"] == "complete"
    result = record["result"]
    assert result["settings"]["options"]["arm"] == {
        "slot_mixing": False,
        "top_m": "fixed",
        "m_fixed": "1/8",
        "read_rank": "partial",
        "read_pages": True,
    }
    share = result["read_share"]["arm"]["160"]
    assert 0 < share < 0.5


def test_dry_run_of_the_read_timing_times_every_read(tmp_path):
    """reads on the tiny shape (its Triton kernels in the interpreter): SDPA at each context
    and ARM's reads at each batch timed, the ratios computed, the table written."""
    if importlib.util.find_spec("triton") is None and os.environ.get("ARMKV_REQUIRE_TRITON") != "1":
        pytest.skip("triton is not installed (pip install 'armkv[gpu]')")
    done = run(tmp_path, "--dry-run", "--only", "reads")
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads((tmp_path / "gpu_bench.json").read_text())["runs"]["reads"]
    assert record["exit_code"] == 0 and record["result_kind"] == "complete", record.get("log_tail")
    assert record["command"].startswith("python scripts/gpu_bench.py --read-timing")
    result = record["result"]
    assert result["errors"] == {} and "interpreter" in result["kernels"]
    reads = {"sdpa@96", "sdpa@160", "arm-dense@32", "arm-dense-unmixed@32", "arm-pages@32", "arm-pages-read@32"}
    assert set(result["read_ms"]) == {"1", "2"}
    assert all(set(t) == reads and all(v > 0 for v in t.values()) for t in result["read_ms"].values())
    assert result["graph_ms"] == {"1": {}, "2": {}}  # (CUDA graphs on a GPU only)
    assert set(result["ratios"]["read_ms"]["2"]) == {
        "sdpa@96 / arm-dense@32",
        "sdpa@160 / arm-dense@32",
        "arm-dense-unmixed@32 / arm-pages@32",
        "arm-dense-unmixed@32 / arm-pages-read@32",
    }
    tables = (tmp_path / "tables.md").read_text()
    assert "## reads" in tables and "| arm-pages@32 |" in tables


def test_spent_budget_runs_nothing_and_says_so(tmp_path):
    done = run(tmp_path, "--dry-run", "--budget-s", "0", timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert len(doc["runs"]) == 17
    assert all(r["exit_code"] == "not run" and "spent" in r["why"] for r in doc["runs"].values())


def test_without_out_the_files_go_under_the_working_directory(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--budget-s", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "OUT": str(tmp_path / "elsewhere")},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (tmp_path / "elsewhere").exists()
    assert sorted(p.name for p in (tmp_path / "out" / "gpu_bench").iterdir()) == [
        "gpu_bench.json",
        "gpu_bench.log",
        "tables.md",
    ]


def test_unknown_run_name(tmp_path):
    done = run(tmp_path, "--dry-run", "--only", "eager-nope", timeout=120)
    assert done.returncode == 2 and "not among the runs" in done.stderr


@pytest.mark.parametrize("args", [["--help"]])
def test_help(args):
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--dry-run" in done.stdout
