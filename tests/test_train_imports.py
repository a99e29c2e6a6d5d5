"""The training tools import their heavy dependencies only when used, and the library core
never imports them."""

from conftest import modules_after


def test_core_does_not_import_train():
    assert not {m for m in modules_after("import armkv") if m.startswith("armkv.train")}


def test_train_modules_import_no_heavy_dependency():
    loaded = modules_after("import armkv.train.cli, armkv.train.calibrate, armkv.train.data, armkv.train.trainer")
    assert not loaded & {"datasets", "matplotlib", "pyarrow", "transformers", "gensim", "peft"}


def test_no_import_cycle_among_the_train_modules():
    """Imports inside functions count too: a cycle there breaks as soon as one of them moves
    to the top of its module."""
    import ast
    from pathlib import Path

    import armkv

    root = Path(armkv.__file__).parent
    graph = {}
    for path in sorted((root / "train").glob("*.py")):
        name = f"armkv.train.{path.stem}"
        graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("armkv.train"):
                if node.module == "armkv.train":
                    graph[name] |= {f"armkv.train.{a.name}" for a in node.names}
                else:
                    graph[name].add(node.module)
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name.startswith("armkv.train.")}

    def cycle_from(start, node, seen):
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                return [*seen, nxt]
            if nxt not in seen:
                found = cycle_from(start, nxt, [*seen, nxt])
                if found:
                    return found
        return None

    cycles = [c for m in graph if (c := cycle_from(m, m, [m]))]
    assert not cycles, " -> ".join(cycles[0])
