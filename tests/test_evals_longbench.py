"""LongBench: the official metrics against hand-computed values, prompts, truncation and the eval loop."""

from __future__ import annotations

import json

import pytest

from armkv.errors import ArmkvError
from armkv.evals import common
from armkv.evals import longbench as lb
from test_evals_fixtures import DATA, fake_factory, tiny_tokenizer

pytest.importorskip("rouge_score")
pytest.importorskip("rapidfuzz")


def test_qa_f1_normalises_and_counts_shared_tokens():
    # tokens [eiffel, tower, in, paris] vs [eiffel, tower]: P = 1/2, R = 1, F1 = 2/3
    assert lb.qa_f1_score("The Eiffel Tower, in Paris!", "Eiffel tower") == pytest.approx(2 / 3)
    assert lb.qa_f1_score("an apple", "the apple") == 1.0
    assert lb.qa_f1_score("nothing", "apple") == 0.0


def test_rouge_l_f_measure():
    # LCS "the cat on the mat" = 5 of 6 tokens each side: P = R = F = 5/6
    assert lb.rouge_score("the cat sat on the mat", "the cat lay on the mat") == pytest.approx(5 / 6)
    # LCS "a b" = 2; P = 2/2, R = 2/4, F = 2PR/(P+R) = 2/3
    assert lb.rouge_score("a b", "a x b y") == pytest.approx(2 / 3)
    assert lb.rouge_score("", "anything") == 0.0


def test_classification_retrieval_count_and_code_similarity():
    classes = ["Location", "Number", "Person", "Number of something"]
    assert lb.classification_score("Number", "Number", all_classes=classes) == 1.0
    assert lb.classification_score("Location and Number", "Number", all_classes=classes) == 0.5
    # "Number" is part of the true class "Number of something": it is dropped, not counted
    assert lb.classification_score("Number of something", "Number of something", all_classes=classes) == 1.0
    assert lb.classification_score("no idea", "Person", all_classes=classes) == 0.0
    assert lb.retrieval_score("Paragraph 3", "Paragraph 3") == 1.0
    assert lb.retrieval_score("Paragraph 3 or Paragraph 5", "Paragraph 3") == 0.5
    assert lb.retrieval_score("none", "Paragraph 3") == 0.0
    assert lb.count_score("There are 4 unique paragraphs out of 10", "4") == 0.5
    # 9 of 10 characters in common: ratio = 2 * 9 / 20 = 0.9
    assert lb.code_sim_score("x = foo(1)\n# more", "x = foo(2)") == pytest.approx(0.9)
    assert lb.code_sim_score("```python\n    return a + b\n```", "    return a + b") == 1.0


def test_score_takes_the_best_answer_and_the_first_line_where_longbench_does():
    assert lb.score("hotpotqa", "Paris", ["London", "paris"], None) == 100.0
    assert lb.score("trec", "\nCity\nNumber of something", ["City"], ["City", "Number of something"]) == 100.0
    assert lb.score("narrativeqa", "x\nb", ["b"], None) == pytest.approx(100 * 2 / 3)  # not first-line


def test_chinese_metrics_need_jieba():
    try:
        import jieba  # noqa: F401
    except ImportError:
        with pytest.raises(ArmkvError, match="pip install jieba"):
            lb.qa_f1_zh_score("你好", "你好")
    else:
        assert lb.qa_f1_zh_score("北京。", "北京") == 1.0


def test_configs_cover_every_dataset():
    assert set(lb.DATASET2PROMPT) == set(lb.DATASET2MAXLEN) == set(lb.DATASET2METRIC)
    assert all("{context}" in p for p in lb.DATASET2PROMPT.values())
    assert lb.DATASET2MAXLEN["gov_report"] == 512 and lb.DATASET2MAXLEN["hotpotqa"] == 32


def test_request_splits_at_the_context_and_truncates_the_middle():
    tok = tiny_tokenizer()
    sample = {"input": "Who?", "context": "word " * 3000, "answers": ["x"], "_id": "a"}
    request = lb.make_request("hotpotqa", sample, 0, tok, max_length=10_000)
    assert (
        request["question"]
        == "\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: Who?\nAnswer:"  # noqa: E501
    )
    assert request["context"].startswith("Answer the question based on the given passages.")
    short = lb.make_request("hotpotqa", sample, 0, tok, max_length=200)
    assert len(tok.encode(short["context"] + short["question"], add_special_tokens=False)) <= 202
    assert short["question"] == request["question"]  # the tail survived the cut
    code = lb.make_request("lcc", {"context": "def f():\n", "input": "", "_id": "c"}, 0, tok, 1000)
    assert code == {
        "id": "c",
        "context": "Please complete the code given below. \ndef f():\n",
        "question": "Next line of code:\n",
    }


def test_missing_data_is_one_line_error(tmp_path):
    with pytest.raises(ArmkvError, match="pass --data-dir"):
        lb.load_dataset(None, "hotpotqa")
    with pytest.raises(ArmkvError, match=r"expected .*hotpotqa.jsonl"):
        lb.load_dataset(tmp_path, "hotpotqa")
    with pytest.raises(ArmkvError, match="unknown LongBench dataset 'hotpot'"):
        lb.load_dataset(tmp_path, "hotpot")


def test_evaluate_scores_each_dataset_with_its_metric_and_lengths(tmp_path):
    answers = {"hq-1": "the Wend", "hq-2": "1900", "trec-1": "Individual", "lcc-1": "    return a + b"}
    calls = []
    chats = []

    def factory(method, options):
        chats.append(options["chat"])
        return fake_factory(lambda m, r: answers[r["id"]], calls)(method, options)

    summary = lb.evaluate(
        ["hotpotqa", "trec", "lcc"],
        DATA / "longbench",
        tiny_tokenizer(),
        [common.Row("arm", "arm")],
        tmp_path,
        factory,
        settings={"eval": "longbench"},
        max_length=4000,
        chat=True,
    )
    assert summary == {"arm": {"hotpotqa": {"all": 50.0}, "trec": {"all": 100.0}, "lcc": {"all": 100.0}}}
    assert sorted(chats) == [False, True]  # trec and lcc go without the chat template
    assert {c[1]: c[2] for c in calls} == {"hq-1": 32, "hq-2": 32, "trec-1": 64, "lcc-1": 64}
    table = (tmp_path / "table.md").read_text()
    assert "| Method | HQA | TRC | LCC | Avg. |" in table and "| arm | 50.00 | 100.00 | 100.00 | 83.33 |" in table
    record = json.loads((tmp_path / "arm__trec__all.jsonl").read_text())
    assert record["all_classes"] == ["City", "Individual", "Number of something"] and record["source_length"] == 30
