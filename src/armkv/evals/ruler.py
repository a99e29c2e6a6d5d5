"""A RULER generator and scorer, faithful to NVIDIA/RULER's synthetic tasks.

The 13 tasks of RULER's ``scripts/synthetic.yaml``, with the templates and answer
prefixes of ``scripts/data/synthetic/constants.py`` and the constructions of
``niah.py``, ``variable_tracking.py``, ``common_words_extraction.py``,
``freq_words_extraction.py`` and ``qa.py``. Lengths are in the model's tokens: a
sample's length is its prompt's tokens plus the task's tokens to generate (RULER's
``max_seq_length``), and the haystack is fitted by searching its size, as RULER does.

Where this differs from RULER, and why:

- The noise haystack is fitted to the sentence, not only to the whole five-sentence
  repeat: the last repeat may be cut after any of its sentences. One repeat is ~25
  tokens, more than 2% of a 1K sample.
- Each sample's haystack is fitted on its own (RULER fits once and only shrinks), so
  every sample lands within one haystack unit of the target length.
- Essays are split into sentences by punctuation instead of nltk's punkt (which would
  need a download); keys and common words come from :mod:`armkv.evals.words`.
- Lengths count the special tokens the tokenizer adds (a BOS) and, with ``--chat``, the
  chat template's tokens (RULER's ``model_template_token``), so a sample at the model's
  limit still fits it.
- A haystack of whole distractor needles (``niah_multikey_2/3``) or documents (QA) lands
  within one needle or document of the target, as in RULER: more than 2% at 1K for
  uuid needles and most documents.
- ``depth`` (percent) places every needle of a sample at that depth; without it the
  needles go to random depths as in RULER.
- Each sample draws from its own seeded generator (seed, task, length, index), so a
  sample is the same whichever samples were made before it: resuming cannot change it.
"""

from __future__ import annotations

import json
import math
import random
import re
import string
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from armkv.errors import ArmkvError, read_text
from armkv.evals import common, words

# scripts/data/synthetic/constants.py
TEMPLATES = {
    "niah": {
        "tokens_to_generate": 128,
        "template": "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} for {query} mentioned in the provided text?",  # noqa: E501  (RULER's own text)
        "answer_prefix": " The special magic {type_needle_v} for {query} mentioned in the provided text are",
    },
    "variable_tracking": {
        "tokens_to_generate": 30,
        "template": "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.",  # noqa: E501  (RULER's own text)
        "answer_prefix": " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned the value {query}, they are: ",  # noqa: E501  (RULER's own text)
    },
    "common_words_extraction": {
        "tokens_to_generate": 120,
        "template": "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?",  # noqa: E501  (RULER's own text)
        "answer_prefix": " Answer: The top 10 words that appear most often in the list are:",
    },
    "freq_words_extraction": {
        "tokens_to_generate": 50,
        "template": "Read the following coded text and track the frequency of each coded word. Find the three most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently appeared words in the above coded text?",  # noqa: E501  (RULER's own text)
        "answer_prefix": " Answer: According to the coded text above, the three most frequently appeared words are:",
    },
    "qa": {
        "tokens_to_generate": 32,
        "template": "Answer the question based on the given documents. Only give me the answer and do not output any other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",  # noqa: E501  (RULER's own text)
        "answer_prefix": " Answer:",
    },
}

# scripts/synthetic.yaml: task -> (generator, its arguments)
TASKS = {
    "niah_single_1": (
        "niah",
        dict(
            type_haystack="noise",
            type_needle_k="words",
            type_needle_v="numbers",
            num_needle_k=1,
            num_needle_v=1,
            num_needle_q=1,
        ),
    ),
    "niah_single_2": (
        "niah",
        dict(
            type_haystack="essay",
            type_needle_k="words",
            type_needle_v="numbers",
            num_needle_k=1,
            num_needle_v=1,
            num_needle_q=1,
        ),
    ),
    "niah_single_3": (
        "niah",
        dict(
            type_haystack="essay",
            type_needle_k="words",
            type_needle_v="uuids",
            num_needle_k=1,
            num_needle_v=1,
            num_needle_q=1,
        ),
    ),
    "niah_multikey_1": (
        "niah",
        dict(
            type_haystack="essay",
            type_needle_k="words",
            type_needle_v="numbers",
            num_needle_k=4,
            num_needle_v=1,
            num_needle_q=1,
        ),
    ),
    "niah_multikey_2": (
        "niah",
        dict(
            type_haystack="needle",
            type_needle_k="words",
            type_needle_v="numbers",
            num_needle_k=1,
            num_needle_v=1,
            num_needle_q=1,
        ),
    ),
    "niah_multikey_3": (
        "niah",
        dict(
            type_haystack="needle",
            type_needle_k="uuids",
            type_needle_v="uuids",
            num_needle_k=1,
            num_needle_v=1,
            num_needle_q=1,
        ),
    ),
    "niah_multivalue": (
        "niah",
        dict(
            type_haystack="essay",
            type_needle_k="words",
            type_needle_v="numbers",
            num_needle_k=1,
            num_needle_v=4,
            num_needle_q=1,
        ),
    ),
    "niah_multiquery": (
        "niah",
        dict(
            type_haystack="essay",
            type_needle_k="words",
            type_needle_v="numbers",
            num_needle_k=1,
            num_needle_v=1,
            num_needle_q=4,
        ),
    ),
    "vt": ("variable_tracking", dict(type_haystack="noise", num_chains=1, num_hops=4)),
    "cwe": ("common_words_extraction", dict(freq_cw=30, freq_ucw=3, num_cw=10)),
    "fwe": ("freq_words_extraction", dict(alpha=2.0)),
    "qa_1": ("qa", dict(dataset="squad")),
    "qa_2": ("qa", dict(dataset="hotpotqa")),
}

# The tasks that need no data file (noise or synthetic haystacks): the default task list.
NO_FILE_TASKS = tuple(
    name for name, (gen, a) in TASKS.items() if gen != "qa" and a.get("type_haystack", "noise") != "essay"
)

NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NOISE_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
DOCUMENT_PROMPT = "Document {i}:\n{document}"
# np.round(np.linspace(0, 100, num=40)).astype(int): the depths RULER draws from
DEPTHS = [int(math.floor(100 * i / 39 + 0.5)) for i in range(40)]


@dataclass
class Prompt:
    """One generated sample: the runner's request fields and the answers.

    ``context + question + answer_prefix`` is RULER's full input text; the split lets the
    cache compress the context before the question is read.
    """

    context: str
    question: str
    answer_prefix: str
    answers: list

    @property
    def text(self) -> str:
        return self.context + self.question + self.answer_prefix


def _split_template(template: str, **fields) -> tuple[str, str]:
    """Format ``template`` and cut it where ``{context}`` stands: (before the context, after it)."""
    marker = "\x00CONTEXT\x00"
    before, after = template.format(context=marker, **fields).split(marker)
    return before, after


# --------------------------------------------------------------------------- scoring


def postprocess(prediction: str) -> str:
    """RULER's ``postprocess_pred``: strip, and turn control characters into newlines."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def string_match_all(prediction: str, answers: list[str]) -> float:
    """Share (0-100) of the answers found in the prediction, case-insensitively."""
    pred = postprocess(prediction).lower()
    return 100.0 * sum(a.lower() in pred for a in answers) / len(answers)


def string_match_part(prediction: str, answers: list[str]) -> float:
    """100 if any answer is found in the prediction, case-insensitively, else 0."""
    pred = postprocess(prediction).lower()
    return 100.0 * max(a.lower() in pred for a in answers)


def metric_of(task: str) -> Callable[[str, list[str]], float]:
    """RULER's metric per task: ``string_match_part`` for QA, ``string_match_all`` otherwise."""
    return string_match_part if TASKS[task][0] == "qa" else string_match_all


def tokens_to_generate(task: str) -> int:
    return TEMPLATES[TASKS[task][0]]["tokens_to_generate"]


# --------------------------------------------------------------------------- data files


def _read_json(path: Path, option: str):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArmkvError(f"{option} {path}: not a JSON file ({e})") from None


def load_essay(path: str | Path) -> list[str]:
    """The essay haystack as a list of words, from a ``.txt`` of prose or a ``.json``.

    A JSON file may be RULER's ``PaulGrahamEssays.json`` (``{"text": ...}``), a list of
    strings, or a list of objects with a ``text`` field.
    """
    path = Path(path)
    raw = read_text(path, "--haystack-file")
    if path.suffix == ".json":
        data = _read_json(path, "--haystack-file")
        if isinstance(data, dict) and "text" in data:
            raw = data["text"]
        elif isinstance(data, list):
            raw = " ".join(d if isinstance(d, str) else d.get("text", "") for d in data)
        else:
            raise ArmkvError(f"--haystack-file {path}: expected {{'text': ...}} or a list of texts")
    haystack = re.sub(r"\s+", " ", raw).strip().split(" ")
    if len(haystack) < 50:
        raise ArmkvError(f"--haystack-file {path}: only {len(haystack)} words; give a longer text")
    return haystack


def read_squad(data: dict) -> tuple[list[dict], list[str]]:
    """RULER's ``read_squad``: answerable questions, each with its paragraph and its article's others."""
    docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = []
    for d in data["data"]:
        more = [index[p["context"]] for p in d["paragraphs"]]
        for p in d["paragraphs"]:
            for qa in p["qas"]:
                if not qa.get("is_impossible", False):
                    qas.append(
                        {
                            "query": qa["question"],
                            "outputs": [a["text"] for a in qa["answers"]],
                            "context": [index[p["context"]]],
                            "more_context": [i for i in more if i != index[p["context"]]],
                        }
                    )
    return qas, docs


def read_hotpotqa(data: list) -> tuple[list[dict], list[str]]:
    """RULER's ``read_hotpotqa``: each question with all of its (gold and distractor) paragraphs."""
    docs = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = [
        {
            "query": d["question"],
            "outputs": [d["answer"]],
            "context": [index[f"{t}\n{''.join(p)}"] for t, p in d["context"]],
        }
        for d in data
    ]
    return qas, docs


def load_qa_files(paths: list[str | Path] | None) -> dict[str, tuple[list[dict], list[str]]]:
    """``{"squad": (qas, docs), "hotpotqa": (qas, docs)}`` from the files given, told apart by shape."""
    datasets = {}
    for path in paths or ():
        path = Path(path)
        if not path.is_file():
            raise ArmkvError(f"--qa-file {path}: no such file")
        data = _read_json(path, "--qa-file")
        if isinstance(data, dict) and "data" in data:
            datasets["squad"] = read_squad(data)
        elif isinstance(data, list) and data and "context" in data[0] and "answer" in data[0]:
            datasets["hotpotqa"] = read_hotpotqa(data)
        else:
            raise ArmkvError(
                f"--qa-file {path}: neither SQuAD JSON ({{'data': [...]}}) nor HotpotQA JSON (a list of questions)"
            )
    return datasets


MISSING = {
    "essay": "an essay haystack: pass --haystack-file FILE (a .txt of prose, or RULER's PaulGrahamEssays.json)",
    "squad": "SQuAD data: pass --qa-file FILE (SQuAD JSON, e.g. dev-v2.0.json)",
    "hotpotqa": "HotpotQA data: pass --qa-file FILE (HotpotQA JSON, e.g. hotpot_dev_distractor_v1.json)",
}


# --------------------------------------------------------------------------- generator


def zeta(alpha: float, terms: int = 1000) -> float:
    """Riemann zeta(alpha) for alpha > 1 (Euler-Maclaurin tail), as scipy.special.zeta gives it."""
    head = sum(k**-alpha for k in range(1, terms))
    return head + terms ** (1 - alpha) / (alpha - 1) + 0.5 * terms**-alpha


class RulerGenerator:
    """Makes RULER samples of a given length in a tokenizer's tokens.

    Parameters
    ----------
    tokenizer : anything with ``encode(text) -> list[int]`` (a transformers tokenizer)
    seed : the base seed (RULER's ``random_seed``)
    haystack_words : the essay haystack as words (:func:`load_essay`), or None
    qa_data : :func:`load_qa_files`'s result, or None
    extra_tokens : tokens the runner adds around every prompt (a chat template's), counted
        in each sample's length as RULER counts its model template
    haystack : None (each task's own), or "noise" / "essay": the haystack of every needle
        task whose own is one of those two (the multikey_2/3 distractor haystacks stay), so
        that the same needle tasks can be run on repetitive and on real prose filler
    """

    def __init__(
        self,
        tokenizer,
        seed: int = 42,
        haystack_words: list[str] | None = None,
        qa_data: dict | None = None,
        extra_tokens: int = 0,
        haystack: str | None = None,
    ):
        if haystack not in (None, "noise", "essay"):
            raise ArmkvError(f"--haystack {haystack!r}: choose task, noise or essay")
        self.haystack = haystack
        self.tokenizer = tokenizer
        self.seed = seed
        self.extra_tokens = extra_tokens
        self.essay = haystack_words
        self.qa = qa_data or {}
        self._vt_icl: dict = {}

    def count(self, text: str) -> int:
        """Tokens of ``text`` as the model reads it: with the special tokens the tokenizer adds
        (a BOS), which RULER's ``text_to_tokens`` leaves out, so a sample fits the model's limit."""
        return len(self.tokenizer.encode(text)) + self.extra_tokens

    def check(self, task: str) -> None:
        """Raise a one-line error if the task is unknown or its data file is missing."""
        if task not in TASKS:
            raise ArmkvError(f"unknown RULER task {task!r}; choose from: {', '.join(TASKS)}")
        gen, args = self.task_args(task)
        if args.get("type_haystack") == "essay" and self.essay is None:
            raise ArmkvError(f"{task} needs {MISSING['essay']}")
        if gen == "qa" and args["dataset"] not in self.qa:
            raise ArmkvError(f"{task} needs {MISSING[args['dataset']]}")

    def samples(self, task: str, length: int, count: int, depths: list[float] | None = None) -> list[dict]:
        """``count`` samples of ``task`` at ``length`` tokens (prompt + tokens to generate).

        Each is ``{"id", "task", "length", "tokens", "depth", "context", "question",
        "answer_prefix", "answers"}``; ``tokens`` is the measured length. Sample ``i`` uses
        ``depths[i % len(depths)]`` when depths are given.
        """
        self.check(task)
        out, start = [], None
        for i in range(count):
            depth = depths[i % len(depths)] if depths else None
            build = self._builder(task, length, i, depth)
            n, prompt, tokens = self._fit(build, length, tokens_to_generate(task), start, task, i)
            start = n
            out.append(
                {
                    "id": f"{task}-{length}-{i}",
                    "task": task,
                    "length": length,
                    "tokens": tokens,
                    "depth": depth,
                    "context": prompt.context,
                    "question": prompt.question,
                    "answer_prefix": prompt.answer_prefix,
                    "answers": prompt.answers,
                }
            )
        return out

    # ------------------------------------------------------------------ fitting

    def _fit(self, build, target: int, reserve: int, start: int | None, task: str, index: int):
        """The largest haystack size ``n`` whose prompt plus ``reserve`` tokens fits ``target``.

        ``start`` (the previous sample's size) is tried first, since samples of one task
        mostly land on the same size; otherwise the size is searched by doubling, then
        bisection. ``size`` is nearly monotone in ``n`` (a unit adds tokens).
        """
        cache: dict[int, tuple[Prompt, int]] = {}

        def size(n: int) -> int:
            if n not in cache:
                prompt = build(n)
                cache[n] = (prompt, self.count(prompt.text) + reserve)
            return cache[n][1]

        lo = build.min_units
        if size(lo) > target:
            raise ArmkvError(
                f"{task} at {target} tokens: sample {index} needs {size(lo)} tokens even with the smallest haystack; "
                "use a longer --lengths value"
            )
        if start is not None and size(start) <= target and size(start + 1) > target:
            n = start
        else:
            hi = max(lo + 1, start or 2 * lo)
            while size(hi) <= target:
                lo, hi = hi, hi * 2
            while hi - lo > 1:  # size(lo) fits, size(hi) does not
                mid = (lo + hi) // 2
                if size(mid) <= target:
                    lo = mid
                else:
                    hi = mid
            n = lo
        return n, cache[n][0], cache[n][1]

    def task_args(self, task: str) -> tuple[str, dict]:
        """The task's generator and arguments, with the haystack override applied."""
        gen, args = TASKS[task]
        if self.haystack is not None and gen == "niah" and args["type_haystack"] in ("noise", "essay"):
            args = {**args, "type_haystack": self.haystack}
        return gen, args

    def _rng(self, task: str, length: int, index: int) -> random.Random:
        return random.Random(f"{self.seed}/{task}/{length}/{index}")

    def _builder(self, task: str, length: int, index: int, depth: float | None):
        """``build(n) -> Prompt`` for one sample; ``build.min_units`` is the smallest ``n``.

        Each call restarts the sample's generator, so ``build(n)`` and ``build(n + 1)``
        draw the same keys and values and differ only in the haystack.
        """
        gen, args = self.task_args(task)
        make = {
            "niah": self._niah,
            "variable_tracking": self._variable_tracking,
            "common_words_extraction": self._common_words,
            "freq_words_extraction": self._freq_words,
            "qa": self._qa,
        }[gen]

        def build(n: int) -> Prompt:
            return make(self._rng(task, length, index), n, length=length, index=index, depth=depth, **args)

        build.min_units = self._min_units(gen, args, index)
        return build

    def _min_units(self, gen: str, args: dict, index: int) -> int:
        """The smallest haystack that can hold the sample's needles (RULER samples distinct lines for them)."""
        if gen == "qa":
            qas, _ = self.qa[args["dataset"]]
            return len(qas[index % len(qas)]["context"])
        if gen == "variable_tracking":
            lines = args["num_hops"] + 1
        elif gen == "niah" and args["type_haystack"] != "essay":
            lines = max(args["num_needle_k"], args["num_needle_q"]) * args["num_needle_v"]
        else:
            return 1
        # noise lines are five sentences each; distractor needles are one line each
        return lines if args.get("type_haystack") == "needle" else len(NOISE_SENTENCES) * (lines - 1) + 1

    # ------------------------------------------------------------------ haystacks

    @staticmethod
    def _random_value(rng: random.Random, kind: str) -> str:
        if kind == "numbers":  # generate_random_number(num_digits=7)
            return str(rng.randint(10**6, 10**7 - 1))
        if kind == "words":
            return f"{rng.choice(words.ADJECTIVES)}-{rng.choice(words.NOUNS)}"
        if kind == "uuids":
            return str(uuid.UUID(int=rng.getrandbits(128), version=4))
        raise ArmkvError(f"unknown needle type {kind!r}")

    @staticmethod
    def _noise_lines(n: int) -> list[str]:
        """``n`` noise sentences as RULER's lines: whole repeats, then the last repeat cut after a sentence."""
        full, rest = divmod(n, len(NOISE_SENTENCES))
        lines = [NOISE] * full
        if rest:
            lines.append(" ".join(NOISE_SENTENCES[:rest]))
        return lines

    def _essay_sentences(self, n: int) -> list[str]:
        """The first ``n`` words of the essay (repeated as needed), split into sentences."""
        repeats = -(-n // len(self.essay))
        text = " ".join((self.essay * repeats)[:n]).strip()
        return [s for s in re.split(r"(?<=[.!?])\s+", text) if s]

    @staticmethod
    def _insert_at_depths(units: int, count: int, depth: float | None, choices) -> list[int]:
        """Insertion indexes into ``units`` haystack units: all at ``depth`` percent, or drawn as RULER draws them."""
        if depth is not None:
            return [int(units * depth / 100)] * count
        return choices(units, count)

    # ------------------------------------------------------------------ tasks

    def _niah(
        self,
        rng,
        n,
        *,
        type_haystack,
        type_needle_k,
        type_needle_v,
        num_needle_k,
        num_needle_v,
        num_needle_q,
        depth,
        **_,
    ):
        num_needle_k = max(num_needle_k, num_needle_q)
        keys, values, needles = [], [], []
        for _ in range(num_needle_k):
            keys.append(self._random_value(rng, type_needle_k))
            value = []
            for _ in range(num_needle_v):
                value.append(self._random_value(rng, type_needle_v))
                needles.append(NEEDLE.format(type_needle_v=type_needle_v, key=keys[-1], value=value[-1]))
            values.append(value)
        rng.shuffle(needles)

        if type_haystack == "essay":
            sentences = self._essay_sentences(n)
            positions = self._insert_at_depths(
                len(sentences),
                len(needles),
                depth,
                lambda units, k: sorted(int(units * (d / 100)) for d in rng.sample(DEPTHS, k)),
            )
            positions = [0] + sorted(positions) + [len(sentences)]
            parts = []
            for i in range(1, len(positions)):
                parts.append(" ".join(sentences[positions[i - 1] : positions[i]]))
                if i - 1 < len(needles):
                    parts.append(needles[i - 1])
            context = " ".join(parts)
        else:
            if type_haystack == "noise":
                lines = self._noise_lines(n)
            else:  # "needle": the haystack is distractor needles with random keys and values
                lines = [
                    NEEDLE.format(
                        type_needle_v=type_needle_v,
                        key=self._random_value(rng, type_needle_k),
                        value=self._random_value(rng, type_needle_v),
                    )
                    for _ in range(n)
                ]
            indexes = self._insert_at_depths(
                len(lines),
                len(needles),
                depth,
                lambda units, k: sorted(rng.sample(range(units), k), reverse=True),
            )
            for index, needle in zip(indexes, needles):
                lines.insert(index, needle)
            context = "\n".join(lines)

        indices = rng.sample(range(num_needle_k), num_needle_q)
        queries = [keys[i] for i in indices]
        answers = [a for i in indices for a in values[i]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]

        # RULER rewrites the whole template (answer prefix included) to the singular for one answer.
        template = TEMPLATES["niah"]["template"] + "\x01" + TEMPLATES["niah"]["answer_prefix"]
        if num_needle_q * num_needle_v == 1:
            for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
                template = template.replace(old, new)
            type_needle_v = type_needle_v[:-1]
        template, answer_prefix = template.split("\x01")
        before, after = _split_template(template, type_needle_v=type_needle_v, query=query)
        return Prompt(before + context, after, answer_prefix.format(type_needle_v=type_needle_v, query=query), answers)

    def _chains(self, rng, num_chains: int, num_hops: int, is_icl: bool):
        """RULER's ``generate_chains``: ``num_chains`` chains ``VAR X = value``, ``VAR Y = VAR X ``, ..."""
        k = 3 if is_icl else 5
        names: list[str] = []
        while len(names) < (num_hops + 1) * num_chains:
            name = "".join(rng.choices(string.ascii_uppercase, k=k))
            if name not in names:
                names.append(name)
        variables, chains = [], []
        for i in range(0, len(names), num_hops + 1):
            chain_vars = names[i : i + num_hops + 1]
            variables.append(chain_vars)
            value = "12345" if is_icl else str(rng.randint(10000, 99998))  # np.random.randint(10000, 99999)
            chain = [f"VAR {chain_vars[0]} = {value}"]
            chain += [f"VAR {chain_vars[j + 1]} = VAR {chain_vars[j]} " for j in range(num_hops)]
            chains.append(chain)
        return variables, chains

    def _vt_text(self, rng, n, num_chains, num_hops, is_icl):
        variables, chains = self._chains(rng, num_chains, num_hops, is_icl)
        value = chains[0][0].split("=")[-1].strip()
        sentences = self._noise_lines(n)
        for chain in chains:
            positions = sorted(rng.sample(range(len(sentences)), len(chain)))
            for j, position in enumerate(positions):
                sentences.insert(position + j, chain[j])
        context = "\n".join(sentences).replace(". \n", ".\n")
        t = TEMPLATES["variable_tracking"]
        before, after = _split_template(t["template"], query=value)
        prefix = t["answer_prefix"].format(num_v=num_hops + 1, query=value)
        return Prompt(before + context, after, prefix, variables[0])

    def _vt_example(self, num_chains: int, num_hops: int) -> str:
        """RULER's in-context example for variable tracking: a 500-token sample with its answer.

        Made once per generator (RULER makes it once per dataset) and re-lettered for each sample.
        """
        key = (num_chains, num_hops)
        if key not in self._vt_icl:

            def build(n):
                return self._vt_text(random.Random(f"{self.seed}/vt-icl"), n, num_chains, num_hops, True)

            build.min_units = len(NOISE_SENTENCES) * num_hops + 1
            _, prompt, _ = self._fit(build, 500, 0, None, "vt (in-context example)", 0)
            self._vt_icl[key] = prompt.text + " " + " ".join(prompt.answers) + "\n"
        return self._vt_icl[key]

    def _variable_tracking(self, rng, n, *, type_haystack, num_chains, num_hops, **_):
        if type_haystack != "noise":
            raise ArmkvError("variable tracking is built on the noise haystack only (RULER's vt)")
        example = self._vt_example(num_chains, num_hops)
        # randomize_icl: new letters for the example's variables, a new value
        for name in example.strip().split()[-num_hops - 1 :]:
            example = example.replace(name, "".join(rng.choices(string.ascii_uppercase, k=len(name))))
        example = example.replace("12345", str(rng.randint(10000, 99998)))
        prompt = self._vt_text(rng, n, num_chains, num_hops, False)
        return Prompt(example + "\n" + prompt.context, prompt.question, prompt.answer_prefix, prompt.answers)

    @staticmethod
    def common_words(rng: random.Random, count: int) -> list[str]:
        """``count`` distinct words: RULER's nouns, adjectives and verbs, then ``adjective-noun`` pairs.

        RULER falls back to a larger English word list when its lists run out; the pairs
        play that part here.
        """
        pool = sorted(set(words.NOUNS + words.ADJECTIVES + words.VERBS))
        if count > len(pool):
            pool += [f"{a}-{n}" for a in words.ADJECTIVES for n in words.NOUNS]
        return rng.sample(pool, count)

    def _common_words(self, rng, n, *, freq_cw, freq_ucw, num_cw, length, **_):
        def example(num_words, common_repeats, uncommon_repeats):
            chosen = self.common_words(rng, num_words)
            common, uncommon = chosen[:num_cw], chosen[num_cw:]
            word_list = common * common_repeats + uncommon * uncommon_repeats
            rng.shuffle(word_list)
            return " ".join(f"{i + 1}. {w}" for i, w in enumerate(word_list)), common

        t = TEMPLATES["common_words_extraction"]
        full = t["template"] + t["answer_prefix"]
        if length < 4096:  # RULER's short-context setting: fewer repeats, a smaller example
            shot, shot_answer = example(20, 3, 1)
            context, answers = example(n + num_cw, 6, 1)
        else:
            shot, shot_answer = example(40, 10, 3)
            context, answers = example(n + num_cw, freq_cw, freq_ucw)
        shot_text = (
            full.format(context=shot, num_cw=num_cw, query="")
            + " "
            + " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot_answer))
        )
        before, after = _split_template(t["template"], num_cw=num_cw, query="")
        return Prompt(shot_text + "\n" + before + context, after, t["answer_prefix"], answers)

    def _freq_words(self, rng, n, *, alpha, length, **_):
        t = TEMPLATES["freq_words_extraction"]
        vocab_size = (length - t["tokens_to_generate"]) // 50
        coded: set[str] = set()
        while len(coded) < vocab_size:
            coded.add("".join(rng.choices(string.ascii_lowercase, k=6)))
        vocab = sorted(coded)
        rng.shuffle(vocab)
        vocab[0] = "..."  # the top-ranked word is noise, to be ignored
        z = zeta(alpha)
        sampled = [w for k, w in enumerate(vocab, start=1) for _ in range(int(n * k**-alpha / z))]
        rng.shuffle(sampled)
        before, after = _split_template(t["template"], query="")
        return Prompt(before + " ".join(sampled), after, t["answer_prefix"], vocab[1:4])

    def _qa(self, rng, n, *, dataset, index, **_):
        qas, docs = self.qa[dataset]
        qa = qas[index % len(qas)]
        gold, more = qa["context"], qa.get("more_context", [])
        if n < len(docs):
            if n - len(gold) > len(more):
                taken = set(gold + more)
                others = [i for i in range(len(docs)) if i not in taken]
                chosen = gold + more + rng.sample(others, max(0, n - len(gold) - len(more)))
            else:
                chosen = gold + rng.sample(more, n - len(gold))
            chosen_docs = [docs[i] for i in chosen]
        else:
            chosen_docs = (docs * -(-n // len(docs)))[:n]
        rng.shuffle(chosen_docs)
        context = "\n\n".join(DOCUMENT_PROMPT.format(i=i + 1, document=d) for i, d in enumerate(chosen_docs))
        t = TEMPLATES["qa"]
        before, after = _split_template(t["template"], query=qa["query"])
        return Prompt(before + context, after, t["answer_prefix"], qa["outputs"])


# --------------------------------------------------------------------------- the eval


def check_lengths(lengths: list[int], max_positions: int | None) -> None:
    """Refuse a length the model cannot hold, before anything is generated."""
    if not lengths:
        raise ArmkvError("--lengths is empty: give at least one context length")
    for length in lengths:
        if length < 128:
            raise ArmkvError(f"--lengths {length}: too short for RULER's templates; use 1024 or more")
        if max_positions is not None and length > max_positions:
            raise ArmkvError(
                f"--lengths {length} is beyond the model's limit of {max_positions} positions (max_position_embeddings)"
            )


def plot_by_length(cells: dict, rows: list[str], lengths: list[str], path: Path, title: str) -> Path:
    """Score (mean over tasks) against context length, one line per row, saved to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    markers = "os^Dvx*P"
    for i, row in enumerate(rows):
        points = [(int(length), cells[row][length]) for length in lengths if length in cells.get(row, {})]
        if points:
            # shrinking markers keep rows with equal scores visible on top of each other
            ax.plot(*zip(*points), marker=markers[i % len(markers)], markersize=max(3, 10 - i), label=row)
    ax.set_xscale("log", base=2)
    ax.set_xticks([int(length) for length in lengths], [common.length_label(length) for length in lengths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("score (0-100)")
    ax.set_ylim(-2, 102)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


def evaluate(
    generator: RulerGenerator,
    rows: list[common.Row],
    tasks: list[str],
    lengths: list[int],
    samples: int,
    output: Path,
    runner_factory: common.RunnerFactory,
    *,
    settings: dict,
    depths: list[float] | None = None,
    max_new_tokens: int | None = None,
    budget: int | None = None,
    info=None,
    title: str = "RULER",
    notes: str = "",
    plot: bool = True,
) -> dict:
    """Run RULER for every row, task and length into ``output``; return the summary.

    Samples already in ``output`` are skipped (resume). Writes the per-sample logs,
    ``summary.json``, ``table.md`` (rows x lengths, then rows x tasks) and ``ruler.png``.
    ``info`` (the model's :class:`armkv.methods.base.ModelInfo`) gives the length limit
    and the bytes of the budget. ``max_new_tokens`` caps RULER's per-task generation
    length (the sample lengths still reserve RULER's). ``notes`` is appended to the tables.
    """
    output = Path(output)
    for task in tasks:
        generator.check(task)
    check_lengths(lengths, info.max_positions if info is not None else None)
    common.check_settings(output, settings)

    jobs = []
    for task in tasks:
        for length in lengths:
            pending = any(
                len(common.SampleLog(common.log_path(output, row.label, task, str(length))).done_ids) < samples
                for row in rows
            )
            made = generator.samples(task, length, samples, depths) if pending else []
            if TASKS[task][0] == "niah":
                for sample in made:  # memory methods report how much of the needles' values they hold exactly
                    sample["watch"] = list(sample["answers"])
            jobs.append((task, str(length), made))

    common.score_pending(
        output,
        rows,
        jobs,
        runner_factory,
        score=lambda prediction, sample: metric_of(sample["task"])(prediction, sample["answers"]),
        max_new_tokens=lambda task: min(tokens_to_generate(task), max_new_tokens or 10**9),
        desc=title,
    )

    summary = common.collect_summary(output)
    labels = [row.label for row in rows]
    length_keys = [str(length) for length in lengths]
    caption = common.budget_caption(budget, info, common.measured_bytes(output, labels), common.unbounded(rows))
    per_length = common.by_length(summary, labels, length_keys, tasks)
    per_task = common.by_task(summary, labels, tasks, length_keys)
    tables = [
        f"## Score by context length (mean over tasks: {', '.join(tasks)})\n",
        common.markdown_table(
            {r: {common.length_label(k): v for k, v in c.items()} for r, c in per_length.items()},
            labels,
            [common.length_label(k) for k in length_keys],
            caption,
        ),
        f"## Score by task (mean over lengths {', '.join(common.length_label(k) for k in length_keys)})\n",
        common.markdown_table(per_task, labels, tasks, caption),
    ]
    shares, used = common.memory_cells(output, labels)
    memory_rows = [label for label in labels if label in shares or label in used]
    if memory_rows:
        columns = [common.length_label(k) for k in length_keys]
        relabel = lambda cells: {r: {common.length_label(k): v for k, v in c.items()} for r, c in cells.items()}  # noqa: E731
        tables += [
            "## Memory after the prefill: needle-value tokens still held exactly (%, mean over layers, KV heads, "
            "tasks, samples)\n",
            common.markdown_table(
                relabel(shares),
                memory_rows,
                columns,
                "Per-layer shares are in the sample logs (memory.exact_share_by_layer).",
            ),
            "## Memory after the prefill: slots used (%)\n",
            common.markdown_table(relabel(used), memory_rows, columns, ""),
        ]
    if notes:
        tables.append(notes)
    if plot:
        plot_title = title if budget is None else f"{title}, budget {budget} token-equivalents"
        plot_by_length(per_length, labels, length_keys, output / "ruler.png", plot_title)
    return common.finish(output, summary, title, tables)


# --------------------------------------------------------------------------- command line


def add_arguments(parser) -> None:
    parser.add_argument(
        "--tasks",
        default=",".join(NO_FILE_TASKS),
        help="comma-separated RULER tasks, or 'all' for the 13 "
        "(default: the tasks that need no data file: %(default)s)",
    )
    parser.add_argument(
        "--lengths",
        default="1k,2k,4k,8k",
        help="context lengths in tokens, e.g. 1k,2k,4k or 4096 (default: %(default)s)",
    )
    parser.add_argument(
        "--depths", default=None, help="needle depths in percent, cycled over samples (default: RULER's random depths)"
    )
    parser.add_argument(
        "--haystack-file",
        default=None,
        help="essay haystack for niah_single_2/3, multikey_1, multivalue, multiquery: "
        "a .txt of prose or RULER's PaulGrahamEssays.json",
    )
    parser.add_argument(
        "--haystack",
        choices=("task", "noise", "essay"),
        default="task",
        help="haystack of the needle tasks: each task's own (RULER's), or noise / essay for all of "
        "niah_single_*, multikey_1, multivalue, multiquery (essay needs --haystack-file)",
    )
    parser.add_argument(
        "--qa-file", action="append", default=None, help="SQuAD JSON (qa_1) or HotpotQA JSON (qa_2); repeat for both"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="cap on generated tokens (default: RULER's per task, 30 to 128)",
    )
    common.add_common_arguments(parser, methods="full,swa,sink,kivi,arm", samples=25)
    parser.add_argument(
        "--engine",
        choices=("hf", "vllm"),
        default="hf",
        help="hf: armkv's own loop over transformers; vllm: the same samples through vLLM with armkv's plugin "
        "(methods arm, fifo, full; run from vLLM's environment, docs/serving.md) (default: %(default)s)",
    )


def parse_tasks(text: str) -> list[str]:
    tasks = list(TASKS) if text.strip() == "all" else common.parse_list(text, "tasks")
    for task in tasks:
        if task not in TASKS:
            raise ArmkvError(f"unknown RULER task {task!r}; choose from: {', '.join(TASKS)}")
    return tasks


def prepare(args, tasks: list[str], settings: dict | None = None):
    """Check the tasks' data and lengths (and, where given, the output folder's ``settings``),
    then load the model: ``(generator, lengths, depths, info, model, tokenizer)``; with
    ``--engine vllm`` the model is its folder (vLLM loads it)."""
    lengths = common.parse_list(args.lengths, "lengths", common.parse_length)
    depths = common.parse_list(args.depths, "depths", float) or None
    if args.samples < 1:
        raise ArmkvError(f"--samples {args.samples}: give at least 1 sample per task and length")
    haystack = load_essay(args.haystack_file) if args.haystack_file else None
    qa = load_qa_files(args.qa_file)
    override = None if getattr(args, "haystack", "task") == "task" else args.haystack
    unchecked = RulerGenerator(None, args.seed, haystack, qa, haystack=override)
    for task in tasks:
        unchecked.check(task)
    check_lengths(lengths, None)
    if getattr(args, "engine", "hf") == "vllm":  # vLLM loads the model: here only its tokenizer and shape
        from transformers import AutoTokenizer

        from armkv.tools.preflight import model_info_from_config
        from armkv.tools.vllm_engine import model_folder

        common.check_args(args, settings)
        folder = model_folder(args.model)
        model, tokenizer = folder, AutoTokenizer.from_pretrained(folder, local_files_only=True)
        info, _ = model_info_from_config(folder)
    else:
        model, tokenizer, info = common.load(args, settings)
    extra = chat_template_tokens(tokenizer) if args.chat else 0
    generator = RulerGenerator(tokenizer, args.seed, haystack, qa, extra, haystack=override)
    return generator, lengths, depths, info, model, tokenizer


def chat_template_tokens(tokenizer) -> int:
    """Tokens a chat template wraps around an empty user turn (RULER's ``model_template_token``)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=True, tokenize=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


def main(args) -> int:
    tasks = parse_tasks(args.tasks)
    rows = common.method_rows(args.methods, common.method_options(args))
    extra = {"engine": "vllm"} if args.engine == "vllm" else {}  # (a folder's samples come from one engine)
    if args.engine == "vllm":
        from armkv.tools.vllm_engine import check_served, require_vllm

        check_served([row.method for row in rows], args.compile)
        require_vllm("eval ruler")
    settings = common.settings_of(
        args,
        "ruler",
        depths=common.parse_list(args.depths, "depths", float) or None,
        max_new_tokens=args.max_new_tokens,
        haystack=(None if getattr(args, "haystack", "task") == "task" else args.haystack) or "task",
        **extra,
    )
    generator, lengths, depths, info, model, tokenizer = prepare(args, tasks, settings)
    if args.engine == "vllm":
        from armkv.tools import vllm_engine

        # the engine takes what the model takes, as the HF path does (each request is checked against it)
        factory = vllm_engine.runner_factory(
            model, tokenizer, budget=args.budget, chunk=args.chunk, chat=args.chat, max_model_len=info.max_positions
        )
    else:
        factory = common.runner_factory(
            model, tokenizer, budget=args.budget, chunk=args.chunk, chat=args.chat, compile=args.compile
        )
    evaluate(
        generator,
        rows,
        tasks,
        lengths,
        args.samples,
        args.output,
        factory,
        settings=settings,
        depths=depths,
        max_new_tokens=args.max_new_tokens,
        budget=args.budget,
        info=info,
    )
    return 0
