"""The checks made before a model loads know the default model's shape before its first
load converts it (a fresh machine), so a bad budget is refused there too."""

import pytest

from armkv.errors import ArmkvError
from armkv.tools.preflight import check_budget, model_info_from_config


def test_the_default_models_shape_is_known_before_it_is_converted(tmp_path, monkeypatch):
    monkeypatch.setenv("ARMKV_CACHE", str(tmp_path))  # nothing converted here
    info, rotary = model_info_from_config(None)
    assert (info.num_layers, info.num_kv_heads, info.head_dim, info.max_positions) == (30, 3, 64, 8192)
    with pytest.raises(ArmkvError, match="more than the model's 8192 positions"):
        check_budget(1_000_000_000, None)


@pytest.mark.real_model
def test_the_shipped_shape_is_the_converted_models():
    from armkv.hf.model import default_model_dir, load_model

    load_model()  # converts it once
    shipped, rotary = model_info_from_config(None)
    converted, rotary_converted = model_info_from_config(default_model_dir())
    assert shipped == converted
    assert (rotary.inv_freq == rotary_converted.inv_freq).all()
