"""The read's public surface: code outside ``memory/`` and ``methods/arm.py`` (benchmarks, evals,
scripts, the CLI) reaches an ARM layer's reads only through public names (``layer.reader``,
``Reader.read`` / ``dense`` / ``masked`` / ``hooks`` ...), never a private member of
``ARMLayer``, ``Reader`` or ``ReadView``; and the reader's hooks always come off."""

import ast
from pathlib import Path

import pytest
import torch

from armkv.hf.attach import make_cache
from armkv.memory.reader import PATHS, Ask, pick_path
from conftest import tiny_model

ROOT = Path(__file__).resolve().parents[1]
OWNERS = {  # file: the classes whose private names it defines
    "src/armkv/methods/arm.py": ("ARMLayer",),
    "src/armkv/memory/reader.py": ("Reader", "ReadView"),
}
ALLOWED = ("src/armkv/memory/", "src/armkv/methods/arm.py")


def _private_names() -> set[str]:
    """Every private member the owning classes define: their methods and ``self._x`` attributes."""
    names = set()
    for path, classes in OWNERS.items():
        tree = ast.parse((ROOT / path).read_text())
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in classes):
            for node in ast.walk(cls):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("_"):
                    names.add(node.name)
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "self"
                ):
                    names.add(node.attr)
            for node in cls.body:  # (__slots__ and class attributes)
                if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Tuple, ast.List)):
                    names.update(e.value for e in node.value.elts if isinstance(e, ast.Constant))
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _uses(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of each ``x._name`` and each getattr / setattr / delattr / hasattr /
    monkeypatch.setattr with a string ``"_name"``, for the given names."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in names:
            found.append((node.lineno, node.attr))
        if isinstance(node, ast.Call):
            found += [
                (node.lineno, a.value)
                for a in node.args
                if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value in names
            ]
    return found


def test_the_scan_finds_private_names():
    names = _private_names()
    assert {"_flush", "_decide_m", "_held", "_view", "_take"} <= names
    source = "layer._flush()\nx = layer.reader._view\nsetattr(layer.reader, '_held', None)\nlayer.reader.read(1)\n"
    assert sorted(_uses(source, names)) == [(1, "_flush"), (2, "_view"), (3, "_held")]


def test_no_private_reader_or_layer_names_outside_the_read():
    names = _private_names()
    bad = []
    for folder in ("src", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(ALLOWED):
                continue
            bad += [f"{rel}:{line}: .{name}" for line, name in _uses(path.read_text(), names)]
    assert not bad, "private ARMLayer / Reader names used outside memory/ and methods/arm.py:\n" + "\n".join(bad)


def test_the_path_table_picks_each_path():
    """The first row whose rule holds: one token reading every bucket (stored positions) the
    dense read; at M < N_b one token the sparse read, a short tree-ranked chunk too; a chunk
    ranked by its logits the ranked read; everything else the masked read."""
    assert [name for name, _ in PATHS] == ["dense", "sparse", "ranked", "masked"]
    ask = dict(one=True, short=True, every=True, top_m=False, stored=True, rank="best", summarised=False)
    assert pick_path(Ask(**ask)) == "dense"
    assert pick_path(Ask(**{**ask, "stored": False})) == "masked"
    top = {**ask, "every": False, "top_m": True}
    assert pick_path(Ask(**top)) == "sparse"
    assert pick_path(Ask(**{**top, "summarised": True})) == "sparse"
    assert pick_path(Ask(**{**top, "one": False})) == "ranked"
    assert pick_path(Ask(**{**top, "one": False, "short": False})) == "ranked"
    assert pick_path(Ask(**{**top, "one": False, "summarised": True})) == "ranked"
    assert pick_path(Ask(**{**top, "one": False, "rank": "tree"})) == "sparse"
    assert pick_path(Ask(**{**top, "one": False, "rank": "tree", "summarised": True})) == "masked"
    assert pick_path(Ask(**{**top, "one": False, "short": False, "rank": "tree"})) == "masked"
    assert pick_path(Ask(**{**ask, "every": False})) == "masked"  # (training, or M = N_b per row)


def test_reader_hooks_wrap_the_reads_and_always_come_off():
    model = tiny_model("llama")
    ids = torch.randint(0, 100, (1, 80), generator=torch.Generator().manual_seed(0))
    cache = make_cache(model, "arm", budget=96, chunk=16, adapter="random")
    reader = cache.layers[0].reader
    seen = []

    def counting(read):
        return lambda *a, **k: seen.append(a[0].shape[2]) or read(*a, **k)

    with torch.no_grad():
        model(ids[:, :64], past_key_values=cache, use_cache=True)
        with reader.hooks(read=counting, dense=counting):
            model(ids[:, 64:65], past_key_values=cache, use_cache=True)
        assert seen == [1, 1]  # (the read, and the dense read it made)
        assert "read" not in vars(reader) and "dense" not in vars(reader)
        with pytest.raises(RuntimeError, match="boom"), reader.hooks(read=lambda read: read):
            raise RuntimeError("boom")
        assert "read" not in vars(reader)
        model(ids[:, 65:66], past_key_values=cache, use_cache=True)
        assert seen == [1, 1]
        # a step whose dense call is bound (kept from the last step) still goes through a dense hook
        with reader.hooks(dense=counting):
            model(ids[:, 66:67], past_key_values=cache, use_cache=True)
    assert seen == [1, 1, 1]
    with pytest.raises(ValueError, match="wraps read and dense"), reader.hooks(write=lambda f: f):
        pass
