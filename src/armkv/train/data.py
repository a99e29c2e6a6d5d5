"""Text for training and calibration: documents from a source, tokenised and packed.

A source yields documents (strings) in a deterministic order per epoch. ``PackedSequences``
tokenises them, appends EOS after each document and cuts the token stream into
fixed-length sequences. Its position ``{"epoch", "doc", "offset"}`` names the first token
of the next sequence, so a saved position restores the stream at exactly that sequence.

Sources:
- local files: ``.txt`` (a file is one document), ``.jsonl`` (one JSON object per line,
  the document in ``text_column``), ``.parquet`` (column ``text_column``); a directory
  means every such file in it, sorted by name. Read into memory and shuffled per epoch.
- Hugging Face ``datasets`` by name, streamed (``datasets`` is imported only then).
- the offline default corpus (:func:`default_corpus`): English Wikipedia articles and
  news stories shipped as test data inside the PyPI package ``gensim``. Its held-out
  split as a text file: ``python -m armkv.train.data heldout heldout.txt``.
"""

from __future__ import annotations

import bz2
import hashlib
import html
import importlib.util
import itertools
import json
import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from armkv.errors import ArmkvError

LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")

# The default corpus lives in gensim's wheel (gensim 4.x, ``pip install --no-deps gensim``:
# we read two data files and never import gensim). Both are real English prose:
# - a shortened dump of English Wikipedia (the first articles by page id, April 2016,
#   CC BY-SA): 106 articles after dropping redirects, about 2.9 M characters of text
#   once the wiki markup is stripped (about 450 k words);
# - the Lee corpus background set: 300 Australian news stories (about 60 k words).
# With the SmolLM2 tokenizer: 672 k training tokens (96 articles + 300 stories) and
# 54 k held-out tokens (10 articles). Less than a million tokens: enough for short
# adaptation runs and a perplexity check; longer runs should point --dataset at a
# real corpus (e.g. FineWeb-Edu).
DEFAULT_CORPUS_FILES = (
    "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2",
    "test/test_data/lee_background.cor",
)
# Every HELDOUT_EVERY-th Wikipedia article (by page order) is held out for perplexity
# evaluation and never yielded to training: Academy Award for Best Production Design,
# List of Atlas Shrugged characters, Andre Agassi, Aldous Huxley, America the Beautiful,
# A Modest Proposal, Aardwolf, Angola, List of anthropologists, Art. The news stories
# are all training text.
HELDOUT_EVERY = 10


def _gensim_dir() -> Path:
    """The installed gensim package directory, found without importing gensim."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise ArmkvError(
            "the default training corpus ships inside the PyPI package gensim: "
            "run `pip install --no-deps gensim`, or pass --data FILE or --dataset NAME"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _drop_nested(text: str, open_: str, close: str) -> str:
    """Remove every (possibly nested) ``open_ ... close`` span, e.g. wiki templates."""
    out, depth, start = [], 0, 0
    for m in re.finditer(f"{re.escape(open_)}|{re.escape(close)}", text):
        if m.group() == open_:
            if depth == 0:
                out.append(text[start : m.start()])
            depth += 1
        elif depth:
            depth -= 1
            if depth == 0:
                start = m.end()
    if depth == 0:
        out.append(text[start:])
    return "".join(out)


def strip_wiki_markup(text: str) -> str:
    """Plain prose from MediaWiki source: templates, tables, references, files and
    categories removed; links replaced by their label; headings kept as lines."""
    text = html.unescape(text)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"<ref[^>/]*/>", "", text)
    text = re.sub(r"<ref[^>]*>.*?</ref>", "", text, flags=re.S)
    text = _drop_nested(text, "{{", "}}")
    text = _drop_nested(text, "{|", "|}")
    # File/Image/Category and interlanguage links may hold nested links in their captions.
    text = re.sub(r"\[\[(?:File|Image|Category|[a-z\-]{2,12}):[^\[\]]*(?:\[\[[^\]]*\]\][^\[\]]*)*\]\]", "", text)
    text = re.sub(r"\[\[(?:[^|\]]*\|)?([^\]]*)\]\]", r"\1", text)
    text = re.sub(r"\[https?://\S+ ([^\]]*)\]", r"\1", text)
    text = re.sub(r"\[https?://\S+\]", "", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"'{2,}", "", text)
    text = re.sub(r"^=+\s*(.*?)\s*=+\s*$", r"\1", text, flags=re.M)
    text = re.sub(r"^[*#:;]+\s*", "", text, flags=re.M)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def default_corpus(split: str = "train") -> list[str]:
    """The offline default corpus: real English prose from the gensim package.

    Parameters
    ----------
    split : "train" or "heldout"
        ``"heldout"`` is every ``HELDOUT_EVERY``-th Wikipedia article (about 10% of
        them); ``"train"`` is the other articles plus the news stories. The two never
        overlap, so perplexity on ``"heldout"`` is on text training did not see.

    Returns
    -------
    list[str]
        Documents in a fixed order (shuffling is the packer's job).
    """
    if split not in ("train", "heldout"):
        raise ArmkvError(f"default corpus split {split!r}: use 'train' or 'heldout'")
    root = _gensim_dir()
    wiki_path, news_path = (root / f for f in DEFAULT_CORPUS_FILES)
    for path in (wiki_path, news_path):
        if not path.is_file():
            raise ArmkvError(f"{path} is missing: reinstall gensim 4.x (`pip install --no-deps gensim`)")
    xml = bz2.decompress(wiki_path.read_bytes()).decode("utf-8")
    articles = []
    for page in re.findall(r"<page>.*?</page>", xml, flags=re.S):
        body = re.search(r"<text[^>]*>(.*?)</text>", page, flags=re.S)
        source = body.group(1) if body else ""
        if source.lstrip().upper().startswith("#REDIRECT"):
            continue
        prose = strip_wiki_markup(source)
        if prose:
            articles.append(prose)
    heldout = [a for i, a in enumerate(articles) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    if split == "heldout":
        return heldout
    train = [a for i, a in enumerate(articles) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    news = [line.strip() for line in news_path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return train + news


def _local_files(path: Path) -> list[Path]:
    if not path.exists():
        raise ArmkvError(f"data path {path} does not exist")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in LOCAL_SUFFIXES)
        if not files:
            raise ArmkvError(f"data directory {path} holds no {', '.join(LOCAL_SUFFIXES)} files")
        return files
    if path.suffix not in LOCAL_SUFFIXES:
        raise ArmkvError(f"data file {path}: use a {', '.join(LOCAL_SUFFIXES)} file or a directory of them")
    return [path]


def read_local_documents(path: str | Path, text_column: str = "text") -> list[str]:
    """Documents from a local file or directory (see the module docstring for formats).

    Raises
    ------
    ArmkvError
        The path does not exist, a record lacks ``text_column``, or nothing was read.
    """
    docs: list[str] = []
    for file in _local_files(Path(path)):
        if file.suffix == ".txt":
            docs.append(file.read_text(encoding="utf-8"))
        elif file.suffix == ".jsonl":
            with file.open(encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ArmkvError(f"{file} line {lineno} is not JSON: {e.msg}") from None
                    if not isinstance(record, dict) or text_column not in record:
                        keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
                        raise ArmkvError(
                            f"{file} line {lineno} has no {text_column!r} column (it has: {keys}); pass --text-column"
                        )
                    docs.append(str(record[text_column]))
        else:
            import pyarrow.parquet as pq

            names = pq.read_schema(file).names
            if text_column not in names:
                raise ArmkvError(
                    f"{file} has no {text_column!r} column (it has: {', '.join(names)}); pass --text-column"
                )
            docs.extend(str(t) for t in pq.read_table(file, columns=[text_column]).column(text_column).to_pylist())
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise ArmkvError(f"no non-empty documents in {path}")
    return docs


class DocumentSource:
    """Documents in a deterministic order per epoch.

    Either an in-memory list (shuffled per epoch with ``seed + epoch`` when ``shuffle``)
    or a Hugging Face dataset streamed by name (shuffled by ``datasets``' buffer with the
    same seed). ``iter_epoch(epoch, start)`` skips the first ``start`` documents, which
    is how a saved position resumes.
    """

    def __init__(
        self,
        documents: list[str] | None = None,
        *,
        dataset: str | None = None,
        dataset_config: str | None = None,
        split: str = "train",
        text_column: str = "text",
        data_files: str | None = None,
        seed: int = 0,
        shuffle: bool = True,
        shuffle_buffer: int = 10_000,
    ):
        if (documents is None) == (dataset is None):
            raise ArmkvError("give either documents or a dataset name")
        if documents is not None and not documents:
            raise ArmkvError("the document list is empty")
        self.documents = documents
        self.dataset, self.dataset_config, self.split = dataset, dataset_config, split
        self.text_column, self.data_files = text_column, data_files
        self.seed, self.shuffle, self.shuffle_buffer = seed, shuffle, shuffle_buffer
        self._digest = None  # content hash of the documents, computed on first describe()

    def describe(self) -> dict:
        """What identifies this stream, stored beside a saved position and checked on resume."""
        if self.documents is not None:
            if self._digest is None:
                h = hashlib.sha256()
                for doc in self.documents:
                    h.update(doc.encode("utf-8", "replace") + b"\0")
                self._digest = h.hexdigest()[:16]
            return {
                "kind": "list",
                "num_docs": len(self.documents),
                "sha256": self._digest,
                "seed": self.seed,
                "shuffle": self.shuffle,
            }
        return {
            "kind": "hf",
            "dataset": self.dataset,
            "config": self.dataset_config,
            "split": self.split,
            "text_column": self.text_column,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def iter_epoch(self, epoch: int, start: int = 0) -> Iterator[str]:
        if self.documents is not None:
            order = list(range(len(self.documents)))
            if self.shuffle:
                random.Random(self.seed + epoch).shuffle(order)
            return (self.documents[i] for i in order[start:])
        # Resuming a stream re-reads (without tokenising) the documents before the
        # position: exact under the seeded shuffle buffer, at the cost of a re-read.
        return itertools.islice(self._stream(epoch), start, None)

    def _stream(self, epoch: int) -> Iterator[str]:
        try:
            import datasets
        except ImportError:
            raise ArmkvError("--dataset needs the `datasets` package: pip install datasets") from None
        try:
            ds = datasets.load_dataset(
                self.dataset, self.dataset_config, split=self.split, streaming=True, data_files=self.data_files
            )
        except (FileNotFoundError, ValueError) as e:
            raise ArmkvError(f"dataset {self.dataset!r}: {str(e).splitlines()[0]}") from None
        if self.shuffle:
            ds = ds.shuffle(seed=self.seed + epoch, buffer_size=self.shuffle_buffer)
        for record in ds:
            if self.text_column not in record:
                raise ArmkvError(
                    f"dataset {self.dataset!r} has no {self.text_column!r} column (it has: {', '.join(record)}); "
                    "pass --text-column"
                )
            text = record[self.text_column]
            if text and text.strip():
                yield text


class PackedSequences:
    """Documents tokenised, joined with EOS and cut into sequences of ``seq_len`` tokens.

    Sequence n is tokens ``[n * seq_len, (n + 1) * seq_len)`` of the stream
    ``doc_0 EOS doc_1 EOS ...`` (documents in the epoch's order; when a pass ends the
    next epoch's order continues the same stream). A sequence may span documents.

    Parameters
    ----------
    source : DocumentSource
    tokenize : callable str -> list[int]
        Without special tokens, e.g. ``lambda s: tok(s, add_special_tokens=False)["input_ids"]``.
    eos_id : int
        Appended after every document.
    seq_len : int
    max_epochs : int or None
        Stop after this many passes (None: repeat forever).
    """

    def __init__(
        self,
        source: DocumentSource,
        tokenize: Callable[[str], list[int]],
        eos_id: int,
        seq_len: int,
        max_epochs: int | None = None,
    ):
        if seq_len < 2:
            raise ArmkvError(f"seq_len={seq_len}: a training sequence needs at least 2 tokens")
        self.source, self.tokenize, self.eos_id, self.seq_len = source, tokenize, eos_id, seq_len
        self.max_epochs = max_epochs
        self.epoch = 0  # pass over the documents the next token comes from
        self.doc = 0  # index of that document within the epoch's order
        self.offset = 0  # index of the next token within that document's tokens (EOS included)
        self.sequences = 0  # sequences yielded so far (informative)
        self._docs: Iterator[str] | None = None  # the epoch's documents from self.doc on
        self._tokens: list[int] | None = None  # tokens of document self.doc, EOS appended

    def state_dict(self) -> dict:
        """The position of the next sequence; JSON-serialisable."""
        return {
            "epoch": self.epoch,
            "doc": self.doc,
            "offset": self.offset,
            "sequences": self.sequences,
            "seq_len": self.seq_len,
            "source": self.source.describe(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue at the saved position. The source and seq_len must match the saved ones."""
        if state.get("seq_len") != self.seq_len or state.get("source") != self.source.describe():
            raise ArmkvError(
                f"the saved data position is for {state.get('source')} at seq_len={state.get('seq_len')}, "
                f"not this data ({self.source.describe()}, seq_len={self.seq_len})"
            )
        self.epoch, self.doc, self.offset = int(state["epoch"]), int(state["doc"]), int(state["offset"])
        self.sequences = int(state.get("sequences", 0))
        self._docs, self._tokens = None, None

    def _current_tokens(self) -> list[int] | None:
        """Tokens of the document at the position, opening epochs as needed; None at the end."""
        if self._tokens is not None:
            return self._tokens
        empty_epochs = 0
        while True:
            if self.max_epochs is not None and self.epoch >= self.max_epochs:
                return None
            if self._docs is None:
                self._docs = self.source.iter_epoch(self.epoch, self.doc)
            text = next(self._docs, None)
            if text is not None:
                self._tokens = list(self.tokenize(text)) + [self.eos_id]
                return self._tokens
            if self.doc == 0:
                empty_epochs += 1
                if empty_epochs > 1:
                    raise ArmkvError("the data source yielded no documents")
            self.epoch, self.doc, self.offset, self._docs = self.epoch + 1, 0, 0, None

    def next_sequence(self) -> torch.Tensor | None:
        """The next sequence, LongTensor [seq_len], or None once max_epochs is exhausted."""
        out: list[int] = []
        while len(out) < self.seq_len:
            tokens = self._current_tokens()
            if tokens is None:
                return None
            take = tokens[self.offset : self.offset + self.seq_len - len(out)]
            out.extend(take)
            self.offset += len(take)
            if self.offset >= len(tokens):
                self.doc, self.offset, self._tokens = self.doc + 1, 0, None
        self.sequences += 1
        return torch.tensor(out, dtype=torch.long)

    def __iter__(self) -> Iterator[torch.Tensor]:
        while (seq := self.next_sequence()) is not None:
            yield seq

    def next_step_batch(
        self, micro_batch: int, accum: int, rank: int = 0, world_size: int = 1
    ) -> list[torch.Tensor] | None:
        """This rank's micro-batches for one optimizer step.

        The step consumes ``world_size * accum * micro_batch`` consecutive sequences, cut
        into micro-batches of ``micro_batch`` sequences; rank r keeps micro-batches
        r, r + world_size, ... . So every rank reads a disjoint shard, the union is the
        same global batch a single process with ``accum * world_size`` accumulation steps
        reads, and the position after the step is the same on every rank. (Every rank
        tokenises the whole step's text; cheap next to a forward pass of the model.)

        Returns
        -------
        list of LongTensor [micro_batch, seq_len], ``accum`` of them; None when the data
        ran out before the step was complete.
        """
        mine: list[torch.Tensor] = []
        for unit in range(world_size * accum):
            seqs = [self.next_sequence() for _ in range(micro_batch)]
            if any(s is None for s in seqs):
                return None
            if unit % world_size == rank:
                mine.append(torch.stack(seqs))
        return mine


def make_source(
    data: str | None = None,
    dataset: str | None = None,
    *,
    dataset_config: str | None = None,
    split: str = "train",
    text_column: str = "text",
    seed: int = 0,
    shuffle: bool = True,
) -> DocumentSource:
    """The source the CLI flags name: ``--data PATH``, ``--dataset NAME`` or (neither) the
    default corpus's training split."""
    if data and dataset:
        raise ArmkvError("pass --data (local files) or --dataset (Hugging Face), not both")
    if dataset:
        return DocumentSource(
            dataset=dataset,
            dataset_config=dataset_config,
            split=split,
            text_column=text_column,
            seed=seed,
            shuffle=shuffle,
        )
    docs = read_local_documents(data, text_column) if data else default_corpus("train")
    return DocumentSource(docs, seed=seed, shuffle=shuffle)


def hf_tokenize(tokenizer) -> Callable[[str], list[int]]:
    """A ``tokenize`` callable from a Hugging Face tokenizer (no BOS/EOS added: the packer adds EOS)."""
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


def write_default_corpus(split: str, path: str | Path) -> Path:
    """Write a split of the default corpus as one text file (documents separated by a
    blank line), e.g. the held-out split for ``armkv eval ppl --input FILE``."""
    path = Path(path)
    path.write_text("\n\n".join(default_corpus(split)) + "\n", encoding="utf-8")
    return path


def add_data_arguments(parser) -> None:
    """The data flags shared by ``armkv train`` and ``armkv calibrate``."""
    g = parser.add_argument_group("data (default: the offline corpus, see armkv.train.data)")
    g.add_argument("--data", metavar="PATH", help="local .txt/.jsonl/.parquet file, or a directory of them")
    g.add_argument(
        "--dataset", metavar="NAME", help="Hugging Face dataset name, streamed (e.g. HuggingFaceFW/fineweb-edu)"
    )
    g.add_argument("--dataset-config", metavar="C", help="dataset configuration (e.g. sample-10BT)")
    g.add_argument("--split", default="train", help="dataset split (default: train)")
    g.add_argument("--text-column", default="text", help="column holding the text (default: text)")


def source_from_args(args, seed: int) -> DocumentSource:
    return make_source(
        args.data,
        args.dataset,
        dataset_config=args.dataset_config,
        split=args.split,
        text_column=args.text_column,
        seed=seed,
    )


if __name__ == "__main__":
    import argparse

    cli = argparse.ArgumentParser(description="write a split of the default corpus to a text file")
    cli.add_argument("split", choices=("train", "heldout"))
    cli.add_argument("out")
    a = cli.parse_args()
    print(write_default_corpus(a.split, a.out))
