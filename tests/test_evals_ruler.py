"""RULER generator: every answer is recoverable from its context, at the asked depth and length; the scoring."""

from __future__ import annotations

import collections
import json
import re

import pytest

from armkv.errors import ArmkvError
from armkv.evals import common, ruler
from armkv.methods.base import ModelInfo
from test_evals_fixtures import DATA, fake_factory, tiny_tokenizer


@pytest.fixture(scope="module")
def gen():
    return ruler.RulerGenerator(
        tiny_tokenizer(),
        seed=42,
        haystack_words=ruler.load_essay(DATA / "essay.txt"),
        qa_data=ruler.load_qa_files([DATA / "squad_tiny.json", DATA / "hotpot_tiny.json"]),
    )


def n_tokens(text):
    return len(tiny_tokenizer().encode(text))


def full_text(sample):
    return sample["context"] + sample["question"] + sample["answer_prefix"]


# One haystack unit is a sentence (noise), a word (essay), a list item (cwe), a coded word (fwe):
# all well under 2% of 1K. A distractor needle with uuid key and value (niah_multikey_3) is
# ~100 tokens of this small tokenizer and a QA document is a whole paragraph: they land
# within one unit.
WITHIN_2_PERCENT = [t for t in ruler.TASKS if t not in ("niah_multikey_3", "qa_1", "qa_2")]


@pytest.mark.parametrize("task", list(ruler.TASKS))
@pytest.mark.parametrize("length", [1024, 2048])
def test_length_is_measured_in_tokens_and_fits_the_target(gen, task, length):
    samples = gen.samples(task, length, 2)
    for s in samples:
        tokens = n_tokens(full_text(s)) + ruler.tokens_to_generate(task)
        assert s["tokens"] == tokens <= length
        if task in WITHIN_2_PERCENT:
            assert tokens >= 0.98 * length, (task, tokens)
        else:
            unit = 0.25 * length if task.startswith("qa") else 0.12 * length
            assert tokens >= length - unit, (task, tokens)


@pytest.mark.parametrize("task", [t for t, (g, _) in ruler.TASKS.items() if g == "niah"])
def test_niah_needles_are_in_the_context_and_answer_the_question(gen, task):
    args = ruler.TASKS[task][1]
    kind = args["type_needle_v"]
    for s in gen.samples(task, 1024, 3):
        found = {}
        for key, value in re.findall(rf"One of the special magic {kind} for (\S+) is: (\S+)\.", s["context"]):
            found.setdefault(key, []).append(value)
        queried = [k for k in found if k in s["question"]]
        answers = [v for k in queried for v in found[k]]
        assert sorted(answers) == sorted(s["answers"])
        assert len(s["answers"]) == args["num_needle_v"] * args["num_needle_q"]
        assert s["answer_prefix"].startswith(" The special magic")


def test_niah_wording_is_rulers_singular_form(gen):
    s = gen.samples("niah_single_1", 1024, 1)[0]
    key = re.search(r"for (\S+) is:", s["context"]).group(1)
    assert s["context"].startswith(
        "A special magic number is hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the number afterwards.\nThe grass is green. The sky is blue."
    )
    assert s["question"] == f"\nWhat is the special magic number for {key} mentioned in the provided text?"
    assert s["answer_prefix"] == f" The special magic number for {key} mentioned in the provided text is"
    multi = gen.samples("niah_multivalue", 1024, 1)[0]
    assert multi["context"].startswith("Some special magic numbers are hidden")
    assert multi["question"].startswith("\nWhat are all the special magic numbers for ")


@pytest.mark.parametrize("task", ["niah_single_1", "niah_single_2", "niah_multikey_2"])
@pytest.mark.parametrize("depth", [0, 25, 50, 75, 100])
def test_needle_sits_at_the_asked_depth(gen, task, depth):
    (s,) = gen.samples(task, 2048, 1, depths=[depth])
    value = s["answers"][0]
    at = s["context"].index(f"is: {value}.")
    needle_start = s["context"].rfind("One of the special magic", 0, at)
    # depth is measured over the haystack: from the end of the instruction to the end of the context
    instruction = s["context"].index("afterwards.\n") + len("afterwards.\n")
    before = n_tokens(s["context"][instruction:needle_start])
    haystack = n_tokens(s["context"][instruction:])
    assert abs(100 * before / haystack - depth) < 3, (before, haystack)


def test_variable_tracking_chain_resolves_to_the_answer(gen):
    for s in gen.samples("vt", 2048, 3):
        # the in-context example comes first; the question's chain is in the last context
        context = s["context"].rsplit("Memorize and track", 1)[1]
        value = re.search(r"assigned the value (\d+)", s["question"]).group(1)
        assign = dict(re.findall(r"VAR (\w+) = (VAR \w+|\d+)", context))

        def resolve(name):
            target = assign[name]
            return target if target.isdigit() else resolve(target[4:])

        assert sorted(v for v in assign if resolve(v) == value) == sorted(s["answers"])
        assert len(s["answers"]) == 5
        assert "5 variables are assigned the value " + value in s["answer_prefix"]


def test_common_words_answers_are_the_most_frequent(gen):
    for length in (1024, 4096):
        (s,) = gen.samples("cwe", length, 1)
        listed = s["context"].rsplit("Memorize the ones that appear most often.\n", 1)[1]
        counts = collections.Counter(re.findall(r"\d+\. (\S+)", listed))
        top = [w for w, _ in counts.most_common(10)]
        assert sorted(top) == sorted(s["answers"])
        assert counts[s["answers"][0]] == (6 if length < 4096 else 30)


def test_freq_words_answers_are_the_three_most_frequent_coded_words(gen):
    (s,) = gen.samples("fwe", 2048, 1)
    coded = s["context"].split("coded words. ", 1)[1].split()
    counts = collections.Counter(w for w in coded if w != "...")
    assert [w for w, _ in counts.most_common(3)] == s["answers"]


@pytest.mark.parametrize("task", ["qa_1", "qa_2"])
def test_qa_answer_is_in_one_of_the_documents(gen, task):
    for s in gen.samples(task, 1024, 3):
        assert "Document 1:\n" in s["context"]
        assert any(a in s["context"] for a in s["answers"])
        assert s["question"].startswith("\n\nAnswer the question based on the given documents.")
        assert s["answer_prefix"] == " Answer:"


def test_chat_template_tokens_count_in_the_length():
    plain = ruler.RulerGenerator(tiny_tokenizer()).samples("niah_single_1", 1024, 1)[0]
    wrapped = ruler.RulerGenerator(tiny_tokenizer(), extra_tokens=40).samples("niah_single_1", 1024, 1)[0]
    assert wrapped["tokens"] <= 1024 and n_tokens(full_text(wrapped)) + 40 + 128 == wrapped["tokens"]
    assert len(wrapped["context"]) < len(plain["context"])


def test_samples_are_seeded_and_do_not_depend_on_the_others(gen):
    a = gen.samples("niah_single_1", 1024, 4)
    b = gen.samples("niah_single_1", 1024, 2)
    assert a[:2] == b
    other = ruler.RulerGenerator(tiny_tokenizer(), seed=7).samples("niah_single_1", 1024, 2)
    assert other[0]["answers"] != a[0]["answers"]


def test_scoring_matches_rulers_string_match():
    assert ruler.string_match_all("The numbers are 123 and 456.", ["123", "456"]) == 100.0
    assert ruler.string_match_all(" 123, 789", ["123", "456"]) == 50.0
    assert ruler.string_match_all("\x00nothing\n", ["123"]) == 0.0
    assert ruler.string_match_all("ABRASIVE-cat", ["abrasive-CAT"]) == 100.0  # case-insensitive
    assert ruler.string_match_part("Paris, France", ["paris", "London"]) == 100.0
    assert ruler.string_match_part("Rome", ["paris", "London"]) == 0.0
    assert ruler.metric_of("qa_2") is ruler.string_match_part
    assert ruler.metric_of("cwe") is ruler.string_match_all


def test_bad_input_is_one_line(gen):
    bare = ruler.RulerGenerator(tiny_tokenizer())
    with pytest.raises(ArmkvError, match="unknown RULER task 'niah_single_9'"):
        bare.check("niah_single_9")
    with pytest.raises(ArmkvError, match="--haystack-file"):
        bare.check("niah_single_2")
    with pytest.raises(ArmkvError, match="--qa-file FILE \\(SQuAD"):
        bare.check("qa_1")
    with pytest.raises(ArmkvError, match="HotpotQA"):
        bare.check("qa_2")
    with pytest.raises(ArmkvError, match="beyond the model's limit of 8192"):
        ruler.check_lengths([4096, 16384], 8192)
    with pytest.raises(ArmkvError, match="no such file"):
        ruler.load_essay(DATA / "missing.txt")
    for message in (str(e) for e in [ArmkvError(ruler.MISSING[k]) for k in ruler.MISSING]):
        assert "\n" not in message


@pytest.mark.parametrize("tool", ["ruler", "ablation"])
def test_zero_samples_is_a_one_line_error(tmp_path, capsys, tool):
    from armkv.cli import main

    assert main(["eval", tool, "--lengths", "1k", "--samples", "0", "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--samples 0: give at least 1" in err[0], err
    assert not (tmp_path / "out").exists()


def needle_answer(method, request):
    """A fake model that reads the needle when it is 'full' and guesses otherwise."""
    if method != "full":
        return " 0000000."
    key = re.search(r"for (\S+) mentioned", request["question"]).group(1)
    return " " + ", ".join(re.findall(rf"for {re.escape(key)} is: (\S+)\.", request["context"]))


def test_evaluate_writes_logs_summary_table_plot_and_resumes(tmp_path):
    gen = ruler.RulerGenerator(tiny_tokenizer())
    rows = [common.Row("full", "full"), common.Row("swa", "swa")]
    calls = []
    settings = {"eval": "ruler", "budget": 128}
    info = ModelInfo(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_positions=4096)
    kwargs = dict(settings=settings, budget=128, info=info)
    summary = ruler.evaluate(
        gen,
        rows,
        ["niah_single_1", "niah_multikey_2"],
        [1024],
        2,
        tmp_path,
        fake_factory(needle_answer, calls),
        **kwargs,
    )
    assert summary == {
        "full": {"niah_single_1": {"1024": 100.0}, "niah_multikey_2": {"1024": 100.0}},
        "swa": {"niah_single_1": {"1024": 0.0}, "niah_multikey_2": {"1024": 0.0}},
    }
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert len(calls) == 8 and {c[2] for c in calls} == {128}
    table = (tmp_path / "table.md").read_text()
    assert "| full | 100.00 | 100.00 |" in table and "| swa | 0.00 | 0.00 |" in table
    assert "(full: not bounded)" in table
    assert "128 token-equivalents per layer = 32,768 bytes per layer" in table
    assert (tmp_path / "ruler.png").stat().st_size > 0
    log = (tmp_path / "full__niah_single_1__1024.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in log] == ["niah_single_1-1024-0", "niah_single_1-1024-1"]

    # Interrupted: the last sample of one log is lost and another line is cut short.
    path = tmp_path / "swa__niah_multikey_2__1024.jsonl"
    first = path.read_text().splitlines()[0]
    path.write_text(first + "\n" + '{"id": "niah_multike')
    calls.clear()
    ruler.evaluate(
        gen,
        rows,
        ["niah_single_1", "niah_multikey_2"],
        [1024],
        3,
        tmp_path,
        fake_factory(needle_answer, calls),
        **kwargs,
    )
    redone = sorted(c[:2] for c in calls)
    assert redone == sorted(
        [(m, f"{t}-1024-2") for m in ("full", "swa") for t in ("niah_single_1", "niah_multikey_2")]
        + [("swa", "niah_multikey_2-1024-1")]
    )
    assert len(path.read_text().splitlines()) == 3

    with pytest.raises(ArmkvError, match="holds results for budget=128"):
        ruler.evaluate(
            gen,
            rows,
            ["niah_single_1"],
            [1024],
            1,
            tmp_path,
            fake_factory(needle_answer),
            settings={"eval": "ruler", "budget": 256},
        )


def test_chat_template_tokens_are_the_wrappers_tokens():
    import copy

    tok = copy.deepcopy(tiny_tokenizer())
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    wrapper = "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n"
    assert ruler.chat_template_tokens(tok) == len(tok.encode(wrapper, add_special_tokens=False))


@pytest.mark.parametrize("haystack", ["noise", "essay"])
def test_haystack_override_swaps_the_filler_and_keeps_the_needles(haystack):
    gen = ruler.RulerGenerator(tiny_tokenizer(), haystack_words=ruler.load_essay(DATA / "essay.txt"), haystack=haystack)
    noise_marker = ruler.NOISE_SENTENCES[0]
    for task in ("niah_single_1", "niah_single_2", "niah_multivalue", "niah_multikey_2"):
        (s,) = gen.samples(task, 1024, 1)
        for answer in s["answers"]:
            assert answer in s["context"]
        if task == "niah_multikey_2":  # a haystack of distractor needles stays as it is
            assert noise_marker not in s["context"]
        else:
            assert (noise_marker in s["context"]) == (haystack == "noise"), task
        assert 0.98 * 1024 <= s["tokens"] <= 1024


def test_haystack_override_names_what_is_missing():
    with pytest.raises(ArmkvError, match="--haystack-file"):
        ruler.RulerGenerator(tiny_tokenizer(), haystack="essay").samples("niah_single_1", 1024, 1)
    with pytest.raises(ArmkvError, match="choose task, noise or essay"):
        ruler.RulerGenerator(tiny_tokenizer(), haystack="prose")
