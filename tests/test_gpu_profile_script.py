"""scripts/gpu_profile.py, the prepared GPU profile, in its CPU dry run: one record per run
with its timings and operator counts; an unknown method refused before anything is built."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_profile.py"


def test_dry_run_profiles_each_run(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--runs", "full,arm,arm-compiled", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary == {"out": str(tmp_path), "runs": json.loads((tmp_path / "profile.json").read_text())["runs"]}
    full, arm = summary["runs"]["full"], summary["runs"]["arm"]
    for record in (full, arm):
        assert record["decode_ms_median"] > 0 and record["profiled_ms_per_step"] > 0
        assert record["device_kernels_per_step"] == 0  # (no device here)
    # ARM's step reads slots and a window besides the model's own work: more operators than full
    assert arm["leaf_ops_per_step"] > full["leaf_ops_per_step"] > 0
    # a compiled run carries torch's compile log (graph breaks, recompiles, CUDA-graph skips)
    assert "compile_log_lines" in summary["runs"]["arm-compiled"] and "compile_log_lines" not in arm
    assert "## arm-compiled" in (tmp_path / "profile.md").read_text()


def test_an_unknown_method_fails_before_the_model_is_built(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--runs", "arm,nosuch", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode != 0 and "--runs nosuch: unknown method 'nosuch'" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "profile.json").exists()


def test_options_reach_the_runs_cache(tmp_path):
    """--option METHOD.KEY=VALUE goes to that method's cache (here a bad value, refused by the
    cache; the run's failure is recorded) and to the settings; other methods' runs ignore it.
    Run without --out from another folder: the files go to out/gpu_profile under it."""
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--dry-run",
            "--runs",
            "full,arm",
            "--option",
            "arm.read_rank=nope",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "OUT": str(tmp_path / "elsewhere")},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # without --out the files go under the working directory, whatever $OUT says
    assert not (tmp_path / "elsewhere").exists()
    doc = json.loads((tmp_path / "out" / "gpu_profile" / "profile.json").read_text())
    assert doc["settings"]["option"] == ["arm.read_rank=nope"]
    assert doc["runs"]["full"]["decode_ms_median"] > 0
    assert "read_rank" in doc["runs"]["arm"]["error"] and "nope" in doc["runs"]["arm"]["error"]
