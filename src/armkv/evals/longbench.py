"""LongBench (v1) from local JSONL files, with the official prompts, generation lengths and metrics.

The prompts and maximum generation lengths are THUDM/LongBench's ``config/dataset2prompt.json``
and ``config/dataset2maxlen.json``; the metrics are its ``metrics.py`` with ROUGE from
Google's ``rouge-score`` (LongBench uses the ``rouge`` package: same ROUGE-L F-measure on
plain English text) and edit similarity from ``rapidfuzz`` (``fuzz.ratio``, as
``fuzzywuzzy`` computes it). As in ``pred.py``, an over-long prompt is cut in the middle,
and the chat template is not applied to the few-shot and code datasets. ``pred.py``'s
samsum-only stop on a newline is left to the scorer, which keeps the first line of
samsum, trec, triviaqa and lsht predictions as ``eval.py`` does.
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from pathlib import Path

from armkv.errors import ArmkvError, read_text
from armkv.evals import common

# config/dataset2prompt.json
DATASET2PROMPT = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer the question as concisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: {context}\n\nNow, answer the question based on the story as concisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
    "qasper": 'You are given a scientific article and a question. Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:',
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "multifieldqa_zh": "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题：{input}\n回答：",
    "hotpotqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "2wikimqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "musique": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "dureader": "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:",
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any other words. The following are some examples.\n\n{context}\n\n{input}",
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",
    "passage_retrieval_en": 'Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", etc.\n\nThe answer is: ',
    "passage_retrieval_zh": '以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n{input}\n\n请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n\n答案是：',
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

# config/dataset2maxlen.json
DATASET2MAXLEN = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "multifieldqa_zh": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "dureader": 128,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "vcsum": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
    "lsht": 64,
    "passage_count": 32,
    "passage_retrieval_en": 32,
    "passage_retrieval_zh": 32,
    "lcc": 64,
    "repobench-p": 64,
}

# The paper's LongBench table (its column abbreviations), in its order.
PAPER_DATASETS = {
    "narrativeqa": "NQA",
    "qasper": "QQA",
    "multifieldqa_en": "MFQ",
    "hotpotqa": "HQA",
    "2wikimqa": "2WM",
    "musique": "Mus",
    "gov_report": "GvR",
    "qmsum": "QMS",
    "multi_news": "MNs",
    "trec": "TRC",
    "triviaqa": "TQA",
    "samsum": "SSM",
    "lcc": "LCC",
    "repobench-p": "RBP",
}

# pred.py: chat models are better off without the chat template on these.
NO_CHAT = ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")
# eval.py: only the first line of the prediction is scored on these.
FIRST_LINE = ("trec", "triviaqa", "samsum", "lsht")

# --------------------------------------------------------------------------- metrics (metrics.py)


def normalize_answer(s: str) -> str:
    """Lower text and remove punctuation, articles and extra whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def normalize_zh_answer(s: str) -> str:
    """Lower text and remove (Chinese and ASCII) punctuation and whitespace."""
    cn_punctuation = "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
    punctuation = set(string.punctuation + cn_punctuation)
    return "".join("".join(ch for ch in s.lower() if ch not in punctuation).split())


def _jieba_cut(text: str) -> list[str]:
    try:
        import jieba
    except ImportError:
        raise ArmkvError("the Chinese LongBench metrics need jieba: pip install jieba") from None
    return list(jieba.cut(text, cut_all=False))


def f1_score(prediction: list, ground_truth: list) -> float:
    common_tokens = Counter(prediction) & Counter(ground_truth)
    num_same = sum(common_tokens.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction)
    recall = num_same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **_) -> float:
    return f1_score(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh_score(prediction: str, ground_truth: str, **_) -> float:
    pred = [t for t in (normalize_zh_answer(t) for t in _jieba_cut(prediction)) if t]
    truth = [t for t in (normalize_zh_answer(t) for t in _jieba_cut(ground_truth)) if t]
    return f1_score(pred, truth)


class _WhitespaceTokenizer:
    """Split on whitespace only: rouge-score's default tokenizer drops every non-ASCII character."""

    def tokenize(self, text: str) -> list[str]:
        return text.split()


def rouge_score(prediction: str, ground_truth: str, tokenizer=None, **_) -> float:
    """ROUGE-L F-measure; 0 for an empty prediction or reference (as LongBench's try/except gives)."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], tokenizer=tokenizer)
    if not prediction.strip() or not ground_truth.strip():
        return 0.0
    return scorer.score(ground_truth, prediction)["rougeL"].fmeasure


def rouge_zh_score(prediction: str, ground_truth: str, **_) -> float:
    return rouge_score(
        " ".join(_jieba_cut(prediction)), " ".join(_jieba_cut(ground_truth)), tokenizer=_WhitespaceTokenizer()
    )


def classification_score(prediction: str, ground_truth: str, all_classes: list[str], **_) -> float:
    """1 / (classes named) if the right class is among the classes the prediction names.

    Kept as LongBench wrote it: names that are part of the ground truth (but not it) are
    removed while the list is walked (so one right after a removed one stays), and the
    fallback to the most similar class never runs (its guard compares a list with 0), so
    a prediction naming no class scores 0.
    """
    matches = [c for c in all_classes if c in prediction]
    for term in matches:
        if term in ground_truth and term != ground_truth:
            matches.remove(term)
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _share_equal(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    return 0.0 if not numbers else sum(n == str(target) for n in numbers) / len(numbers)


def retrieval_score(prediction: str, ground_truth: str, **_) -> float:
    """Share of the numbers in the prediction that are the right paragraph's."""
    return _share_equal(prediction, re.findall(r"Paragraph (\d+)", ground_truth)[0])


def retrieval_zh_score(prediction: str, ground_truth: str, **_) -> float:
    return _share_equal(prediction, re.findall(r"段落(\d+)", ground_truth)[0])


def count_score(prediction: str, ground_truth: str, **_) -> float:
    """Share of the numbers in the prediction that are the right count."""
    return _share_equal(prediction, ground_truth)


def code_sim_score(prediction: str, ground_truth: str, **_) -> float:
    """Edit similarity of the first line that is not a comment or a code fence."""
    from rapidfuzz import fuzz

    lines = prediction.lstrip("\n").split("\n")
    line = next((line for line in lines if "`" not in line and "#" not in line and "//" not in line), "")
    return fuzz.ratio(line, ground_truth) / 100


DATASET2METRIC = {
    "narrativeqa": qa_f1_score,
    "qasper": qa_f1_score,
    "multifieldqa_en": qa_f1_score,
    "multifieldqa_zh": qa_f1_zh_score,
    "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score,
    "musique": qa_f1_score,
    "dureader": rouge_zh_score,
    "gov_report": rouge_score,
    "qmsum": rouge_score,
    "multi_news": rouge_score,
    "vcsum": rouge_zh_score,
    "trec": classification_score,
    "triviaqa": qa_f1_score,
    "samsum": rouge_score,
    "lsht": classification_score,
    "passage_retrieval_en": retrieval_score,
    "passage_count": count_score,
    "passage_retrieval_zh": retrieval_zh_score,
    "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}


def score(dataset: str, prediction: str, answers: list[str], all_classes: list[str] | None) -> float:
    """``eval.py``'s per-sample score, 0-100: the best over the reference answers."""
    if dataset in FIRST_LINE:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = DATASET2METRIC[dataset]
    return 100.0 * max(metric(prediction, truth, all_classes=all_classes) for truth in answers)


# --------------------------------------------------------------------------- data


def dataset_path(data_dir: str | Path | None, dataset: str) -> Path:
    """``<data_dir>/<dataset>.jsonl``, or a one-line error naming what is missing."""
    if dataset not in DATASET2PROMPT:
        raise ArmkvError(f"unknown LongBench dataset {dataset!r}; choose from: {', '.join(DATASET2PROMPT)}")
    if data_dir is None:
        raise ArmkvError(
            "LongBench needs its data: pass --data-dir DIR (the folder of LongBench's <dataset>.jsonl files)"
        )
    path = Path(data_dir) / f"{dataset}.jsonl"
    if not path.is_file():
        raise ArmkvError(
            f"LongBench data for {dataset} not found: expected {path} (pass --data-dir, the folder of LongBench's <dataset>.jsonl files)"
        )
    return path


def load_dataset(data_dir: str | Path | None, dataset: str) -> list[dict]:
    """The samples of ``<data_dir>/<dataset>.jsonl`` (LongBench's data format)."""
    path = dataset_path(data_dir, dataset)
    samples = []
    for i, line in enumerate(read_text(path, "LongBench data").splitlines()):
        if line.strip():
            try:
                samples.append(json.loads(line))
            except json.JSONDecodeError:
                raise ArmkvError(f"{path}: line {i + 1} is not JSON") from None
    return samples


def truncate_middle(prompt: str, tokenizer, max_length: int) -> str:
    """``pred.py``'s truncation: keep the first and last ``max_length // 2`` tokens."""
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    if len(ids) <= max_length:
        return prompt
    half = max_length // 2
    return tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(
        ids[-half:], skip_special_tokens=True
    )


def make_request(dataset: str, sample: dict, index: int, tokenizer, max_length: int) -> dict:
    """The runner request of one sample: the prompt cut where the context ends, so the cache
    compresses the context before it reads the question.

    After a middle truncation the question is still the prompt's tail when it survived
    whole; otherwise the whole prompt goes as one ``prompt``.
    """
    marker = "\x00CONTEXT\x00"
    fields = {k: v for k, v in sample.items() if isinstance(v, str)}
    after = DATASET2PROMPT[dataset].format(**{**fields, "context": marker}).split(marker, 1)[1]
    prompt = truncate_middle(DATASET2PROMPT[dataset].format(**fields), tokenizer, max_length)
    request = {"id": str(sample.get("_id") or f"{dataset}-{index}")}
    if after and prompt.endswith(after) and len(prompt) > len(after):
        request.update(context=prompt[: -len(after)], question=after)
    else:
        request["prompt"] = prompt
    return request


# --------------------------------------------------------------------------- the eval


def evaluate(
    datasets: list[str],
    data_dir: Path | None,
    tokenizer,
    rows: list[common.Row],
    output: Path,
    runner_factory: common.RunnerFactory,
    *,
    settings: dict,
    max_length: int,
    samples: int | None = None,
    chat: bool = False,
    max_new_tokens: int | None = None,
    budget: int | None = None,
    info=None,
) -> dict:
    """Run LongBench for every row and dataset into ``output``; return the summary.

    The summary's length key is ``"all"`` (LongBench reports one score per dataset).
    ``runner_factory`` gets ``chat`` in the options: False for the datasets ``pred.py``
    leaves without the chat template. ``max_new_tokens`` caps the datasets' generation lengths.
    """
    output = Path(output)
    data = {d: load_dataset(data_dir, d) for d in datasets}
    common.check_settings(output, settings)
    for use_chat in (True, False):
        names = [d for d in datasets if (chat and d not in NO_CHAT) == use_chat]
        jobs = []
        for d in names:
            chosen = data[d][:samples] if samples else data[d]
            made = []
            for i, sample in enumerate(chosen):
                request = make_request(d, sample, i, tokenizer, max_length)
                made.append(
                    {
                        **request,
                        "task": d,
                        "answers": sample["answers"],
                        "all_classes": sample.get("all_classes"),
                        "source_length": sample.get("length"),
                    }
                )
            jobs.append((d, "all", made))
        if jobs:
            common.score_pending(
                output,
                rows,
                jobs,
                lambda method, options, use_chat=use_chat: runner_factory(method, {**options, "chat": use_chat}),
                score=lambda prediction, s: score(s["task"], prediction, s["answers"], s["all_classes"]),
                max_new_tokens=lambda d: min(DATASET2MAXLEN[d], max_new_tokens or 10**9),
                desc="LongBench",
            )

    summary = common.collect_summary(output)
    labels = [row.label for row in rows]
    cells = {r: {PAPER_DATASETS.get(d, d): c[d]["all"] for d in datasets if d in c} for r, c in summary.items()}
    caption = common.budget_caption(budget, info, common.measured_bytes(output, labels), common.unbounded(rows))
    table = common.markdown_table(cells, labels, [PAPER_DATASETS.get(d, d) for d in datasets], caption)
    return common.finish(output, summary, "LongBench", [table])


# --------------------------------------------------------------------------- command line


def add_arguments(parser) -> None:
    parser.add_argument("--data-dir", default=None, help="folder of LongBench's <dataset>.jsonl files")
    parser.add_argument(
        "--tasks",
        default=",".join(PAPER_DATASETS),
        help="comma-separated datasets (default: the paper's 14: %(default)s)",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=None, help="cap on generated tokens (default: each dataset's, 32 to 512)"
    )
    parser.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="prompt tokens kept (middle truncation; default: the model's positions less the longest generation)",
    )
    common.add_common_arguments(
        parser, methods="full,swa,sink,kivi,arm", samples=0, samples_help="first samples of each dataset, 0 for all"
    )


def main(args) -> int:
    datasets = common.parse_list(args.tasks, "tasks")
    for d in datasets:
        dataset_path(args.data_dir, d)  # one-line errors before the model loads
    rows = common.method_rows(args.methods, common.method_options(args))
    from armkv.tools.preflight import model_info_from_config

    known, _ = model_info_from_config(args.model)  # the prompt length, where config.json says it before the load
    positions = args.max_length or (known and known.max_positions - max(DATASET2MAXLEN[d] for d in datasets))
    early = positions and common.settings_of(
        args, "longbench", max_length=positions, max_new_tokens=args.max_new_tokens
    )
    model, tokenizer, info = common.load(args, early or None)
    max_length = args.max_length or info.max_positions - max(DATASET2MAXLEN[d] for d in datasets)
    evaluate(
        datasets,
        args.data_dir,
        tokenizer,
        rows,
        args.output,
        common.runner_factory(
            model, tokenizer, budget=args.budget, chunk=args.chunk, chat=args.chat, compile=args.compile
        ),
        settings=common.settings_of(args, "longbench", max_length=max_length, max_new_tokens=args.max_new_tokens),
        max_length=max_length,
        samples=args.samples or None,
        chat=args.chat,
        max_new_tokens=args.max_new_tokens,
        budget=args.budget,
        info=info,
    )
    return 0
