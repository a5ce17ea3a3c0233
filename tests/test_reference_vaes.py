"""Every diffusers video VAE as the reference VAE: facts from its config, the matching TAE variant,
and the whole path (two training steps, a one-clip latent cache, inference --use_ref_vae)
with a tiny instance of each class saved by diffusers and loaded back."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import av
import cv2
import numpy as np
import pytest
import torch

from conftest import REPO_ROOT, save_tiny_vae
from taehv_train import inference
from taehv_train.base.errors import EXIT_USER_ERROR, UserError, exit_on_user_error
from taehv_train.common.clips import frames_to_unit
from taehv_train.common.config import TrainConfig, load_config
from taehv_train.common.reference_vae import ReferenceVAE, weight_problems
from taehv_train.models.latent_spaces import guess_space
from taehv_train.models.taehv import TAEHV
from taehv_train.models.vae_classes import REF_VAE_CLASSES
from taehv_train.models.vae_registry import (
    LatentSpace,
    auto_variant,
    class_defaults,
    latent_space,
    read_vae_config,
    ref_vae_class_of,
    ref_vae_problems,
    spaces_of,
    tae_space,
    video_model,
)
from taehv_train.models.variants import known_variants
from taehv_train.models.weights import save_weights
from taehv_train.training import build_latent_cache
from taehv_train.training.data.latent_cache import LatentCache, latent_sample_generator
from taehv_train.training.data.latent_scale_check import compare, diagnose
from taehv_train.training.data.loading import build_datasets
from taehv_train.training.preflight import check
from train_runs import TEST_CONFIG, TRAIN, train_here

# tiny VAE, ref_vae_class, facts, the variant "auto" picks, size, an exact frame count
CASES = [
    ("hunyuan15", "hunyuan15", LatentSpace(32, 16, 4), "taehv1_5", 32, 9),
    ("wan22", "wan", LatentSpace(48, 16, 4), "taew2_2", 32, 9),
    ("ltx", "ltx", LatentSpace(128, 32, 8), "taeltx_2", 32, 9),
    ("ltx2", "ltx2", LatentSpace(128, 32, 8), "taeltx2_3", 64, 9),
    ("h3", "h3", LatentSpace(24, 16, 4, h3_chunks=True), "taeh3", 32, 22),
    # no published TAE: variant=auto builds one
    ("allegro", "allegro", LatentSpace(4, 8, 4, causal=False), "tae_allegro", 32, 24),
    ("cosmos", "cosmos", LatentSpace(16, 8, 8), "tae_cosmos", 32, 9),
    ("kvae", "kvae", LatentSpace(16, 8, 4), "tae_kvae", 32, 9),
    ("easyanimate", "easyanimate", LatentSpace(16, 8, 4), "tae_easyanimate", 32, 9),
    ("vidtok", "vidtok", LatentSpace(4, 8, 4), "tae_vidtok", 32, 9),
    ("mochi", "mochi", LatentSpace(12, 8, 6), "tae_mochi", 32, 7),
    ("svd", "svd", LatentSpace(4, 8, 1), "tae_svd", 32, 3),
    (
        "hunyuanimage_refiner",
        "hunyuanimage_refiner",
        LatentSpace(32, 16, 1, causal=False),
        "tae_hunyuanimage_refiner",
        32,
        3,
    ),
    ("qwenimage21", "qwenimage21", LatentSpace(64, 16, 1, image_channels=4), "tae_qwenimage2_1", 32, 1),  # RGBA images
]
IDS = [case[0] for case in CASES]


@pytest.fixture(scope="module")
def long_clips(tmp_path_factory) -> dict:
    """Procedural clips long enough for H3 (more than 17 frames), 64x96."""
    from taehv_train.training.demo_data import make_demo_dataset

    root = tmp_path_factory.mktemp("long_clips")
    return {"root": root, **make_demo_dataset(root, num_clips=3, n_frames=24, height=64, width=96, seed=2)}


@pytest.fixture(scope="module")
def rgba_images(tmp_path_factory) -> dict:
    """Three 64x96 RGBA PNGs (a coloured gradient, a disc, an alpha ramp with a hole) with
    train/val annotations of one frame each: what a Qwen-Image 2.1 user brings."""
    root = tmp_path_factory.mktemp("rgba_images")
    y, x = np.mgrid[0:64, 0:96]
    for i in range(3):
        rgba = np.stack([(x * 2 + 40 * i) % 256, (y * 4) % 256, np.full_like(x, 80 * i), (x * 255 // 95)], -1)
        rgba[(y - 32) ** 2 + (x - 30 - 15 * i) ** 2 < 200, :3] = (250, 40, 40)
        rgba[20:40, 60:80, 3] = 0  # a fully transparent hole
        cv2.imwrite(str(root / f"image{i}.png"), cv2.cvtColor(rgba.astype(np.uint8), cv2.COLOR_RGBA2BGRA))
    annotations = {}
    for split, names in (("train", ["image0.png", "image1.png"]), ("val", ["image2.png"])):
        annotations[split] = root / f"{split}.json"
        annotations[split].write_text(
            json.dumps({"total": len(names), "list": [{"path": n, "frames": 1} for n in names]})
        )
    return {"root": root, **annotations}


@pytest.mark.parametrize("tiny, ref_vae_class, facts, variant, size, frames", CASES, ids=IDS)
def test_facts_come_from_the_config_and_match_the_latents(tmp_path, tiny, ref_vae_class, facts, variant, size, frames):
    """The facts read from config.json (no weights) are what the loaded VAE does: its
    latents for an exact clip have the TAE plan's shape, and variant=auto picks the TAE."""
    root = save_tiny_vae(tmp_path, tiny)
    assert latent_space(ref_vae_class, read_vae_config(root / "vae")) == facts
    assert auto_variant(ref_vae_class, root / "vae") == variant
    vae = ReferenceVAE(root, ref_vae_class, dtype="fp32", sample=False)
    clip = frames_to_unit(
        torch.randint(0, 255, (1, frames, facts.image_channels, size, size), dtype=torch.uint8), "cpu"
    )
    latents = vae.encode(clip)
    with torch.device("meta"):  # the plan is the architecture's arithmetic: no weights needed
        plan = TAEHV(variant=variant).plan(frames)
    assert tuple(latents.shape) == (
        1,
        plan.latent_frames,
        facts.latent_channels,
        size // facts.spatial_compression,
        size // facts.spatial_compression,
    )
    decoded = vae.decode(latents)
    assert decoded.shape[1] == plan.decoded_frames == frames and 0 <= float(decoded.min()) <= float(decoded.max()) <= 1
    assert decoded.shape[2] == facts.image_channels
    assert float((vae.encode(clip.flip(-1)) - latents).abs().max()) > 0  # latents of the pixels, not of padding
    assert weight_problems(ref_vae_class, root / "vae") == []  # the weights fit the model its config describes


@pytest.mark.slow
@pytest.mark.parametrize("tiny, ref_vae_class, facts, variant, size, frames", CASES, ids=IDS)
def test_train_cache_and_evaluate_with_each_reference_vae(
    request, tmp_path, tiny, ref_vae_class, facts, variant, size, frames
):
    """An RGBA reference VAE (Qwen-Image 2.1) trains and evaluates on RGBA images: its alpha
    is learned, scored on its own, written into the stills PNG and shown beside the RGB
    video."""
    clips = request.getfixturevalue("rgba_images" if facts.image_channels == 4 else "long_clips")
    root = save_tiny_vae(tmp_path / "ref_vae", tiny)
    ref_vae = [
        f"--ref_vae_path={root}",
        f"--ref_vae_class={ref_vae_class}",
        "--ref_vae_dtype=fp32",
        "--variant=auto",
        f"--height={size}",
        f"--width={size}",
        f"--n_frames={frames}",
        "--stride_max=1",
    ]
    run = train_here(
        tmp_path / "out", clips, *ref_vae, "--max_train_steps=2", "--num_validation_samples=1", "--mixed_precision=no"
    )
    assert json.loads((run / "config.json").read_text())["variant"] == variant
    assert TAEHV(run / "final_model.safetensors").variant == variant
    assert TAEHV(run / "export" / f"{variant}.pth").variant == variant  # the export bundle, by its file name
    assert f"latent space of {video_model(variant)}:" in (run / "export" / "README.md").read_text()

    one_clip = tmp_path / "one_clip.json"
    entries = json.loads(Path(clips["train"]).read_text())["list"][:1]
    one_clip.write_text(json.dumps({"total": 1, "list": entries}))
    # training's, the cache builder's and inference's entry points in this process (a fresh
    # process's start-up, seconds of imports, is tested in test_train.py and test_inference.py)
    build_latent_cache.main(
        [
            "--config",
            TEST_CONFIG,
            *ref_vae,
            f"--data_root={clips['root']}",
            f"--annotation_file={one_clip}",
            f"--val_annotation_file={clips['val']}",
            "--output",
            str(tmp_path / "cache"),
            "--dtype",
            "fp32",
        ]
    )
    valid_for = json.loads((tmp_path / "cache" / "manifest.json").read_text())["valid_for"]
    assert valid_for["latent_channels"] == facts.latent_channels
    assert valid_for["latent_space"] == tae_space(variant, ref_vae_class)  # the TAE's space, as training's
    config = load_config(
        TEST_CONFIG,
        [*ref_vae, f"--data_root={clips['root']}", f"--annotation_file={one_clip}", "--val_annotation_file="],
    )

    dataset = build_datasets(config)[0]
    online = ReferenceVAE.from_config(config, "cpu").encode(
        frames_to_unit(dataset[0]["frames"][None], "cpu"), latent_sample_generator(config.seed, 0, 0)
    )[0]
    torch.testing.assert_close(LatentCache(tmp_path / "cache").latents(0, 0), online)  # what training computes

    metrics = inference.main(
        [
            "--model_path",
            str(run / "final_model.safetensors"),
            "--videos",
            str(Path(clips["root"]) / entries[0]["path"]),
            "--n_frames",
            str(frames),
            "--height",
            str(size),
            "--width",
            str(size),
            "--num_samples",
            "1",
            "--use_ref_vae",
            "--ref_vae_path",
            str(root),
            "--ref_vae_class",
            ref_vae_class,
            "--output_dir",
            str(tmp_path / "eval"),
        ]
    )
    assert metrics == json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert "reference" in metrics["samples"][0] and metrics["model"]["variant"] == variant
    assert metrics["summary"]["comparison"]["latent_rms_ratio"] == metrics["samples"][0]["latent_rms_ratio"] > 0
    assert "latent_rms_ratio" in (tmp_path / "eval" / "summary_report.html").read_text()
    stills = cv2.imread(str(tmp_path / "eval" / metrics["samples"][0]["files"]["stills_png"]), cv2.IMREAD_UNCHANGED)
    with av.open(str(tmp_path / "eval" / metrics["samples"][0]["files"]["original_video"])) as container:
        video_width = container.streams.video[0].codec_context.width
    if facts.image_channels == 4:
        assert "val/alpha_psnr" in json.loads((run / "validation_history.json").read_text())[-1]
        assert "alpha_psnr" in metrics["samples"][0]["taehv"] and "alpha_psnr" in metrics["samples"][0]["reference"]
        assert "<circle" in (tmp_path / "eval" / "summary_report.html").read_text()  # one frame: a dot per series
        assert stills.shape[2] == 4 and len(np.unique(stills[..., 3])) > 10  # the images' alpha, in the PNG
        assert video_width == 2 * size  # RGB | alpha
    else:
        assert stills.shape[2] == 3 and video_width == size and "alpha_psnr" not in metrics["samples"][0]["taehv"]


def test_the_latent_scale_check_names_the_space_the_models_latents_look_like_and_a_wrong_variant():
    """Latents in the TAE's space agree; a model whose latents look like another of the VAE's
    spaces (here: raw Wan latents from a TAE trained on the normalised ones) is told so, in
    words that name both spaces; one far off in scale otherwise is another variant's."""
    spaces = spaces_of("wan", class_defaults("wan"))
    normalised = torch.randn(2, 3, 16, 4, 4, generator=torch.Generator().manual_seed(0))
    transform = spaces["normalised"]
    assert diagnose(compare(normalised * 1.1, normalised), transform) is None
    raw = transform.to_raw(normalised)
    problem = diagnose(compare(raw, normalised), transform, guess_space(raw, spaces))
    assert "in the TAE's normalised latents" in problem and "the model's latents look raw" in problem
    assert "latent_space=raw" in problem
    wrong = diagnose(compare(normalised * 8, normalised), transform, guess_space(normalised * 8, spaces))
    assert "ratio 8" in wrong and "another variant" in wrong


@pytest.mark.slow
def test_a_pretrained_model_off_the_reference_scale_is_a_loud_warning_at_start(
    tmp_path, demo_clips, tiny_cogvideox_vae
):
    """Weights that do not belong to this latent space (here: untrained ones given as
    pretrained weights) are reported before the first step, with the likely cause."""
    pretrained = save_weights(TAEHV(variant="taecvx"), tmp_path / "not_for_this_vae.pth")
    run = train_here(
        tmp_path / "out",
        demo_clips,
        f"--ref_vae_path={tiny_cogvideox_vae}",
        "--ref_vae_dtype=fp32",
        f"--pretrained_model_path={pretrained}",
        "--max_train_steps=1",
        "--num_validation_samples=1",
    )
    log = (run / "train.log").read_text()
    assert "WARNING latent scale check: the model's latents have RMS" in log and "likely cause" in log


def test_one_table_says_which_variant_belongs_to_which_reference_vae():
    """The wrapper's lookup, variant="auto" and the model card read one table (Open-Sora 1.3, which
    diffusers cannot load, its own)."""
    assert ref_vae_class_of("taecvx") == "cogvideox" and ref_vae_class_of("taehv1_5_super") == "hunyuan15"
    assert ref_vae_class_of("taeltx2_3_wide") == "ltx2" and ref_vae_class_of("taeos1_3") is None
    assert video_model("taew2_2") == "Wan 2.2" and video_model("taecvx_super") == "CogVideoX"
    assert video_model("taeos1_3") == "Open-Sora 1.3"  # a VAE diffusers cannot load: from its own table
    assert all(name in known_variants() for ref in REF_VAE_CLASSES.values() for name in ref.variants)


def test_a_reference_vae_config_is_read_once_per_process(tmp_path, demo_clips, monkeypatch):
    """load_config (variant=auto), the config check and loading the reference VAE all need its
    config.json; our code reads the file once (diffusers reads it again itself when it loads
    the weights, through its own open())."""
    root = save_tiny_vae(tmp_path / "vae_root", "cogvideox")
    reads, read_text = [], Path.read_text

    def counting_read_text(path: Path, *args, **kwargs) -> str:
        if path.name == "config.json" and tmp_path in path.parents:
            reads.append(path)
        return read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", counting_read_text)
    config = load_config(
        TEST_CONFIG,
        [
            f"--ref_vae_path={root}",
            "--variant=auto",
            "--n_frames=9",
            f"--data_root={demo_clips['root']}",
            f"--annotation_file={demo_clips['train']}",
            f"--val_annotation_file={demo_clips['val']}",
        ],
    )
    assert config.variant == "taecvx"
    check(config)
    ReferenceVAE.from_config(config, "cpu")
    assert reads == [root.resolve() / "vae" / "config.json"]


def test_a_config_json_without_a_key_the_facts_need_is_one_problem(tmp_path):
    """A CogVideoX config.json with no block_out_channels: one problem naming the key and
    the file (it was a KeyError traceback in the launch script's pre-flight)."""
    root = save_tiny_vae(tmp_path / "vae_root", "cogvideox")
    config_file = root / "vae" / "config.json"
    config_file.write_text(
        json.dumps({k: v for k, v in json.loads(config_file.read_text()).items() if k != "block_out_channels"})
    )
    assert auto_variant("cogvideox", root / "vae") is None
    assert ref_vae_problems("cogvideox", root / "vae", "taecvx") == [
        f"{config_file} has no 'block_out_channels', which an AutoencoderKLCogVideoX config needs to tell its latent "
        "space: is the file complete?"
    ]


def test_ref_vae_class_auto_reads_the_class_from_the_folder(tmp_path, demo_clips):
    """ref_vae_class=auto (the default) takes the class the folder's config.json names (and
    variant=auto then its TAE); an explicit class that contradicts the file, or a class no
    entry of the table loads, is one problem that says what to do."""
    assert TrainConfig().ref_vae_class == "auto"
    cogvideox, wan = save_tiny_vae(tmp_path / "cogvideox", "cogvideox"), save_tiny_vae(tmp_path / "wan", "wan22")
    data = [
        f"--data_root={demo_clips['root']}",
        f"--annotation_file={demo_clips['train']}",
        f"--val_annotation_file={demo_clips['val']}",
        "--n_frames=9",
    ]

    def config_for(root: Path, *extra: str) -> TrainConfig:
        return load_config(TEST_CONFIG, [f"--ref_vae_path={root}", *data, *extra])

    config = config_for(wan, "--ref_vae_class=auto", "--variant=auto")
    assert (config.ref_vae_class, config.variant) == ("wan", "taew2_2")
    config = config_for(cogvideox, "--ref_vae_class=auto", "--variant=taecvx")
    assert config.ref_vae_class == "cogvideox" and check(config) is not None
    vae = ReferenceVAE(cogvideox, "auto", dtype="fp32")  # inference without --config: resolved when loading
    assert vae.latent_channels == 16
    with pytest.raises(
        UserError,
        match=r"holds a AutoencoderKLCogVideoX, but ref_vae_class=wan loads "
        r"AutoencoderKLWan: set ref_vae_class=cogvideox",
    ):
        check(config_for(cogvideox, "--ref_vae_class=wan", "--variant=taecvx"))

    config_file = wan / "vae" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "_class_name": "AutoencoderDC"}))
    config = config_for(wan, "--ref_vae_class=auto", "--variant=auto")
    assert (config.ref_vae_class, config.variant) == ("auto", "auto")  # left for the check to explain
    with pytest.raises(
        UserError,
        match=rf"ref_vae_class=auto: {config_file} holds a AutoencoderDC, which no "
        r"ref_vae_class loads yet \(known: AutoencoderKLCogVideoX, ",
    ):
        check(config)


def test_a_reference_vae_that_cannot_run_here_says_why(tmp_path):
    """Cosmos's VAE has no bf16 average pooling on the CPU: one line, before any weights load."""
    with pytest.raises(UserError, match=r"runs on the CPU in fp32 only .*: pass --ref_vae_dtype=fp32"):
        ReferenceVAE(save_tiny_vae(tmp_path / "cosmos", "cosmos"), "auto", dtype="bf16", device="cpu")


def broken_reference_vae(root: Path, breakage: str) -> Path:
    """A tiny CogVideoX VAE saved by diffusers into ``root/vae``, then broken as a copy of a
    model can be; returns ``root`` (what ``ref_vae_path`` names)."""
    from diffusers import AutoencoderKLCogVideoX
    from safetensors.torch import load_file, save_file

    save_tiny_vae(root, "cogvideox")
    folder = root / "vae"
    weights = folder / "diffusion_pytorch_model.safetensors"
    if breakage == "no weights":
        weights.unlink()
    elif breakage == "a variant's weights only":
        weights.rename(folder / "diffusion_pytorch_model.fp16.safetensors")
    elif breakage in ("wrong shapes", "a missing tensor"):
        tensors = load_file(weights)
        if breakage == "wrong shapes":
            tensors["decoder.conv_in.conv.bias"] = torch.zeros(5)
        else:
            del tensors["decoder.conv_in.conv.bias"]
        save_file(tensors, weights)
    elif breakage == "a missing shard":
        AutoencoderKLCogVideoX.from_pretrained(root, subfolder="vae").save_pretrained(folder, max_shard_size="20KB")
        weights.unlink(missing_ok=True)
        next(folder.glob("diffusion_pytorch_model-00002-of-*.safetensors")).unlink()
    elif breakage == "a git-lfs pointer":
        weights.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 1234\n")
    elif breakage == "a truncated file":
        weights.write_bytes(weights.read_bytes()[:1000])
    else:
        raise AssertionError(breakage)
    return root


UNLOADABLE = [
    (
        "no weights",
        r"no weights next to its config.json: diffusers looks for diffusion_pytorch_model.safetensors, "
        r"diffusion_pytorch_model.safetensors.index.json \(sharded\) or diffusion_pytorch_model.bin: copy the VAE's "
        r"weights there$",
    ),
    (
        "a variant's weights only",
        r"no weights next to its config.json: .*, and the folder holds only diffusion_pytorch_model.fp16.safetensors: "
        r"copy the VAE's weights there$",
    ),
    (
        "wrong shapes",
        r"1 of the \d+ tensors in diffusion_pytorch_model.safetensors do not fit the AutoencoderKLCogVideoX its "
        r"config.json describes; the first, decoder.conv_in.conv.bias, is \[5\] there and \[4\] in the model: "
        r"are its config.json and weights complete and from the same model\?",
    ),
    (
        "a missing tensor",
        r"diffusion_pytorch_model.safetensors lacks 1 of the \d+ tensors of the AutoencoderKLCogVideoX its "
        r"config.json describes \(the first: decoder.conv_in.conv.bias\), which diffusers would leave random",
    ),
    (
        "a missing shard",
        r"diffusion_pytorch_model.safetensors.index.json lists 1 shard\(s\) not in the folder "
        r"\(diffusion_pytorch_model-00002-of-\d+.safetensors\): copy every shard there",
    ),
    (
        "a git-lfs pointer",
        r"diffusion_pytorch_model.safetensors is a git-lfs pointer, not the weights: run `git lfs pull` in the "
        r"model's repository$",
    ),
    ("a truncated file", r"diffusion_pytorch_model.safetensors is not a readable safetensors file \(.*\): copy it"),
]


def reference_vae_options(root: Path, demo_clips: dict) -> list[str]:
    return [
        f"--ref_vae_path={root}",
        "--n_frames=9",
        f"--data_root={demo_clips['root']}",
        f"--annotation_file={demo_clips['train']}",
        f"--val_annotation_file={demo_clips['val']}",
    ]


@pytest.mark.parametrize("breakage, message", UNLOADABLE, ids=[case[0] for case in UNLOADABLE])
def test_weights_diffusers_cannot_load_are_one_problem_before_launch(tmp_path, demo_clips, breakage, message):
    """No weight file, an unreadable one, tensors of other shapes or missing ones: the
    config check names the folder and what is wrong, from the safetensors headers and the
    model built on the meta device (before any weights load or any run folder exists)."""
    root = broken_reference_vae(tmp_path / "ref_vae", breakage)
    config = load_config(TEST_CONFIG, reference_vae_options(root, demo_clips))
    with pytest.raises(
        UserError, match=rf"^invalid config: reference VAE {re.escape(str(root / 'vae'))}: {message}"
    ) as err:
        check(config)
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match=message):  # loading it directly says the same
        ReferenceVAE(root, "cogvideox", dtype="fp32")


@pytest.mark.parametrize(
    "text, holds",
    [("[1]", "a list"), ('"x"', "a string"), ("null", "null"), ("3", "a number")],
    ids=["list", "string", "null", "number"],
)
def test_a_config_json_that_is_not_an_object_is_one_problem(tmp_path, demo_clips, text, holds):
    """Valid JSON that is not an object is no diffusers config: one problem that says what it holds."""
    root = save_tiny_vae(tmp_path / "ref_vae", "cogvideox")
    config_file = root / "vae" / "config.json"
    config_file.write_text(text)
    assert auto_variant("auto", root / "vae") is None
    config = load_config(TEST_CONFIG, reference_vae_options(root, demo_clips))
    with pytest.raises(
        UserError,
        match=rf"^invalid config: ref_vae_path: {re.escape(str(config_file.resolve()))} is not a diffusers "
        rf"config \(a JSON object\); it holds {holds}: point ref_vae_path at",
    ):
        check(config)


def test_a_config_json_that_is_not_json_text_is_one_problem(tmp_path):
    root = save_tiny_vae(tmp_path / "ref_vae", "cogvideox")
    config_file = root / "vae" / "config.json"
    config_file.write_bytes(b"\xff\xfe{")
    assert ref_vae_problems("auto", root / "vae", "taecvx") == [
        f"ref_vae_path: {config_file.resolve()} is not a text file (invalid start byte at byte 0): point "
        "ref_vae_path at a local copy of the video model, whose VAE subfolder (ref_vae_subfolder) holds it"
    ]


def test_a_config_json_value_of_the_wrong_kind_is_one_problem(tmp_path):
    """A number where the class's config has a list: one problem naming the file."""
    root = save_tiny_vae(tmp_path / "ref_vae", "cogvideox")
    config_file = root / "vae" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "block_out_channels": 5}))
    assert ref_vae_problems("auto", root / "vae", "taecvx") == [
        f"{config_file}: a value there is of the wrong kind for an AutoencoderKLCogVideoX config (object of type "
        "'int' has no len()): is the file complete and from this model?"
    ]


@pytest.mark.parametrize("breakage", ["wrong shapes", "a missing tensor"])
def test_pickled_weights_diffusers_cannot_load_are_one_line_when_loading(tmp_path, breakage):
    """A .bin weight file (whose shapes need the file loaded): what diffusers refuses or
    would leave random is a UserError naming the folder when it loads."""
    from diffusers import AutoencoderKLCogVideoX

    root = save_tiny_vae(tmp_path / "ref_vae", "cogvideox")
    folder = root / "vae"
    (folder / "diffusion_pytorch_model.safetensors").unlink()
    vae = AutoencoderKLCogVideoX.from_pretrained(save_tiny_vae(tmp_path / "good", "cogvideox"), subfolder="vae")
    vae.save_pretrained(folder, safe_serialization=False)
    tensors = torch.load(folder / "diffusion_pytorch_model.bin", weights_only=True)
    if breakage == "wrong shapes":
        tensors["decoder.conv_in.conv.bias"] = torch.zeros(5)
    else:
        del tensors["decoder.conv_in.conv.bias"]
    torch.save(tensors, folder / "diffusion_pytorch_model.bin")
    assert weight_problems("cogvideox", folder) == []  # its shapes are not read before loading
    message = (
        r"decoder.conv_in.conv.bias expected shape torch.Size\(\[4\]\), but got torch.Size\(\[5\]\)"
        if breakage == "wrong shapes"
        else r"its weights lack 1 tensors of the AutoencoderKLCogVideoX .* \(the first: decoder.conv_in.conv.bias\), "
        r"which diffusers left random"
    )
    with pytest.raises(
        UserError, match=rf"^reference VAE {re.escape(str(folder))}: .*{message}.*: are its config.json and weights"
    ):
        ReferenceVAE(root, "cogvideox", dtype="fp32")


@pytest.mark.slow  # a training process
def test_training_refuses_unloadable_weights_in_one_line_before_the_run_folder(tmp_path, demo_clips):
    """``python -m taehv_train.training.taehv_train`` with weights of other shapes: exit 2, one error
    line naming the folder and the tensor, and no run folder."""
    root = broken_reference_vae(tmp_path / "ref_vae", "wrong shapes")
    result = subprocess.run(
        [
            sys.executable,
            *TRAIN,
            "--config",
            TEST_CONFIG,
            f"--output_dir={tmp_path / 'out'}",
            *reference_vae_options(root, demo_clips),
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"reference VAE {root / 'vae'}: 1 of the" in errors[0]
    assert "decoder.conv_in.conv.bias, is [5] there and [4] in the model" in errors[0]
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def taecvx_weights(tmp_path_factory) -> Path:
    """A fresh taecvx saved once, read by the inference runs below."""
    return save_weights(TAEHV(variant="taecvx"), tmp_path_factory.mktemp("taecvx") / "taecvx.pth")


@pytest.mark.parametrize(
    "breakage, message",
    [
        ("no weights", "no weights next to its config.json"),
        ("wrong shapes", "decoder.conv_in.conv.bias, is [5] there and [4] in the model"),
        ("config list", "config.json is not a diffusers config (a JSON object); it holds a list"),
    ],
)
def test_inference_refuses_an_unloadable_reference_vae_in_one_line(
    tmp_path, demo_clips, taecvx_weights, capsys, breakage, message
):
    """``inference.py --use_ref_vae`` (its ``__main__``: ``exit_on_user_error(main)``) with a
    folder diffusers cannot load: exit 2 and one line naming the folder."""
    if breakage == "config list":
        root = save_tiny_vae(tmp_path / "ref_vae", "cogvideox")
        (root / "vae" / "config.json").write_text("[1]")
    else:
        root = broken_reference_vae(tmp_path / "ref_vae", breakage)
    clip = Path(demo_clips["root"]) / json.loads(Path(demo_clips["train"]).read_text())["list"][0]["path"]
    args = [
        "--model_path",
        str(taecvx_weights),
        "--videos",
        str(clip),
        "--n_frames=9",
        "--height=32",
        "--width=32",
        "--num_samples=1",
        "--use_ref_vae",
        f"--ref_vae_path={root}",
        f"--output_dir={tmp_path / 'eval'}",
    ]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        exit_on_user_error(inference.main, args)
    stderr = capsys.readouterr().err
    assert exit_info.value.code == EXIT_USER_ERROR
    assert stderr.startswith("error: ") and stderr.count("\n") == 1
    assert str(root / "vae") in stderr and message in stderr
    assert not (tmp_path / "eval").exists()  # no empty output folder left behind
