"""The ``armkv`` lm-eval model: loglikelihood and generation both go through the cache method."""

from __future__ import annotations

import pytest

from test_evals_fixtures import DATA, tiny_model, tiny_tokenizer

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'armkv[eval]')")
pytest.importorskip("armkv.hf.attach", reason="armkv.hf is not in this build")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    tok = tiny_tokenizer()
    tiny_model(tok, max_positions=1024).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def loglikelihoods(lm, pairs):
    from lm_eval.api.instance import Instance

    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    return [ll for ll, _ in lm.loglikelihood(requests, disable_tqdm=True)]


def test_loglikelihood_runs_through_the_cache(model_dir):
    from lm_eval.models.huggingface import HFLM

    from armkv.evals.lm_eval_model import ArmkvLM

    full = ArmkvLM(method="full", pretrained=str(model_dir))
    swa = ArmkvLM(method="swa", budget=16, chunk=16, pretrained=str(model_dir))
    plain = HFLM(pretrained=str(model_dir), device="cpu", batch_size=1)
    long_context = "The grass is green. The sky is blue. " * 12
    pairs = [("The sky is", " blue"), (long_context + "The sun is", " yellow")]
    reference = loglikelihoods(plain, pairs)
    # full keeps every token: the same numbers as the plain model
    assert loglikelihoods(full, pairs) == pytest.approx(reference, abs=1e-4)
    # a 16-token window sees the short request whole, but not the long one
    windowed = loglikelihoods(swa, pairs)
    assert windowed[0] == pytest.approx(reference[0], abs=1e-4)
    assert abs(windowed[1] - reference[1]) > 1e-3


def test_local_tasks_run_end_to_end(model_dir):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from armkv.evals.lm_eval_model import ArmkvLM

    calls, horizons = [], []
    lm = ArmkvLM(method="swa", budget=32, chunk=16, pretrained=str(model_dir))
    new_cache = lm.new_cache
    lm.new_cache = lambda horizon=None: calls.append(1) or horizons.append(horizon) or new_cache(horizon)
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=["armkv_tiny_mc", "armkv_tiny_gen"],
        task_manager=TaskManager(include_path=str(DATA / "lm_eval"), include_defaults=False),
        limit=4,
    )["results"]
    assert 0.0 <= results["armkv_tiny_mc"]["acc,none"] <= 1.0
    assert 0.0 <= results["armkv_tiny_gen"]["exact_match,none"] <= 1.0
    # 4 loglikelihood batches of 3 choices (one cache per model call) and 4 generations
    assert len(calls) >= 8
    assert all(h is not None and h > 0 for h in horizons)  # each cache is told the tokens it will see


def test_registered_under_its_name():
    from lm_eval.api.registry import get_model

    from armkv.evals.lm_eval_model import ArmkvLM

    assert get_model("armkv") is ArmkvLM
