"""inference.py on the shared clips: metrics, alignment, outputs, and the report in Chromium."""

from __future__ import annotations

import json
import math
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import av
import cv2
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_dataset import fifos, write_audio_only_mp4, write_huge_header_png, write_index_video, write_rgba

from conftest import REPO_ROOT
from taehv_train.common.clips import VideoClipDataset, frames_to_unit
from taehv_train.common.metrics import (
    frame_psnr,
    lpips_unavailable_reason,
    video_mse,
    video_psnr,
    video_sharpness,
    video_ssim,
    video_temporal_error,
)
from taehv_train.models.frames import plan_frames
from taehv_train.models.taehv import TAEHV
from taehv_train.models.weights import save_weights

pytestmark = pytest.mark.slow  # inference.py processes

INFERENCE = str(REPO_ROOT / "inference.py")
CLIPS = ["udacity_vehdet_test_video.mp4", "gopro_max_heromode.mp4"]


@pytest.fixture
def run_inference(capsys, monkeypatch):
    """``python inference.py ARGS`` run in this process: the script itself as ``__main__``
    (its entry point, the user-error handling included) without the seconds of imports a
    fresh process spends; its exit status, stdout and stderr. A crash raises here and fails
    the test; `evaluation` and `test_debug_keeps_the_traceback` start real processes."""

    def run(*args: str) -> subprocess.CompletedProcess:
        monkeypatch.setattr(sys, "argv", [INFERENCE, *args])
        capsys.readouterr()
        try:
            runpy.run_path(INFERENCE, run_name="__main__")
            status = 0
        except SystemExit as stop:
            status = stop.code or 0
        captured = capsys.readouterr()
        return subprocess.CompletedProcess([INFERENCE, *args], status, captured.out, captured.err)

    return run


@pytest.fixture(scope="module")
def real_clip(videos_dir) -> torch.Tensor:
    """(1, 17, 3, 64, 96) frames of a real driving clip in [0, 1]."""
    ds = VideoClipDataset(annotation_file=videos_dir, n_frames=17, height=64, width=96, mode="val")
    index = next(i for i in range(len(ds)) if ds.clips.path(i).endswith(CLIPS[0]))
    return frames_to_unit(ds[index]["frames"].unsqueeze(0), "cpu")


def ssim_reference(x: torch.Tensor, y: torch.Tensor) -> float:
    """Independent SSIM: Gaussian window 11, sigma 1.5, K1=0.01, K2=0.03, over the whole
    image with reflected borders (the convention torchmetrics documents)."""
    coords = torch.arange(11, dtype=torch.float64) - 5
    g = torch.exp(-(coords**2) / (2 * 1.5**2))
    window = (g[:, None] * g[None, :] / g.sum() ** 2).expand(x.shape[1], 1, 11, 11)
    x, y = x.double(), y.double()
    blur = lambda t: F.conv2d(F.pad(t, (5, 5, 5, 5), mode="reflect"), window, groups=x.shape[1])  # noqa: E731
    mx, my = blur(x), blur(y)
    sxx, syy, sxy = blur(x * x) - mx**2, blur(y * y) - my**2, blur(x * y) - mx * my
    c1, c2 = 0.01**2, 0.03**2
    s = ((2 * mx * my + c1) * (2 * sxy + c2)) / ((mx**2 + my**2 + c1) * (sxx + syy + c2))
    return float(s.mean())


def test_metrics_match_independent_computation(real_clip):
    target = real_clip
    noisy = (target + 0.03 * torch.randn(target.shape, generator=torch.Generator().manual_seed(0))).clamp(0, 1)
    mse = float(((noisy - target) ** 2).mean())
    assert float(video_mse(noisy, target)[0]) == pytest.approx(mse, rel=1e-5)
    assert float(video_psnr(noisy, target)[0]) == pytest.approx(10 * math.log10(1 / mse), abs=1e-3)
    assert float(video_ssim(noisy, target)[0]) == pytest.approx(ssim_reference(noisy[0], target[0]), abs=2e-3)
    diffs = (noisy[0, 1:] - noisy[0, :-1]) - (target[0, 1:] - target[0, :-1])
    assert float(video_temporal_error(noisy, target)[0]) == pytest.approx(float(diffs.abs().mean()), rel=1e-5)


def test_sharpness_is_one_for_the_original_lower_when_blurred_higher_with_noise(real_clip):
    """The share of high-frequency energy kept: PSNR rewards a blurred reconstruction,
    sharpness says it lost detail; noise adds high frequencies the original lacks."""
    blur = torch.full((3, 1, 3, 3), 1 / 9)
    blurred = F.conv2d(F.pad(real_clip[0], (1, 1, 1, 1), mode="replicate"), blur, groups=3)[None]
    noisy = (real_clip + 0.08 * torch.randn(real_clip.shape, generator=torch.Generator().manual_seed(0))).clamp(0, 1)

    def laplacian(v):
        return (
            v[0, :, :, :-2, 1:-1]
            + v[0, :, :, 2:, 1:-1]
            + v[0, :, :, 1:-1, :-2]
            + v[0, :, :, 1:-1, 2:]
            - 4 * v[0, :, :, 1:-1, 1:-1]
        )

    assert float(video_sharpness(real_clip, real_clip)[0]) == pytest.approx(1.0)
    expected = float(laplacian(blurred).square().sum() / laplacian(real_clip).square().sum())
    assert float(video_sharpness(blurred, real_clip)[0]) == pytest.approx(expected, rel=1e-5)
    assert expected < 0.5 and float(video_psnr(blurred, real_clip)[0]) > float(video_psnr(noisy, real_clip)[0])
    assert float(video_sharpness(noisy, real_clip)[0]) > 1.1


@pytest.mark.parametrize("chunk_frames", [1, 4, 16])
def test_chunked_metrics_equal_unchunked(real_clip, chunk_frames):
    """Metrics computed over chunks of frames (inference's memory bound) equal the metrics of
    the whole clip at once: summed squared errors, frame-weighted SSIM means, and
    frame differences across chunk boundaries counted once."""
    target = real_clip.repeat(2, 1, 1, 1, 1)
    noisy = (target + 0.05 * torch.randn(target.shape, generator=torch.Generator().manual_seed(2))).clamp(0, 1)
    whole = target.shape[1]
    for metric in (video_mse, video_psnr, frame_psnr, video_ssim, video_temporal_error, video_sharpness):
        chunked, unchunked = metric(noisy, target, chunk_frames=chunk_frames), metric(noisy, target, chunk_frames=whole)
        assert chunked.shape == unchunked.shape
        torch.testing.assert_close(chunked, unchunked, rtol=1e-5, atol=1e-5, msg=metric.__name__)


def test_shifted_frames_score_worse(real_clip):
    plan = plan_frames(17)
    decoded = (real_clip + 0.02 * torch.randn(real_clip.shape, generator=torch.Generator().manual_seed(1))).clamp(0, 1)
    aligned = video_psnr(*plan.aligned(decoded, real_clip))
    shifted = torch.cat([decoded[:, :1], decoded[:, :-1]], 1)  # decoded frame i shows input frame i-1
    assert float(video_psnr(*plan.aligned(shifted, real_clip))) < float(aligned) - 3
    with pytest.raises(ValueError, match="plan is for 17 -> 17"):
        plan.aligned(decoded[:, 3:], real_clip)


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = TAEHV(variant="taecvx")
    return save_weights(model, tmp_path_factory.mktemp("model") / "final_model.safetensors")


@pytest.fixture(scope="module")
def ref_vae(tmp_path_factory) -> Path:
    from diffusers import AutoencoderKLCogVideoX

    root = tmp_path_factory.mktemp("cogvideox")
    torch.manual_seed(0)
    AutoencoderKLCogVideoX(
        block_out_channels=(16, 16, 32, 32),
        latent_channels=16,
        layers_per_block=1,
        norm_num_groups=8,
        down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4,
    ).save_pretrained(root / "vae")
    return root


@pytest.fixture(scope="module")
def evaluation(tmp_path_factory, weights, ref_vae, videos_dir) -> Path:
    out = tmp_path_factory.mktemp("results")
    args = [
        sys.executable,
        INFERENCE,
        "--model_path",
        str(weights),
        "--videos",
        *[str(videos_dir / c) for c in CLIPS],
        "--num_samples",
        "2",
        "--n_frames",
        "9",
        "--height",
        "64",
        "--width",
        "96",
        "--use_ref_vae",
        "--ref_vae_path",
        str(ref_vae),
        "--output_dir",
        str(out),
    ]
    result = subprocess.run(args, capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Final Evaluation Results" in result.stdout and "Speed-up" in result.stdout
    return out


def test_outputs_and_schema(evaluation):
    metrics = json.loads((evaluation / "metrics.json").read_text())
    assert len(metrics["samples"]) == 2 and metrics["skipped"] == []
    assert metrics["settings"]["compared_frames"] == 9 and metrics["settings"]["stride"] == 1
    for sample in metrics["samples"]:
        for who in ("taehv", "reference"):
            for key in ("mse", "psnr", "ssim", "sharpness", "temporal_error", "encode_s", "decode_s"):
                assert math.isfinite(sample[who][key]), (who, key)
        assert sample["latent_shape"] == [1, 3, 16, 8, 12]
    comparison = metrics["summary"]["comparison"]
    assert {"encode_speedup", "decode_speedup", "total_speedup", "psnr_gap_db", "ssim_gap"} <= comparison.keys()
    assert metrics["summary"]["taehv"]["psnr"]["mean"] == pytest.approx(
        np.mean([s["taehv"]["psnr"] for s in metrics["samples"]])
    )
    for i in range(2):
        # the side-by-side is enlarged x4 (nearest) to at least 256 px high, so its labels are legible
        for kind, (width, height) in (("original", (96, 64)), ("reconstructed", (96, 64)), ("comparison", (768, 256))):
            path = evaluation / "comparison_videos" / f"test_{i}_{kind}.mp4"
            with av.open(str(path)) as container:
                stream = container.streams.video[0]
                assert stream.codec_context.name == "h264"
                frames = [f for f in container.decode(stream)]
            assert len(frames) == 9 and (frames[0].width, frames[0].height) == (width, height)
        image = cv2.imread(str(evaluation / "latent_visualizations" / f"test_{i}_latents.png"))
        assert image is not None and image.std() > 0
        sample = metrics["samples"][i]
        for who in ("taehv", "reference"):
            per_frame = sample[who]["psnr_per_frame"]
            assert len(per_frame) == 9 and np.mean(per_frame) == pytest.approx(sample[who]["psnr"], abs=3)
        # stills: 3 frames x (original | TAEHV | reference | difference), 64x96 tiles enlarged to 256x384
        stills = cv2.imread(str(evaluation / sample["files"]["stills_png"]))
        assert sample["files"]["stills_frames"] == [0, 4, 8]
        assert stills.shape[1] == 4 * 384 + 3 * 4 and stills.shape[0] > 3 * 256
        poster = cv2.imread(str(evaluation / sample["files"]["poster_png"]))
        assert poster.shape == (256, 768, 3) and poster.std() > 10


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model_path", "nowhere.pth", "--videos", "x.mp4"], "not found"),
        (["--num_samples", "0"], "--num_samples=0 must be in [1, 2147483647]"),
        (["--dtype", "fp16", "--device", "cpu"], "--dtype fp16 needs a CUDA device"),
        (["--use_ref_vae"], "--use_ref_vae needs --ref_vae_path"),
        (["--videos", "missing_clip.mp4"], "video file(s) not found: "),
        ([], "give --videos, --annotation_file/--data_root or --config"),
        (["--output_dir", "/proc/taehv_results"], "cannot write into --output_dir /proc/taehv_results: No such file"),
        (
            ["--model_path", "missing/taecvx.pth"],
            "weight file missing/taecvx.pth not found; fetch it with `curl -L --fail --create-dirs -o "
            "missing/taecvx.pth https://github.com/madebyollin/taehv/raw/main/taecvx.pth` (checkpoints/README.md)",
        ),
        (["--model_path", "missing/mine.pth"], "missing/mine.pth not found; where to get weights: checkpoints/"),
        (
            ["--use_ref_vae", "--ref_vae_path", "missing/CogVideoX-2b"],
            "fetch it with `hf download THUDM/CogVideoX-2b --include 'vae/*' --local-dir missing/CogVideoX-2b` "
            "(checkpoints/README.md)",
        ),
        (["--weights", "final"], "--weights final chooses among a run folder's weights; "),
    ],
)
def test_argument_errors(args, message, weights, tmp_path, videos_dir, run_inference):
    defaults = ["--model_path", str(weights), "--output_dir", str(tmp_path)]
    if "--use_ref_vae" in args or "--output_dir" in args or "--weights" in args:
        defaults += ["--videos", str(videos_dir / CLIPS[0])]
    result = run_inference(*defaults, *args)
    assert_user_error(result, message)


def assert_user_error(result: subprocess.CompletedProcess, message: str, one_line: bool = True) -> None:
    """Exit status 2 and ``message`` on stderr without a traceback; with ``one_line``, the
    error is the last line of stderr and a single line (log lines may precede it)."""
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr and message in result.stderr, result.stderr[-3000:]
    if one_line:
        error = result.stderr[result.stderr.index("error: ") :].rstrip()
        assert "\n" not in error and result.stderr.count("error: ") == 1, result.stderr[-3000:]


@pytest.fixture(scope="module")
def planted(tmp_path_factory, weights) -> dict[str, Path]:
    """Weight files a user may point at: damaged, pickled objects, a plain taehv ``.pth``,
    and our run's taecvx ``final_model.pth`` whose ``config.json`` names its variant."""
    root = tmp_path_factory.mktemp("planted")
    data = weights.read_bytes()
    (root / "truncated.safetensors").write_bytes(data[: len(data) // 2])
    torch.save({"encoder.0.weight": torch.zeros(1), "optimizer": Path("objects")}, root / "pickled.pth")
    save_weights(TAEHV(variant="taehv"), root / "taehv_plain.pth")
    run = root / "run"
    save_weights(TAEHV(variant="taecvx"), run / "final_model.pth")
    (run / "config.json").write_text(json.dumps({"variant": "taecvx"}))
    save_weights(TAEHV(variant="taeltx2_3"), root / "taeltx2_3.pth")
    save_weights(TAEHV(variant="taeh3"), root / "taeh3.pth")
    return {
        "h3": root / "taeh3.pth",
        "truncated": root / "truncated.safetensors",
        "pickled": root / "pickled.pth",
        "plain_pth": root / "taehv_plain.pth",
        "run_pth": run / "final_model.pth",
        "ltx": root / "taeltx2_3.pth",
    }


@pytest.mark.parametrize(
    "model, args, message, one_line",
    [
        ("weights", ["--variant", "taexyz"], "unknown TAE variant 'taexyz'; known variants: taecvx", True),
        (
            "ltx",
            ["--height", "48", "--width", "64"],
            "taeltx2_3 needs multiples of 32 (8 * its patch size 4), e.g. 32x64",
            True,
        ),
        (
            "weights",
            ["--variant", "taehv"],
            "is a taecvx file (its metadata), but --variant taehv was given: drop --variant",
            True,
        ),
        ("run_pth", ["--variant", "taehv"], "is a taecvx file (its run's", True),
        ("plain_pth", ["--variant", "taehv1_5"], "does not fit the taehv1_5 model", False),  # lists each mismatch
        ("truncated", [], "is not a readable safetensors file (damaged or truncated)", True),
        ("pickled", [], "holds objects other than tensors (global: GLOBAL pathlib", True),
        ("weights", ["--n_frames", "41"], "is too short: --n_frames=41 at --stride=1 needs 41 frames", True),
        (
            "h3",
            ["--n_frames", "22", "--stride", "2"],
            "is too short: --n_frames=22 at --stride=2 needs 43 frames",
            True,
        ),
    ],
    ids=[
        "unknown-variant",
        "ltx-size",
        "variant-vs-metadata",
        "variant-vs-run-config",
        "variant-does-not-fit",
        "damaged-safetensors",
        "refused-pickle",
        "clip-too-short",
        "clip-too-short-for-taeh3",
    ],
)
def test_user_errors_exit_2_in_one_line(
    model, args, message, one_line, weights, planted, tmp_path, videos_dir, run_inference
):
    """Weight, variant and data problems end in ``error: ...`` and exit status 2, without a
    traceback, and never advise unpickling a refused file with ``weights_only=False``."""
    path = weights if model == "weights" else planted[model]
    result = run_inference(
        "--model_path",
        str(path),
        "--videos",
        str(videos_dir / CLIPS[0]),
        "--height",
        "32",
        "--width",
        "48",
        "--n_frames",
        "5",
        "--output_dir",
        str(tmp_path),
        *args,
    )
    assert_user_error(result, message, one_line)
    assert "weights_only=False" not in result.stdout + result.stderr


def test_a_checkpoint_still_being_written_names_the_finished_one(weights, tmp_path, videos_dir, run_inference):
    """Training writes ``checkpoints/.tmp-checkpoint-N`` and renames it to ``checkpoint-N``
    once complete: given the folder while it is written, or its file after the rename,
    inference names the finished checkpoint instead of calling the file missing."""
    writing = tmp_path / "checkpoints" / ".tmp-checkpoint-4"
    writing.mkdir(parents=True)
    shutil.copy(weights, writing / "weights.safetensors")
    common = ["--videos", str(videos_dir / CLIPS[0]), "--output_dir", str(tmp_path / "eval")]
    assert_user_error(
        run_inference("--model_path", str(writing), *common),
        f"{writing} is still being written (training writes .tmp-checkpoint-4 and renames it to checkpoint-4 once "
        f"it is complete): use {tmp_path / 'checkpoints' / 'checkpoint-4'} (once it exists; if it never does, an "
        "interrupted save left this behind: use an earlier checkpoint)",
    )
    writing.rename(tmp_path / "checkpoints" / "checkpoint-4")  # the save completes
    result = run_inference("--model_path", str(writing / "weights.safetensors"), *common)
    assert_user_error(
        result, f"use {tmp_path / 'checkpoints' / 'checkpoint-4' / 'weights.safetensors'} (it is there now)"
    )
    assert "checkpoints/README.md" not in result.stderr  # it exists: no advice on fetching it


@pytest.mark.parametrize(
    "variant, size, frames, compared",
    [("taeltx2_3", (32, 64), 9, 9), ("taeh3", (32, 48), 17, 5), ("taeos1_3", (32, 48), 33, 33)],
)
def test_newer_variants_evaluate_by_their_published_file_name(
    variant, size, frames, compared, tmp_path, videos_dir, run_inference
):
    """A published-name .pth of LTX (8k+1 frames, multiples of 32) or H3 (17-frame chunks:
    17 frames decode to 5) evaluates with its own frame plan; taeos1_3 on 33 frames, which
    Open-Sora 1.3's pipeline holds in 10 latents (two 17-frame chunks sharing a frame) where
    taeos1_3 encodes 9, says its scores are of its own latents."""
    path = save_weights(TAEHV(variant=variant), tmp_path / f"{variant}.pth")
    result = run_inference(
        "--model_path",
        str(path),
        "--videos",
        str(videos_dir / CLIPS[0]),
        "--height",
        str(size[0]),
        "--width",
        str(size[1]),
        "--n_frames",
        str(frames),
        "--num_samples",
        "1",
        "--output_dir",
        str(tmp_path / "out"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["model"]["variant"] == variant
    assert (metrics["settings"]["n_frames"], metrics["settings"]["compared_frames"]) == (frames, compared)
    assert len(metrics["samples"][0]["taehv"]["psnr_per_frame"]) == compared
    said = (
        "Open-Sora 1.3's pipeline has 10 latents for 33 frames (its VAE encodes 17-frame chunks sharing a frame, "
        "5 latents each), taeos1_3 encodes them to 9 as one sequence: these scores are of taeos1_3's own latents"
    )
    assert (said in result.stdout) == (variant == "taeos1_3")


def test_debug_keeps_the_traceback(weights, tmp_path, videos_dir):
    command = [
        sys.executable,
        INFERENCE,
        "--model_path",
        str(weights),
        "--variant",
        "taehv",
        "--debug",
        "--videos",
        str(videos_dir / CLIPS[0]),
        "--output_dir",
        str(tmp_path),
    ]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert result.returncode == 1 and "Traceback" in result.stderr and "UserError" in result.stderr


def test_out_of_memory_says_what_to_lower(weights, tmp_path, videos_dir, run_inference, monkeypatch):
    """Running out of memory (here: a decode that raises as CUDA does) ends in one line that
    names the step, the sizes and what to lower, with exit status 2."""
    from taehv_train import inference

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79 GiB"
        )

    monkeypatch.setattr(inference.TAEHV, "decode_video", out_of_memory)
    result = run_inference(
        "--model_path",
        str(weights),
        "--videos",
        str(videos_dir / CLIPS[0]),
        "--height",
        "32",
        "--width",
        "48",
        "--n_frames",
        "5",
        "--output_dir",
        str(tmp_path),
    )
    assert_user_error(
        result,
        "out of memory while warming up on 1 frame(s) of a clip (5 frames at 32x48, "
        "parallel, fp32 on cpu); it asked for 20.00 GiB more: lower --height/--width or "
        "--n_frames; use --sequential",
    )


@pytest.mark.parametrize("source", ["videos", "annotation"])
def test_short_clips_are_skipped_and_reported(source, weights, tmp_path, videos_dir, run_inference):
    """A clip too short for --n_frames at --stride is skipped and listed (metrics.json and
    the report), not replaced by another clip of the list; the stride is recorded. With an
    annotation that gives frame counts the dataset leaves it out up front: listed too, as is
    an entry whose frame count is no positive whole number."""
    clips = [str(videos_dir / c) for c in CLIPS]  # 38 frames (too short for 21 at stride 2), 315 frames
    annotation = tmp_path / "clips.json"
    annotation.write_text(
        json.dumps(
            {
                "list": [{"full_path": c, "frames": n} for c, n in zip(clips, (38, 315))]
                + [{"full_path": clips[1], "frames": -5}]
            }
        )
    )
    data = ["--videos", *clips] if source == "videos" else ["--annotation_file", str(annotation)]
    result = run_inference(
        "--model_path",
        str(weights),
        *data,
        "--n_frames",
        "21",
        "--stride",
        "2",
        "--height",
        "32",
        "--width",
        "48",
        "--sequential",
        "--output_dir",
        str(tmp_path / "out"),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["settings"]["stride"] == 2
    assert [s["source"] for s in metrics["samples"]] == [clips[1]]
    refused = [(clips[1], "refused entry")] if source == "annotation" else []
    assert [(s["source"], s["kind"]) for s in metrics["skipped"]] == [(clips[0], "too short"), *refused]
    if source == "videos":
        assert f"Skipped {clips[0]}" in result.stdout
    report = (tmp_path / "out" / "summary_report.html").read_text()
    assert "Skipped clips" in report and CLIPS[0] in report


def test_stride_defaults_to_the_configs_validation_stride(weights, tmp_path, videos_dir):
    """With --config, clips are read at the stride validation uses, (stride_min + stride_max) // 2;
    without, at stride 1; --stride overrides both."""
    from taehv_train import inference

    config = tmp_path / "config.py"
    config.write_text(
        "from taehv_train.common.config import TrainConfig\n"
        "config = TrainConfig(stride_min=2, stride_max=5, n_frames=5, height=32, width=48)\n"
    )
    model = TAEHV(variant="taecvx")
    for extra, stride in (([], 1), (["--config", str(config)], 3), (["--config", str(config), "--stride", "2"], 2)):
        args = inference.parse_args(
            [
                "--model_path",
                str(weights),
                "--videos",
                str(videos_dir / CLIPS[0]),
                "--height",
                "32",
                "--width",
                "48",
                *extra,
            ]
        )
        config = inference.evaluation_config(args, weights)[0]
        size = inference.frame_size(args, config, model)
        dataset = inference.build_dataset(args, config, size, tmp_path, model.image_channels)
        assert dataset.stride_range == (stride, stride) and dataset.short_clip_policy == "skip"


def chromium() -> str:
    """Path of the Chromium binary; installing it is `make test`'s set-up (target `browser`)."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail(
            "the report test needs Chromium, and neither chromium nor chromium-browser is on PATH: "
            "run `make browser` (as root it installs Debian's chromium) or `apt-get install chromium`"
        )
    return found


PAGE_WIDTH = 1280  # the window the report must fit, difference maps included


def render(page: Path, tmp_path: Path, height: int | None = None) -> tuple[str, np.ndarray | None]:
    """(the DOM once the page's script ran, a screenshot ``height`` pixels high or None) of
    ``page`` in headless Chromium, PAGE_WIDTH pixels wide at scale 1."""
    browser = chromium()
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--no-first-run",
        "--disable-sync",
        "--disable-quic",
        "--force-device-scale-factor=1",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--virtual-time-budget=10000",
    ]
    uri = page.resolve().as_uri()
    dom = subprocess.run(
        [browser, *flags, f"--window-size={PAGE_WIDTH},900", "--dump-dom", uri],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    if height is None:
        return dom, None
    shot = tmp_path / "report.png"
    subprocess.run(
        [browser, *flags, f"--window-size={PAGE_WIDTH},{height}", f"--screenshot={shot}", uri],
        capture_output=True,
        timeout=120,
    )
    return dom, cv2.imread(str(shot))


def shown_stills(dom: str) -> list[dict]:
    """Natural size, size on the page and position of each still picture, as the page's script marked them."""
    found = re.findall(r'data-natural="(\d+)x(\d+)" data-shown="(\d+)x(\d+)" data-at="(\d+),(\d+)"', dom)
    return [dict(zip(("natural_w", "natural_h", "w", "h", "x", "y"), map(int, f))) for f in found]


def assert_fits_the_window_in_its_aspect(dom: str, count: int) -> list[dict]:
    """No part of the page is wider than the window; each of the ``count`` still pictures
    lies inside it at its own aspect ratio, at its own size when that fits."""
    assert int(re.search(r'data-scroll-width="(\d+)"', dom).group(1)) <= PAGE_WIDTH, dom[:2000]
    stills = shown_stills(dom)
    assert len(stills) == count, dom[:3000]
    for still in stills:
        assert still["x"] + still["w"] <= PAGE_WIDTH, still  # its difference column on screen
        assert still["w"] == min(still["natural_w"], 1200), still
        assert abs(still["h"] - still["natural_h"] * still["w"] / still["natural_w"]) <= 1, still
    return stills


def assert_shown_as_written(image: np.ndarray, still: dict, path: Path) -> None:
    """The screenshot's pixels where the page shows a still picture are that picture, scaled
    to its size on the page."""
    expected = cv2.resize(cv2.imread(str(path)), (still["w"], still["h"]), interpolation=cv2.INTER_AREA)
    shown = image[still["y"] : still["y"] + still["h"], still["x"] : still["x"] + still["w"]]
    assert shown.shape == expected.shape and shown.std() > 20  # the stills, not a blank box
    assert np.abs(shown.astype(np.int16) - expected.astype(np.int16)).mean() < 6


def test_report_renders_in_chromium(evaluation, tmp_path):
    """Videos load (with a duration), and the still pictures (4 columns of 384-pixel tiles:
    wider than the column) are scaled to the column at their aspect ratio, inside a
    1280-pixel window: the screenshot's pixels where the page puts the first one are that picture."""
    dom, _ = render(evaluation / "summary_report.html", tmp_path)
    durations = [float(d) for d in re.findall(r'data-duration="([0-9.]+)"', dom)]
    assert len(durations) == 2 and all(d > 0 for d in durations), dom[:2000]
    assert "data-error" not in dom
    assert len(re.findall(r"<video [^>]*poster=\"data:image/png", dom)) == 2  # never black before playing
    assert "PSNR (dB)" in dom and ">frame<" in dom  # the per-frame chart's axis labels
    stills = assert_fits_the_window_in_its_aspect(dom, 2)
    assert all(still["natural_w"] == 4 * 384 + 3 * 4 for still in stills)
    _, image = render(evaluation / "summary_report.html", tmp_path, stills[0]["y"] + stills[0]["h"] + 50)
    assert image is not None and image.std() > 10  # not a blank page
    assert_shown_as_written(image, stills[0], evaluation / "stills" / "test_0_stills.png")


def write_small_clip(source: Path, path: Path, frames: int, height: int, width: int, upright: bool = False) -> None:
    """The first ``frames`` frames of a real landscape clip, turned ``upright`` (portrait) or
    not, resized to ``width x height``."""
    reader = cv2.VideoCapture(str(source))
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 25, (width, height))
    for _ in range(frames):
        ok, frame = reader.read()
        assert ok
        writer.write(cv2.resize(cv2.rotate(frame, cv2.ROTATE_90_CLOCKWISE) if upright else frame, (width, height)))
    writer.release()
    reader.release()


def test_native_size_keeps_each_clips_aspect_and_the_report_fits_1280_px(weights, tmp_path, videos_dir, run_inference):
    """Without a size, a landscape 132x72 clip and a portrait 40x72 clip are each evaluated
    at their own size (every decoded frame against its input frame), their stills keep their
    aspect ratios, and in Chromium the page (the landscape stills 1381 pixels wide) fits a
    1280-pixel window."""
    landscape, portrait = tmp_path / "wide.mp4", tmp_path / "upright.mp4"
    write_small_clip(videos_dir / CLIPS[0], landscape, 5, 72, 132)
    write_small_clip(videos_dir / CLIPS[0], portrait, 5, 72, 40, upright=True)
    result = run_inference(
        "--model_path",
        str(weights),
        "--videos",
        str(landscape),
        str(portrait),
        "--n_frames",
        "5",
        "--output_dir",
        str(tmp_path / "out"),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "5 frames at stride 1, each clip at its own size (cropped to 8 * patch" in result.stdout
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["settings"]["native_size"] and metrics["settings"]["height"] is None
    samples = metrics["samples"]
    assert [(s["height"], s["width"], s["latent_shape"]) for s in samples] == [
        (72, 128, [1, 2, 16, 9, 16]),  # 132 cropped to a multiple of 8
        (72, 40, [1, 2, 16, 9, 5]),
    ]
    assert all(len(s["taehv"]["psnr_per_frame"]) == 5 for s in samples)
    tiles = [cv2.imread(str(tmp_path / "out" / s["files"]["stills_png"])).shape[:2] for s in samples]
    assert tiles[0] == (28 + 3 * (256 + 4), 3 * 455 + 2 * 4)  # 128x72 enlarged to 455x256
    assert tiles[1] == (28 + 3 * (461 + 4), 3 * 256 + 2 * 4)  # 40x72 enlarged to 256x461: upright
    report = (tmp_path / "out" / "summary_report.html").read_text()
    assert "each clip at its own size" in report and "72x128" in report and "72x40" in report
    dom, _ = render(tmp_path / "out" / "summary_report.html", tmp_path)
    stills = assert_fits_the_window_in_its_aspect(dom, 2)
    assert stills[0]["w"] == 1200 and stills[1]["w"] == stills[1]["natural_w"]  # the wide one scaled down
    _, image = render(tmp_path / "out" / "summary_report.html", tmp_path, stills[1]["y"] + stills[1]["h"] + 50)
    for still, sample in zip(stills, samples):
        assert_shown_as_written(image, still, tmp_path / "out" / sample["files"]["stills_png"])


def test_samples_say_their_set_held_out_first_and_spread_needs_several(weights, tmp_path, videos_dir, run_inference):
    """Given a run's config, each sample says whether the run held it out, trained on it or
    neither (metrics.json and the report), held-out clips are evaluated first, a sample the
    model trained on is pointed out, the spread (±) is shown only over several samples, and
    a missing LPIPS is one line with one fix, once, before the samples."""
    trained, held_out, other = (str(videos_dir / name) for name in (CLIPS[0], CLIPS[1], "sam2_01_dog.mp4"))
    for name, clip in (("train.json", trained), ("val.json", held_out)):
        (tmp_path / name).write_text(json.dumps({"list": [{"full_path": clip}]}))
    config = tmp_path / "config.py"
    config.write_text(
        "from taehv_train.common.config import TrainConfig\n"
        f"config = TrainConfig(annotation_file={str(tmp_path / 'train.json')!r}, "
        f"val_annotation_file={str(tmp_path / 'val.json')!r}, height=32, width=48, n_frames=5)\n"
    )

    def evaluate(count: int) -> tuple[subprocess.CompletedProcess, dict, str]:
        out = tmp_path / f"out{count}"
        result = run_inference(
            "--model_path",
            str(weights),
            "--config",
            str(config),
            "--videos",
            trained,
            other,
            held_out,
            "--num_samples",
            str(count),
            "--output_dir",
            str(out),
        )
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        return result, json.loads((out / "metrics.json").read_text()), (out / "summary_report.html").read_text()

    one, metrics, report = evaluate(1)
    assert [(s["source"], s["split"]) for s in metrics["samples"]] == [(held_out, "held-out")]
    assert metrics["summary"]["taehv"]["psnr"]["std"] is None
    assert "±" not in one.stdout and "±" not in report and "one sample: no spread" in report
    assert "held-out clip, 32x48" in report and "trained on" not in one.stdout
    reason = lpips_unavailable_reason()
    lpips_lines = [line for line in (one.stdout + one.stderr).splitlines() if "LPIPS is left out" in line]
    if reason is None:
        assert lpips_lines == []
    else:
        assert lpips_lines == [f"⚠️  LPIPS is left out: {reason}"] and reason.count("pip install") == 1
        assert one.stdout.index("LPIPS is left out") < one.stdout.index("Processing")

    three, metrics, report = evaluate(3)
    splits = [(s["source"], s["split"]) for s in metrics["samples"]]
    assert splits == [(held_out, "held-out"), (other, "neither"), (trained, "training")]
    assert "1 of the 3 samples are clips the model was trained on" in three.stdout
    assert "PSNR (dB): " in three.stdout and " ± " in three.stdout.split("PSNR (dB): ")[1].splitlines()[0]
    assert metrics["summary"]["taehv"]["psnr"]["std"] > 0 and "mean ± standard deviation" in report
    assert "<td>training</td>" in report and "<td>neither</td>" in report


@pytest.mark.parametrize("where", ["final_model.pth", "best_model/weights.pth"])
def test_the_variant_of_our_own_pth_comes_from_its_run_config(where, tmp_path):
    """A ``.pth`` file carries no metadata and ``weights.pth`` names no variant: the run's
    ``config.json`` (next to ``final_model.pth``, one level above ``best_model/``) says it."""
    import argparse

    from taehv_train import inference

    run = tmp_path / "run"
    save_weights(TAEHV(variant="taehv1_5"), run / where)
    (run / "config.json").write_text(json.dumps({"variant": "taehv1_5"}))
    args = argparse.Namespace(
        model_path=str(run / where), weights=None, variant=None, channels_last=False, compile=False
    )
    model, chosen = inference.load_model(args, torch.device("cpu"), torch.float32)
    assert chosen.path == run / where and model.variant == "taehv1_5" and chosen.step is None
    assert chosen.told == f"{where} of run run: step not recorded"


def test_file_names_with_html_are_escaped_in_the_report(weights, tmp_path, videos_dir, run_inference):
    """Clip names are data, not markup: a kept and a skipped clip whose names hold HTML and
    JavaScript appear escaped in the report (and as they are in metrics.json)."""
    kept, short = tmp_path / "<img src=x onerror=alert(1)>.mp4", tmp_path / "<b onmouseover=alert(2)>short.mp4"
    shutil.copy(videos_dir / CLIPS[1], kept)
    shutil.copy(videos_dir / CLIPS[0], short)  # 38 frames: too short for 21 at stride 2
    result = run_inference(
        "--model_path",
        str(weights),
        "--videos",
        str(kept),
        str(short),
        "--n_frames",
        "21",
        "--stride",
        "2",
        "--height",
        "32",
        "--width",
        "48",
        "--sequential",
        "--output_dir",
        str(tmp_path / "out"),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = (tmp_path / "out" / "summary_report.html").read_text()
    assert "<img src=x" not in report and "<b onmouseover" not in report
    assert "&lt;img src=x onerror=alert(1)&gt;.mp4" in report and "&lt;b onmouseover=alert(2)&gt;short.mp4" in report
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert [s["source"] for s in metrics["samples"]] == [str(kept)] and metrics["skipped"][0]["source"] == str(short)


def test_hostile_clips_are_skipped_and_reported_and_images_are_clips(weights, tmp_path, run_inference):
    """A folder holding an audio-only MP4, a PNG whose header claims 100000x100000 pixels and
    a FIFO beside a video and a PNG, without --height/--width: each clip that can be read is
    evaluated at its own size, the PNG is a clip for an RGB model too (its alpha dropped),
    and the other three are skipped with their reasons, the FIFO unopened."""
    folder = tmp_path / "clips"
    folder.mkdir()
    write_audio_only_mp4(folder / "a_audio.mp4")
    write_huge_header_png(folder / "b_huge.png")
    write_index_video(folder / "d_clip.mp4", 4, height=24, width=40)
    write_rgba(folder / "e_still.png")
    with fifos(folder / "c_pipe.mp4"):
        result = run_inference(
            "--model_path",
            str(weights),
            "--videos",
            str(folder),
            "--n_frames",
            "1",
            "--output_dir",
            str(tmp_path / "out"),
        )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert (metrics["settings"]["height"], metrics["settings"]["width"]) == (None, None)  # each clip its own
    assert [(Path(s["source"]).name, s["height"], s["width"]) for s in metrics["samples"]] == [
        ("d_clip.mp4", 24, 40),
        ("e_still.png", 48, 64),
    ]
    assert [(Path(s["source"]).name, s["reason"]) for s in metrics["skipped"]] == [
        ("a_audio.mp4", "no video stream: it has only audio streams"),
        ("b_huge.png", "too large: its header claims more pixels than OpenCV reads (CV_IO_MAX_IMAGE_PIXELS)"),
        ("c_pipe.mp4", "not a regular file: a FIFO (named pipe)"),
    ]


@pytest.mark.parametrize(
    "write, message",
    [
        (
            lambda p: write_index_video(p, 9, height=2, width=2),
            "error: the clip is too small: clip.mp4 is 2x2 pixels, smaller than the 8x8 taecvx needs at least "
            "(multiples of 8, 8 * its patch size 1): give --height and --width (multiples of 8) to evaluate it resized",
        ),
        (
            write_audio_only_mp4,
            "error: the clip could not be used (e.g. clip.mp4: no video stream: it has only audio streams); check "
            "the videos or the annotation",
        ),
    ],
    ids=["2x2-video", "audio-only"],
)
def test_a_clip_that_gives_no_frame_size_is_one_line(write, message, weights, tmp_path, run_inference):
    """Without --height/--width each clip gives its own size: a clip smaller than the model's
    multiple, or no readable clip at all, ends in one line saying what to do."""
    write(tmp_path / "clip.mp4")
    result = run_inference(
        "--model_path", str(weights), "--videos", str(tmp_path / "clip.mp4"), "--output_dir", str(tmp_path / "out")
    )
    assert_user_error(result, message)
    assert result.stderr.rstrip().endswith(message)  # no advice beyond it
    assert not (tmp_path / "out").exists()  # no empty output folder left behind


def test_help_keeps_the_examples_lines_and_shows_num_samples_default(capsys):
    from taehv_train import inference

    with pytest.raises(SystemExit) as exit_info:
        inference.parse_args(["--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert "--use_ref_vae \\\n        --ref_vae_path checkpoints/CogVideoX-2b" in help_text  # copyable, on two lines
    assert re.search(r"--num_samples NUM_SAMPLES\s+how many clips to evaluate \(default: 10;", help_text)
