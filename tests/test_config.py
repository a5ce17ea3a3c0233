"""Config loading, overrides and start-up validation."""
from __future__ import annotations

from pathlib import Path

import pytest

from training.metrics import lpips_unavailable_reason
from training.config import ConfigError, TrainConfig, apply_overrides, check, load_config, run_prefix

CONFIGS = Path(__file__).resolve().parents[1] / "training" / "configs"


def valid(tmp_path: Path, **changes) -> TrainConfig:
    (tmp_path / "videos").mkdir(exist_ok=True)
    return TrainConfig(data_root=str(tmp_path / "videos"), pretrained_model_path="").replace(**changes)


@pytest.mark.parametrize("name", ["taehv_config", "taehv_config_1gpu_h100", "taehv_config_h100", "taehv_config_a800",
                                  "taehv_config_16gpu_h100", "taehv_config_demo", "taehv_config_test"])
def test_presets_load(name):
    config = load_config(CONFIGS / f"{name}.py")
    assert isinstance(config, TrainConfig) and config.config_file.endswith(f"{name}.py")


def test_overrides_are_typed_and_unknown_keys_suggest():
    config = apply_overrides(TrainConfig(), ["--n_frames=9", "--learning_rate=3e-4", "--hflip=false", "--variant=taehv"])
    assert (config.n_frames, config.learning_rate, config.hflip, config.variant) == (9, 3e-4, False, "taehv")
    with pytest.raises(ConfigError, match="did you mean 'learning_rate'"):
        apply_overrides(TrainConfig(), ["--learnig_rate=1"])
    with pytest.raises(ConfigError, match="expected a int"):
        apply_overrides(TrainConfig(), ["--n_frames=nine"])
    with pytest.raises(ConfigError, match="--key=value"):
        apply_overrides(TrainConfig(), ["--n_frames"])


def test_run_prefix_from_config_name():
    assert run_prefix(load_config(CONFIGS / "taehv_config_h100.py")) == "h100"
    assert run_prefix(load_config(CONFIGS / "taehv_config.py")) == "base"
    assert run_prefix(load_config(CONFIGS / "taehv_config.py", ["--run_name=exp1"])) == "exp1"


def test_valid_config_passes_with_notes(tmp_path):
    notes = check(valid(tmp_path, n_frames=12))
    assert any("covers input frames 0..8" in n for n in notes)
    assert any("plain autoencoder" in n for n in notes)


def test_frame_counts_with_reference_vae_list_valid_values(tmp_path):
    (tmp_path / "vae").mkdir()
    with pytest.raises(ConfigError) as err:
        check(valid(tmp_path, ref_vae_path=str(tmp_path), n_frames=12, variant="taecvx"))
    assert "n_frames=12" in str(err.value) and "Valid: 9, 17, 25" in str(err.value)
    with pytest.raises(ConfigError, match="Valid: 5, 9, 13, 17"):
        check(valid(tmp_path, ref_vae_path=str(tmp_path), n_frames=16, variant="taehv"))
    check(valid(tmp_path, ref_vae_path=str(tmp_path), n_frames=17, variant="taecvx"))


def test_every_problem_is_reported_at_once(tmp_path):
    with pytest.raises(ConfigError) as err:
        check(valid(tmp_path, height=100, mixed_precision="fp8", annotation_file="nope.json", stride_min=4, stride_max=2))
    message = str(err.value)
    for expected in ("multiples of 8", "mixed_precision", "nope.json", "stride_min"):
        assert expected in message


def test_patch_size_sets_the_spatial_multiple(tmp_path):
    with pytest.raises(ConfigError, match="multiples of 16"):
        check(valid(tmp_path, variant="taehv1_5", height=40, width=64))


def test_unsupported_variant_and_lpips(tmp_path):
    with pytest.raises(ConfigError, match="not supported"):
        check(valid(tmp_path, variant="taeltx_2"))
    if lpips_unavailable_reason() is not None:  # the optional extra is not installed here
        with pytest.raises(ConfigError, match="LPIPS is unusable"):
            check(valid(tmp_path, lpips_loss_weight=0.1))


def test_wrong_type_in_config_file(tmp_path):
    with pytest.raises(ConfigError, match="n_frames='9' should be a int"):
        check(valid(tmp_path, n_frames="9"))
    bad = tmp_path / "bad.py"
    bad.write_text("config = dict(n_frames=9)\n")
    with pytest.raises(ConfigError, match="must define `config = TrainConfig"):
        load_config(bad)
