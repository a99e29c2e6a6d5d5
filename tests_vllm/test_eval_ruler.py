"""``armkv eval ruler --engine vllm`` on the tiny Llama (with a tokenizer trained on RULER's
text): the same samples, scores and outputs as the HF path's ``armkv eval ruler`` (run in the
main environment's Python, ``ARMKV_HF_PYTHON``).

The HF path feeds a sample's context and question as two prefills, vLLM as one prompt; with
``--chunk 1`` every token is a chunk of its own in both, so ARM's memory, and its answers,
must be the same too. The OpenAI-compatible server (``vllm serve``'s, with the plugin set as the
eval set it) answers the eval's ARM samples as the eval logged them (``scripts/vllm_serve_check.py``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from processes import ENV
from tiny import build_tiny_llama, save_tiny_tokenizer

BUDGET = 64
ROOT = Path(__file__).parent.parent


def eval_ruler(python: str, model: Path, out: Path, engine: str) -> subprocess.Popen:
    """``armkv eval ruler`` started in ``python``'s environment; its stderr goes to ``out``.err."""
    command = [python, "-m", "armkv.cli", "eval", "ruler", "--engine", engine, "--model", str(model)]
    command += ["--methods", "full,arm", "--budget", str(BUDGET), "--adapter", "random", "--chunk", "1"]
    command += ["--tasks", "niah_single_1", "--lengths", "512", "--samples", "2", "--max-new-tokens", "6"]
    env = dict(os.environ, **ENV, ARMKV_VLLM_MEMORY="0.05")
    with open(f"{out}.err", "w") as err:
        return subprocess.Popen(command + ["--output", str(out)], stdout=subprocess.DEVNULL, stderr=err, env=env)


def finish(run: subprocess.Popen, out: Path) -> None:
    assert run.wait() == 0, Path(f"{out}.err").read_text()[-4000:]


def records(folder: Path) -> dict:
    return {
        p.name: [json.loads(line) for line in p.read_text().splitlines()] for p in sorted(folder.glob("*__*.jsonl"))
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path, Path | None]:
    """(the tiny model, the vLLM eval's folder, the HF path's or None without ARMKV_HF_PYTHON),
    the two evals run side by side."""
    tmp = tmp_path_factory.mktemp("ruler")
    model = save_tiny_tokenizer(build_tiny_llama(tmp / "tiny"))
    vllm = eval_ruler(sys.executable, model, tmp / "vllm", "vllm")
    hf = (
        eval_ruler(os.environ["ARMKV_HF_PYTHON"], model, tmp / "hf", "hf")
        if os.environ.get("ARMKV_HF_PYTHON")
        else None
    )
    finish(vllm, tmp / "vllm")
    if hf is not None:
        finish(hf, tmp / "hf")
    return model, tmp / "vllm", tmp / "hf" if hf is not None else None


@pytest.mark.skipif(not os.environ.get("ARMKV_HF_PYTHON"), reason="ARMKV_HF_PYTHON (the main environment) unset")
def test_eval_ruler_engine_vllm_equals_hf_path(runs):
    model, vllm_folder, hf_folder = runs
    ours, theirs = records(vllm_folder), records(hf_folder)
    assert set(ours) == set(theirs) == {"arm__niah_single_1__512.jsonl", "full__niah_single_1__512.jsonl"}
    keys = ("id", "answers", "prompt_tokens", "output", "score")
    for name in ours:
        assert [{k: r[k] for k in keys} for r in ours[name]] == [{k: r[k] for k in keys} for r in theirs[name]], name
    arm = ours["arm__niah_single_1__512.jsonl"]
    assert all(0 < r["cache_bytes"] <= BUDGET * 2 * 2 * 2 * 32 * 4 for r in arm)  # (layers x K,V x heads x d x fp32)
    config = json.loads((vllm_folder / "config.json").read_text())
    assert config["engine"] == "vllm"
    for name in ("summary.json", "table.md", "ruler.png"):
        assert (vllm_folder / name).is_file()
    # a second run finds every sample done
    finish(eval_ruler(sys.executable, model, vllm_folder, "vllm"), vllm_folder)
    assert records(vllm_folder) == ours


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_server_answers_as_the_eval(runs, tmp_path):
    model, vllm_folder, _ = runs
    port = free_port()
    arm = {"method": "arm", "budget": BUDGET, "adapter": "random", "chunk": 1}  # (the eval's settings)
    # (processes.ENV but for VLLM_ENABLE_V1_MULTIPROCESSING=0: the server runs as users start it,
    # its engine in a process of its own)
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_CPU_KVCACHE_SPACE="1")
    env["ARMKV_VLLM"] = json.dumps(arm)
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port)]
    command += ["--no-enable-prefix-caching", "--enforce-eager", "--dtype", "float32", "--max-model-len", "1024"]
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, f"the server stopped:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"the server did not start in 10 minutes:\n{log.read_text()[-4000:]}"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).close()
                break
            except OSError:
                time.sleep(2)
        check = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "vllm_serve_check.py"), "--url", f"http://127.0.0.1:{port}"]
            + ["--folder", str(vllm_folder), "--label", "arm", "--samples", "2", "--output", str(tmp_path / "c.json")],
            capture_output=True,
            text=True,
        )
        assert check.returncode == 0, check.stdout[-4000:] + check.stderr[-4000:]
        checked = json.loads((tmp_path / "c.json").read_text())["checked"]
        assert [c["id"] for c in checked] == [r["id"] for r in records(vllm_folder)["arm__niah_single_1__512.jsonl"]]
        assert all(c["equal"] and c["served"] == c["eval"] for c in checked)
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
