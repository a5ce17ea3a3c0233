"""Config loading, overrides and start-up validation."""

from __future__ import annotations

import json
import logging
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from conftest import REPO_ROOT, save_tiny_vae
from conftest import valid_config as valid
from taehv_train.base.errors import UserError
from taehv_train.common.config import TrainConfig, apply_overrides, load_config, run_prefix
from taehv_train.common.metrics import lpips_unavailable_reason
from taehv_train.models.variants import get_variant
from taehv_train.training.preflight import check

CONFIGS = Path(__file__).resolve().parents[1] / "training" / "configs"
PRESETS = [
    "taehv_config",
    "taehv_config_1gpu_h100",
    "taehv_config_h100",
    "taehv_config_a800",
    "taehv_config_16gpu_h100",
    "taehv_config_scratch",
    "taehv_config_demo",
    "taehv_config_test",
    "taehv_config_ltx2",
    "taehv_config_wan22",
    "taehv_config_hv15",
    "taehv_config_h3",
    "taehv_config_progressive_stage1",
    "taehv_config_progressive_stage2",
    "taehv_config_allegro",
    "taehv_config_cosmos",
    "taehv_config_kvae",
    "taehv_config_easyanimate",
    "taehv_config_vidtok",
    "taehv_config_mochi",
    "taehv_config_svd",
    "taehv_config_hunyuanimage_refiner",
    "taehv_config_qwenimage21",
]


def vae_folder(root: Path, name: str = "cogvideox", **overrides) -> str:
    """A tiny diffusers VAE of reference VAE class ``name`` saved into ``root/vae``."""
    return str(save_tiny_vae(root, name, **overrides))


def local_paths(config: TrainConfig, tmp_path: Path) -> dict[str, str]:
    """Stand-ins on this machine for the paths a preset names (data, weights, reference VAE):
    a folder for a folder, a small real file for a file. Paths the preset leaves empty stay
    empty, so that, for example, the demo preset keeps training without a reference VAE."""
    annotation = {"total": 1, "list": [{"path": "clip_0000.mp4", "frames": 64}]}
    changes = {}
    if config.data_root:
        (tmp_path / "videos").mkdir()
        (tmp_path / "videos" / "clip_0000.mp4").touch()
        changes["data_root"] = str(tmp_path / "videos")
    for name in ("annotation_file", "val_annotation_file"):
        if getattr(config, name):
            path = tmp_path / f"{name}.json"
            path.write_text(json.dumps(annotation))
            changes[name] = str(path)
    if config.pretrained_model_path:
        path = tmp_path / Path(config.pretrained_model_path).name
        path.write_bytes(b"weights")
        changes["pretrained_model_path"] = str(path)
    if config.ref_vae_path:
        wan22 = config.ref_vae_class == "wan" and get_variant(config.variant).latent_channels == 48
        changes["ref_vae_path"] = vae_folder(tmp_path / "ref_vae", "wan22" if wan22 else config.ref_vae_class)
    if config.latent_cache_dir:
        (tmp_path / "latent_cache").mkdir()
        changes["latent_cache_dir"] = str(tmp_path / "latent_cache")
    return changes


@pytest.mark.parametrize("name", PRESETS)
def test_presets_load_and_pass_the_config_check(name, tmp_path):
    config = load_config(CONFIGS / f"{name}.py")
    assert isinstance(config, TrainConfig) and config.config_file.endswith(f"{name}.py")
    changes = local_paths(config, tmp_path)
    assert "data_root" in changes or "annotation_file" in changes  # every preset names its data
    notes = check(config.replace(**changes))  # every other field as the preset sets it
    assert ("no reference VAE: plain autoencoder training (encoder/decoder distillation losses off)" in notes) == (
        not config.ref_vae_path
    )


def test_preset_check_sees_the_replaced_paths(tmp_path):
    """The stand-ins are what check() looks at: a missing one is still reported."""
    config = load_config(CONFIGS / "taehv_config.py")
    changes = local_paths(config, tmp_path)
    Path(changes["pretrained_model_path"]).unlink()
    with pytest.raises(UserError, match="pretrained_model_path: .* does not exist"):
        check(config.replace(**changes))


def test_overrides_are_typed_and_unknown_keys_suggest():
    config = apply_overrides(
        TrainConfig(), ["--n_frames=9", "--learning_rate=3e-4", "--hflip=false", "--variant=taehv"]
    )
    assert (config.n_frames, config.learning_rate, config.hflip, config.variant) == (9, 3e-4, False, "taehv")
    with pytest.raises(UserError, match="did you mean 'learning_rate'"):
        apply_overrides(TrainConfig(), ["--learnig_rate=1"])
    with pytest.raises(UserError, match="expected a int"):
        apply_overrides(TrainConfig(), ["--n_frames=nine"])
    with pytest.raises(UserError, match="--key=value"):
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
    vae_folder(tmp_path)
    with pytest.raises(UserError) as err:
        check(valid(tmp_path, ref_vae_path=str(tmp_path), n_frames=12, variant="taecvx"))
    assert "n_frames=12" in str(err.value) and "Valid: 9, 17, 25" in str(err.value)
    with pytest.raises(UserError, match="Valid: 5, 9, 13, 17"):
        check(valid(tmp_path, ref_vae_path=str(tmp_path), n_frames=16, variant="taehv"))
    check(valid(tmp_path, ref_vae_path=str(tmp_path), n_frames=17, variant="taecvx"))


@pytest.mark.parametrize(
    "variant, ref_vae, size, bad, with_vae, exact, good",
    [
        ("taeltx2_3", "ltx2", 64, 17 + 4, "Valid: 9, 17, 25, 33", "exact values: 1, 9, 17, 25", 121),
        ("taeh3", "h3", 32, 17, "Valid: 22, 39, 56", "exact values: 5, 22, 39, 56", 22),
    ],
)
def test_frame_counts_of_the_newer_variants_follow_their_plan(
    tmp_path, variant, ref_vae, size, bad, with_vae, exact, good
):
    """LTX decodes 8k+1 frames exactly; H3 17c - 12, and its VAE needs more than 17 frames."""
    vae = vae_folder(tmp_path / "vae_root", ref_vae)
    config = valid(tmp_path, variant=variant, height=size, width=size, ref_vae_path=vae, ref_vae_class=ref_vae)
    with pytest.raises(UserError, match=with_vae):
        check(config.replace(n_frames=bad))
    check(config.replace(n_frames=good))
    notes = check(valid(tmp_path, variant=variant, height=size, width=size, n_frames=bad))
    assert any(exact in note for note in notes), notes


def test_every_problem_is_reported_at_once(tmp_path):
    with pytest.raises(UserError) as err:
        check(
            valid(tmp_path, height=100, mixed_precision="fp8", annotation_file="nope.json", stride_min=4, stride_max=2)
        )
    message = str(err.value)
    for expected in ("multiples of 8", "mixed_precision", "nope.json", "stride_min"):
        assert expected in message


def test_a_time_budget_that_is_not_positive_is_called_so(tmp_path):
    for budget in ("0s", "0", "-3m"):
        with pytest.raises(UserError, match=f"max_train_time='{budget}' is not positive: give a budget such as 8h"):
            check(valid(tmp_path, max_train_time=budget))
    with pytest.raises(UserError, match="max_train_time='8 hours' is not a duration: write e.g. 8h"):
        check(valid(tmp_path, max_train_time="8 hours"))


def test_patch_size_sets_the_spatial_multiple(tmp_path):
    with pytest.raises(UserError, match="multiples of 16"):
        check(valid(tmp_path, variant="taehv1_5", height=40, width=64))


def test_unknown_variant_lists_the_known_ones(tmp_path):
    with pytest.raises(UserError, match="unknown TAE variant 'taeltx3'; known variants: .*taeltx2_3_wide"):
        check(valid(tmp_path, variant="taeltx3"))


@pytest.fixture
def fresh_lpips_probe():
    """lpips_unavailable_reason() caches its answer: start and leave with an empty cache."""
    lpips_unavailable_reason.cache_clear()
    yield
    lpips_unavailable_reason.cache_clear()


def fake_lpips_module(monkeypatch, constructor_error: Exception | None) -> None:
    """Stand in for torchmetrics.image.lpip; its LPIPS class raises ``constructor_error``."""
    module = types.ModuleType("torchmetrics.image.lpip")

    class LearnedPerceptualImagePatchSimilarity:
        def __init__(self, **kwargs):
            if constructor_error is not None:
                raise constructor_error

    module.LearnedPerceptualImagePatchSimilarity = LearnedPerceptualImagePatchSimilarity
    monkeypatch.setitem(sys.modules, "torchmetrics.image.lpip", module)


def test_lpips_here_decides_the_config_check(tmp_path, fresh_lpips_probe):
    """Whatever this environment has, check() follows lpips_unavailable_reason()."""
    reason = lpips_unavailable_reason()
    if reason is None:
        check(valid(tmp_path, lpips_loss_weight=0.1))
        check(valid(tmp_path, best_metric="val/lpips"))
    else:
        with pytest.raises(UserError, match="LPIPS is unusable") as err:
            check(valid(tmp_path, lpips_loss_weight=0.1))
        assert reason in str(err.value)


# what torchmetrics' LPIPS constructor raises when torchvision is not installed: three fixes
TORCHMETRICS_MESSAGE = (
    "LPIPS metric requires that torchvision is installed. Either install as `pip install torchmetrics[image]` "
    "or `pip install torchvision`."
)


def test_lpips_missing_is_one_reason_with_one_fix_and_refused(tmp_path, monkeypatch, caplog, fresh_lpips_probe):
    fake_lpips_module(monkeypatch, ModuleNotFoundError(TORCHMETRICS_MESSAGE))
    monkeypatch.setitem(sys.modules, "torchvision", None)  # not installed
    monkeypatch.setattr(torch, "__version__", "2.13.0")
    with caplog.at_level(logging.INFO):
        reason = lpips_unavailable_reason()
    assert reason == "torchvision is not installed (to add it: pip install -r requirements-lpips.txt)"
    assert caplog.records == []  # the callers say it, once, where it does not break a progress bar
    with pytest.raises(UserError, match=r"LPIPS is unusable: torchvision is not installed \(to add it: pip install"):
        check(valid(tmp_path, lpips_loss_weight=0.1))
    with pytest.raises(UserError, match="best_metric=val/lpips, but LPIPS is unusable"):
        check(valid(tmp_path, best_metric="val/lpips"))

    lpips_unavailable_reason.cache_clear()
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")  # PyPI's torchvision does not load beside it
    monkeypatch.setitem(sys.modules, "torchmetrics.image.lpip", None)  # the module itself cannot be imported
    assert lpips_unavailable_reason() == (
        "torchvision is not installed (to add it: pip install -r requirements-lpips.txt "
        "--extra-index-url https://download.pytorch.org/whl/cpu)"
    )


def test_the_lpips_extra_pins_the_torchvision_of_the_pinned_torch():
    """torchvision 0.N pairs with torch 2.(N - 15) (0.15 with 2.0 ... 0.28 with 2.13): another
    torchvision would make pip install another torch beside the pinned one."""
    torch_pin = re.search(r"^torch==2\.(\d+)\.\d+", (REPO_ROOT / "requirements.txt").read_text(), re.M)
    extra = (REPO_ROOT / "requirements-lpips.txt").read_text()
    pins = re.findall(r"^torchvision==0\.(\d+)\.\d+$", extra, re.M)
    assert "-r requirements.txt" in extra and pins == [str(int(torch_pin.group(1)) + 15)]


def test_lpips_usable_is_accepted(tmp_path, monkeypatch, fresh_lpips_probe):
    fake_lpips_module(monkeypatch, None)
    assert lpips_unavailable_reason() is None
    check(valid(tmp_path, lpips_loss_weight=0.1))
    check(valid(tmp_path, best_metric="val/lpips"))


def test_lpips_without_the_own_decoded_frames_is_refused(tmp_path, monkeypatch, fresh_lpips_probe):
    """With a reference VAE the TAE decodes its own latents only for the reconstruction loss,
    and LPIPS is taken on those frames: LPIPS weighted without them would train nothing."""
    fake_lpips_module(monkeypatch, None)
    vae = vae_folder(tmp_path / "ref_vae")
    with pytest.raises(UserError) as err:
        check(valid(tmp_path, ref_vae_path=vae, reconstruction_loss_weight=0.0, lpips_loss_weight=0.1))
    assert str(err.value) == (
        "invalid config: lpips_loss_weight > 0 needs the TAE's own decoded frames: with a reference VAE they are "
        "decoded only when reconstruction_loss_weight > 0; set reconstruction_loss_weight > 0 or lpips_loss_weight=0"
    )
    check(valid(tmp_path, ref_vae_path=vae, reconstruction_loss_weight=0.0))
    check(valid(tmp_path, ref_vae_path=vae, reconstruction_loss_weight=0.5, lpips_loss_weight=0.1))
    check(valid(tmp_path, reconstruction_loss_weight=1.0, lpips_loss_weight=0.1))  # no reference: always decoded


def test_lpips_other_errors_propagate(tmp_path, monkeypatch, fresh_lpips_probe):
    """A broken install (e.g. backbone weights that cannot be loaded) is an error, not "unavailable"."""
    fake_lpips_module(monkeypatch, RuntimeError("Error(s) in loading state_dict for Alexnet"))
    with pytest.raises(RuntimeError, match="loading state_dict for Alexnet"):
        lpips_unavailable_reason()
    with pytest.raises(RuntimeError, match="loading state_dict for Alexnet"):
        check(valid(tmp_path, lpips_loss_weight=0.1))
    fake_lpips_module(monkeypatch, OSError("alexnet-owt-7be5be79.pth: no such file"))
    with pytest.raises(OSError, match="alexnet-owt"):
        lpips_unavailable_reason()


def test_wrong_type_in_config_file(tmp_path):
    with pytest.raises(UserError, match="n_frames='9' should be a int"):
        check(valid(tmp_path, n_frames="9"))
    bad = tmp_path / "bad.py"
    bad.write_text("config = dict(n_frames=9)\n")
    with pytest.raises(UserError, match="must define `config = TrainConfig"):
        load_config(bad)
    bad.write_text("from taehv_train.common.config import TrainConfig\nconfig = TrainConfig(data_root=5)\n")
    with pytest.raises(UserError, match="data_root=5 should be a str"):  # not resolved as a path first
        check(load_config(bad))


def test_paths_are_made_absolute_once_and_missing_demo_clips_name_the_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths are the repository root's, wherever the tool runs
    config = load_config(
        REPO_ROOT / "training" / "configs" / "taehv_config_test.py",
        ["--data_root=demo_output/data/not_made_here", "--annotation_file=", "--val_annotation_file="],
    )
    assert (
        config.data_root == str(REPO_ROOT / "demo_output" / "data" / "not_made_here") and config.annotation_file == ""
    )
    with pytest.raises(
        UserError,
        match=r"data_root: .*not_made_here does not exist: `make demo` makes the built-in "
        r"clips there \(or `python -m taehv_train.training.demo_data demo_output/data` alone\)",
    ):
        check(config)


def test_data_root_given_alone_drops_the_annotation_files_of_the_presets_own_folder(tmp_path):
    """The preset's annotation files list the preset's clips: with another data_root and no
    annotation key they are cleared (the folder is scanned, and a note says how to split it);
    annotation keys given, the same folder, or files outside the preset's folder stay."""
    scratch = REPO_ROOT / "training" / "configs" / "taehv_config_scratch.py"
    videos = Path(valid(tmp_path).data_root)  # a folder holding a clip
    config = load_config(scratch, [f"--data-root={videos}"])
    assert (config.data_root, config.annotation_file, config.val_annotation_file) == (str(videos), "", "")
    (note,) = [n for n in check(config) if n.startswith("no annotation file")]
    assert f"scans data_root {videos} for clips and has no validation set" in note
    assert f"python -m taehv_train.training.make_annotations {videos} -o {videos}/annotations.json" in note

    given = load_config(scratch, [f"--data_root={videos}", f"--annotation_file={tmp_path / 'a.json'}"])
    assert given.annotation_file == str(tmp_path / "a.json")
    assert given.val_annotation_file == str(REPO_ROOT / "data" / "MiniDataset" / "annotations_val.json")
    same = load_config(scratch, ["--data_root=data/MiniDataset"])
    assert same.annotation_file == str(REPO_ROOT / "data" / "MiniDataset" / "annotations_train.json")
    elsewhere = tmp_path / "elsewhere.py"
    elsewhere.write_text(
        "from taehv_train.training.configs.taehv_config_scratch import config as base\n"
        "config = base.replace(annotation_file='/data/train.json', val_annotation_file='')\n"
    )
    assert load_config(elsewhere, [f"--data_root={videos}"]).annotation_file == "/data/train.json"


@pytest.mark.parametrize("variant, frames", [("taehv", 65), ("taehv", 101), ("taecvx", 73)])
def test_frame_counts_above_64_work_with_a_reference_vae(tmp_path, variant, frames):
    vae_folder(tmp_path)
    check(valid(tmp_path, variant=variant, n_frames=frames, ref_vae_path=str(tmp_path)))
    with pytest.raises(UserError, match=f"n_frames={frames + 2} does not work"):
        check(valid(tmp_path, variant=variant, n_frames=frames + 2, ref_vae_path=str(tmp_path)))


def test_validation_size_is_checked_and_used_for_the_held_out_clips(tmp_path, demo_clips):
    with pytest.raises(UserError, match=r"height=0 must be in \[1, 16384\]"):
        check(valid(tmp_path, height=0))
    with pytest.raises(UserError, match="set both val_height and val_width"):
        check(valid(tmp_path, val_height=48))
    with pytest.raises(UserError, match=r"val_height and val_width must be multiples of 8 \(.*\), got 44x64"):
        check(valid(tmp_path, val_height=44, val_width=64))
    from taehv_train.training.data.loading import build_datasets

    config = valid(
        tmp_path,
        data_root=str(demo_clips["root"]),
        annotation_file=str(demo_clips["train"]),
        val_annotation_file=str(demo_clips["val"]),
        n_frames=5,
        height=16,
        width=24,
        val_height=48,
        val_width=64,
    )
    check(config)
    train, val = build_datasets(config)
    assert train[0]["frames"].shape[-2:] == (16, 24) and val[0]["frames"].shape[-2:] == (48, 64)
    assert valid(tmp_path).validation_size == (480, 720)


def test_a_one_clip_validation_set_is_warned_about(tmp_path, demo_clips, caplog):
    from taehv_train.training.data.loading import build_training_data

    for val_file, warned in ((demo_clips["val"], True), (demo_clips["train"], False)):  # 1 clip, 5 clips
        caplog.clear()
        config = valid(
            tmp_path,
            data_root=str(demo_clips["root"]),
            annotation_file=str(demo_clips["train"]),
            val_annotation_file=str(val_file),
            n_frames=5,
        )
        with caplog.at_level(logging.WARNING, logger="taehv_train.training.data.loading"):
            build_training_data(config, None)
        expected = f"the validation set is one clip ({val_file}): its scores follow that clip alone"
        assert (expected in caplog.text) == warned, caplog.text


def test_numbers_must_be_finite(tmp_path):
    with pytest.raises(UserError) as err:
        check(apply_overrides(valid(tmp_path), ["--learning_rate=inf", "--max_grad_norm=nan"]))
    assert "learning_rate=inf must be a finite number" in str(err.value)
    assert "max_grad_norm=nan must be a finite number" in str(err.value)


def test_the_reference_vae_folder_is_checked_before_launch(tmp_path):
    """Not a diffusers folder, another VAE class, or a latent space that does not fit the
    variant: each is a pre-flight error (before any run folder exists) that says what fits."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="empty/vae is not a diffusers model folder"):
        check(valid(tmp_path, ref_vae_path=str(tmp_path / "empty"), n_frames=17))
    wan = vae_folder(tmp_path / "wan", "wan")
    with pytest.raises(
        UserError, match="holds a AutoencoderKLWan, but ref_vae_class=cogvideox .*: set ref_vae_class=wan"
    ):
        check(valid(tmp_path, ref_vae_path=wan, ref_vae_class="cogvideox", n_frames=17))
    wide = vae_folder(tmp_path / "wide", "cogvideox", latent_channels=48, block_out_channels=(4, 4, 4, 4, 4))
    with pytest.raises(
        UserError,
        match=r"the reference VAE has 48 latent channels, 16x space, 4x time but taecvx has "
        r"16 latent channels, 8x space, 4x time: pick the matching variant \(taew2_2, "
        r"taew2_2_super, lighttaew2_2\)",
    ):
        check(valid(tmp_path, ref_vae_path=wide, n_frames=17))


def test_mistakes_in_a_config_file_name_the_file_and_line(tmp_path):
    """A syntax error, and a key typo inside config.replace(...), are one line with the file,
    the line and (for the typo) the closest key, as the same typo on the command line is."""
    typo = tmp_path / "typo.py"
    typo.write_text(
        "from taehv_train.training.configs.taehv_config import config as base\n\nconfig = base.replace(\n"
        "    lerning_rate=3e-4,\n)\n"
    )
    with pytest.raises(
        UserError, match=r"typo\.py:3: unknown config key 'lerning_rate'; did you mean 'learning_rate'\?"
    ):
        load_config(typo)
    broken = tmp_path / "broken.py"
    broken.write_text("config = (\n")
    with pytest.raises(UserError, match=r"broken\.py:1: syntax error: '\(' was never closed"):
        load_config(broken)


def test_a_missing_export_of_a_preset_run_names_the_run_that_writes_it(tmp_path):
    config = load_config(
        REPO_ROOT / "training" / "configs" / "taehv_config_progressive_stage2.py", [f"--output_dir={tmp_path}"]
    )
    with pytest.raises(
        UserError,
        match=r"pretrained_model_path: .*/output/progressive_stage1/export/taecvx\.pth does "
        r"not exist: the end of the progressive_stage1 run writes it "
        r"\(`\./train_taehv_h100\.sh N progressive_stage1`\)",
    ):
        check(config)


def test_a_best_metric_from_reference_latents_needs_a_reference_vae(tmp_path):
    """The preview score may choose best_model/ as the whole-clip one does; a metric of the
    reference VAE's latents is refused without one."""
    check(valid(tmp_path, best_metric="val/preview_psnr"))
    for metric in ("val/psnr_from_reference_latents", "val/preview_psnr_from_reference_latents"):
        with pytest.raises(UserError, match=f"best_metric={metric} needs a reference VAE"):
            check(valid(tmp_path, best_metric=metric))
