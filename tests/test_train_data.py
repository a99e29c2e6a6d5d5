"""train/data.py: packing, deterministic order, exact resume, sharding, local formats, errors."""

import importlib.util
import json

import pytest
import torch

from armkv.errors import ArmkvError
from armkv.train.data import DocumentSource, PackedSequences, default_corpus, make_source, read_local_documents

EOS = 256


def byte_tokens(text: str) -> list[int]:
    return list(text.encode())


def packer(docs, seq_len=16, seed=0, **kw):
    return PackedSequences(DocumentSource(docs, seed=seed), byte_tokens, EOS, seq_len, **kw)


DOCS = [f"document number {i} " + "x" * (i % 7) for i in range(23)]


def test_packing_joins_documents_with_eos_and_cuts_fixed_lengths():
    docs = ["abc", "defgh", "ij"]
    seqs = list(PackedSequences(DocumentSource(docs, shuffle=False), byte_tokens, EOS, 4, max_epochs=1))
    stream = [t for d in docs for t in byte_tokens(d) + [EOS]]
    assert all(s.shape == (4,) for s in seqs)
    assert torch.cat(seqs).tolist() == stream[: len(seqs) * 4]
    assert len(seqs) == len(stream) // 4  # the incomplete tail is not yielded


def test_order_is_deterministic_given_the_seed():
    a = [s.tolist() for s in packer(DOCS, seed=3, max_epochs=2)]
    b = [s.tolist() for s in packer(DOCS, seed=3, max_epochs=2)]
    c = [s.tolist() for s in packer(DOCS, seed=4, max_epochs=2)]
    assert a == b and a != c
    # The second epoch is another order of the same documents.
    one_epoch = len(list(packer(DOCS, seed=3, max_epochs=1)))
    assert a[:one_epoch] != a[one_epoch : 2 * one_epoch]


@pytest.mark.parametrize("stop", [1, 5, 17, 30])
def test_saved_position_resumes_at_exactly_the_next_sequence(stop):
    full = [s.tolist() for s in packer(DOCS, seed=1, max_epochs=3)]
    first = packer(DOCS, seed=1, max_epochs=3)
    for _ in range(stop):
        first.next_sequence()
    state = json.loads(json.dumps(first.state_dict()))  # survives JSON, as in a checkpoint
    assert set(state) >= {"epoch", "doc", "offset"}
    resumed = packer(DOCS, seed=1, max_epochs=3)
    resumed.load_state_dict(state)
    assert [s.tolist() for s in resumed] == full[stop:]


def test_position_from_other_data_is_refused():
    state = packer(DOCS, seq_len=16).state_dict()
    with pytest.raises(ArmkvError, match="seq_len"):
        packer(DOCS, seq_len=32).load_state_dict(state)
    with pytest.raises(ArmkvError):
        packer(DOCS[:5], seq_len=16).load_state_dict(state)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_read_disjoint_shards_of_the_single_process_batch(world):
    micro, accum = 2, 2
    single = packer(DOCS, seq_len=8).next_step_batch(micro, accum * world)
    shards = []
    for rank in range(world):
        p = packer(DOCS, seq_len=8)
        shards.append(p.next_step_batch(micro, accum, rank, world))
        assert p.state_dict() == packer_after(world * accum * micro)
    flat_single = sorted(tuple(s.tolist()) for mb in single for s in mb)
    flat_shards = [tuple(s.tolist()) for shard in shards for mb in shard for s in mb]
    assert sorted(flat_shards) == flat_single
    # Micro-batches are the same units as the single process's, interleaved over ranks.
    assert all(torch.equal(shards[u % world][u // world], single[u]) for u in range(world * accum))


def packer_after(n):
    p = packer(DOCS, seq_len=8)
    for _ in range(n):
        p.next_sequence()
    return p.state_dict()


def test_local_formats(tmp_path):
    (tmp_path / "a.txt").write_text("plain text document")
    (tmp_path / "b.jsonl").write_text(
        json.dumps({"text": "first"}) + "\n\n" + json.dumps({"text": "second", "id": 2}) + "\n"
    )
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["third", "fourth"]}), tmp_path / "c.parquet")
    (tmp_path / "ignored.csv").write_text("x")
    assert read_local_documents(tmp_path) == ["plain text document", "first", "second", "third", "fourth"]
    assert read_local_documents(tmp_path / "b.jsonl") == ["first", "second"]


def test_bad_input_is_one_line_error(tmp_path):
    with pytest.raises(ArmkvError, match="does not exist"):
        make_source(str(tmp_path / "nope.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(ArmkvError, match="no 'text' column") as e:
        read_local_documents(bad)
    assert "\n" not in str(e.value)
    assert read_local_documents(bad, text_column="content") == ["x"]
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["y"]}), tmp_path / "p.parquet")
    with pytest.raises(ArmkvError, match="no 'text' column"):
        read_local_documents(tmp_path / "p.parquet")
    with pytest.raises(ArmkvError, match="not both"):
        make_source("x", "y")


def test_hf_dataset_streams_a_local_json_file(tmp_path):
    pytest.importorskip("datasets")
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"body": f"doc {i}"}) + "\n" for i in range(5)))
    src = DocumentSource(dataset="json", data_files=str(path), text_column="body", shuffle=False)
    assert list(src.iter_epoch(0)) == [f"doc {i}" for i in range(5)]
    assert list(src.iter_epoch(0, start=3)) == ["doc 3", "doc 4"]
    with pytest.raises(ArmkvError, match="no 'text' column"):
        list(DocumentSource(dataset="json", data_files=str(path), shuffle=False).iter_epoch(0))


@pytest.mark.skipif(
    importlib.util.find_spec("gensim") is None, reason="default corpus needs `pip install --no-deps gensim`"
)
def test_default_corpus_is_prose_with_a_disjoint_heldout_split():
    train, heldout = default_corpus("train"), default_corpus("heldout")
    assert len(heldout) == 10 and len(train) > 300
    assert not set(train) & set(heldout)
    assert sum(len(d) for d in train) > 2_500_000
    text = " ".join(heldout)
    assert "{{" not in text and "[[" not in text and "<ref" not in text
    assert text.count(" the ") > 1000  # English prose


@pytest.mark.skipif(
    importlib.util.find_spec("gensim") is None, reason="default corpus needs `pip install --no-deps gensim`"
)
def test_heldout_split_exports_as_text(tmp_path):
    from armkv.train.data import write_default_corpus

    text = write_default_corpus("heldout", tmp_path / "heldout.txt").read_text()
    assert text.split("\n\n")[0] == default_corpus("heldout")[0].split("\n\n")[0]


def test_position_from_edited_documents_is_refused():
    state = packer(DOCS).state_dict()
    with pytest.raises(ArmkvError, match="saved data position"):
        packer(DOCS[:-1] + ["edited"]).load_state_dict(state)
