"""One option grammar and one adapter flag in every tool: ``--option METHOD.KEY=VALUE`` and
``--adapter``; a typo in a key is named with the keys the method takes; budget checks come
before any model loads."""

import pytest

import armkv.hf.model
from armkv.cli import main
from armkv.errors import ArmkvError
from armkv.options import options_for, parse_options, with_adapter


def test_options_for_one_method():
    assert options_for("kivi", ["kivi.bits=4", "kivi.group=16"]) == {"bits": 4, "group": 16}
    assert options_for("arm", ["arm.slot_format=int8"], "random") == {"slot_format": "int8", "adapter": "random"}
    with pytest.raises(ArmkvError, match="this run's method is 'kivi', not 'arm'"):
        options_for("kivi", ["arm.sync=4"])
    with pytest.raises(ArmkvError, match="expected METHOD.KEY=VALUE"):
        options_for("kivi", ["bits=4"])
    with pytest.raises(ArmkvError, match="--adapter applies to the arm and fifo methods, not 'sink'"):
        options_for("sink", [], "random")
    with pytest.raises(ArmkvError, match="give the adapter once"):
        options_for("arm", ["arm.adapter=random"], "calibrated")


def test_with_adapter_goes_to_the_methods_that_take_one():
    got = with_adapter(parse_options(["kivi.bits=2"]), "random", ["full", "kivi", "arm", "fifo"])
    assert got == {"kivi": {"bits": 2}, "arm": {"adapter": "random"}, "fifo": {"adapter": "random"}}
    assert with_adapter({}, None, ["arm"]) == {}


def test_eval_and_bench_take_adapter_like_option():
    from armkv.bench.decode import bench_from_args
    from armkv.cli import build_parser
    from armkv.evals import common

    parser = build_parser()
    a = parser.parse_args(["eval", "ruler", "--output", "x", "--methods", "full,arm", "--adapter", "random"])
    b = parser.parse_args(["eval", "ruler", "--output", "x", "--methods", "full,arm", "--option", "arm.adapter=random"])
    assert common.method_options(a) == common.method_options(b) == {"arm": {"adapter": "random"}}
    c = parser.parse_args(["eval", "ablation", "--output", "x", "--adapter", "random"])
    assert common.method_options(c) == {"arm": {"adapter": "random"}}
    d = parser.parse_args(["bench", "decode", "--methods", "sink,arm", "--adapter", "random"])
    assert bench_from_args(d).options == {"arm": {"adapter": "random"}}


def test_arm_option_typo_is_named_as_a_typo():
    from armkv.methods.arm import resolve_arm
    from armkv.methods.base import ModelInfo

    info = ModelInfo(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_positions=1024)
    with pytest.raises(ArmkvError, match="arm has no option slot_formt; its options: .*slot_format"):
        resolve_arm(info, 256, "random", overrides={"slot_formt": "int8"})
    with pytest.raises(ArmkvError, match="change the adapter's parameters"):
        resolve_arm(info, 256, "random", overrides={"depth": 2})


def test_fixed_m_may_be_a_share_of_the_buckets():
    from armkv.methods.arm import resolve_arm
    from armkv.methods.base import ModelInfo

    info = ModelInfo(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_positions=1024)
    num_buckets = resolve_arm(info, 256, "random")[1].num_buckets
    for given, want in (("1/8", max(1, num_buckets // 8)), ("1/2", num_buckets // 2), ("3", 3), (2, 2), ("1", 1)):
        runtime = resolve_arm(info, 256, "random", overrides={"top_m": "fixed", "m_fixed": given})[1]
        assert runtime.m_fixed == want, given


@pytest.fixture
def no_model(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the model loaded before the check")

    monkeypatch.setattr(armkv.hf.model, "load_model", refuse)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["eval", "ppl", "--method", "kivi", "--option", "kivi.bitz=2"], "its options: bits, group"),
        (["eval", "ppl", "--method", "sink", "--budget", "1000000000"], "is more than the model's 1024 positions"),
        (["eval", "ppl", "--method", "sink", "--adapter", "random"], "--adapter applies to the arm and fifo methods"),
        (["eval", "ruler", "--output", "OUT", "--budget", "1000000000"], "is more than the model's 1024 positions"),
        (
            ["eval", "ruler", "--output", "OUT", "--methods", "arm", "--option", "arm.m_fixed=1/x"],
            "or a share of them in (0, 1] (1/8)",
        ),
        (
            ["eval", "ruler", "--output", "OUT", "--methods", "arm", "--option", "arm.m_fixed=3/2"],
            "or a share of them in (0, 1]",
        ),
    ],
)
def test_eval_checks_before_the_model_loads(tmp_path, tiny_model_dir, capsys, no_model, argv, message):
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 20)
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    extra = ["--input", str(text)] if "ppl" in argv else []
    assert main([*argv, *extra, "--model", str(tiny_model_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_default_model_folder_matches_the_loader(monkeypatch, tmp_path):
    """preflight finds the default model's folder without importing transformers: the same folder."""
    from armkv.tools.preflight import model_folder

    monkeypatch.setenv("ARMKV_CACHE", str(tmp_path))
    folder = tmp_path / "models" / armkv.hf.model.DEFAULT_NAME
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    assert model_folder(None) == folder == armkv.hf.model.default_model_dir()


def test_machine_memory_check(monkeypatch, tiny_model_dir):
    from armkv.tools import preflight

    monkeypatch.setattr(preflight, "machine_memory_bytes", lambda: 2**16)
    with pytest.raises(
        ArmkvError, match=r"--budget 1000 needs up to .* GiB of cache \(2 layers\), more than this machine's"
    ):
        preflight.check_budget(1000, tiny_model_dir)
    preflight.check_budget(1, tiny_model_dir)
