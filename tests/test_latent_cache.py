"""Reference-latent cache (built by training/build_latent_cache.py, read by
training/data/latent_cache.py): built through the builder's entry point in this process
for the demo clips and a tiny CogVideoX VAE, then compared with the latents training would
compute online; the full tier also finishes an interrupted cache and compares it with the
first build, and finishes one that a full disk stopped with the command it printed, in a
subprocess.
(Two processes, under ``accelerate launch`` or torchrun, run the same code
with a shard partition; left out here to keep this file fast.)

The annotation has one missing file, so one sample is always a replacement clip.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState

from conftest import REPO_ROOT, clip_shard, save_tiny_vae
from taehv_train.base.errors import UserError
from taehv_train.common.clips import VideoClipDataset, VideoDataError, frames_to_unit
from taehv_train.common.config import TrainConfig, load_config
from taehv_train.common.reference_vae import ReferenceVAE
from taehv_train.training.annotate.annotation_files import write_annotation
from taehv_train.training.build_latent_cache import entry_point, main
from taehv_train.training.data.clip_loader import build_dataloader
from taehv_train.training.data.latent_cache import CachedLatentDataset, LatentCache, latent_sample_generator
from taehv_train.training.data.loading import build_datasets
from train_runs import TEST_CONFIG, one_line_error, refused_here

MISSING = 5  # index of the missing file in the annotation (6 clips: shards {0, 1}, {2, 3}, {4, 5})
LATENT_SHAPE = (3, 16, 4, 4)  # 9 frames at 32x32 -> 3 latent frames of 16 x 4 x 4


@pytest.fixture(scope="module")
def tiny_cogvideox_vae(tmp_path_factory) -> Path:
    """The smallest CogVideoX VAE (``conftest.TINY_VAES``: its 16 latent channels and its
    compression) saved by diffusers: every latent here is computed with it."""
    return save_tiny_vae(tmp_path_factory.mktemp("cogvideox"), "cogvideox")


@pytest.fixture(scope="module")
def data(demo_clips, tmp_path_factory) -> dict:
    """The demo training clips plus an entry whose file does not exist."""
    entries = json.loads(demo_clips["train"].read_text())["list"]
    annotation = tmp_path_factory.mktemp("annotation") / "train_with_missing.json"
    write_annotation(annotation, entries + [{"path": "videos/missing.mp4", "frames": 12}])
    assert len(entries) == MISSING
    return {**demo_clips, "train": annotation}


def overrides(data: dict, vae: Path, *extra: str) -> list[str]:
    """Config overrides shared by the CLI runs and the in-process checks."""
    return [
        f"--data_root={data['root']}",
        f"--annotation_file={data['train']}",
        f"--val_annotation_file={data['val']}",
        f"--ref_vae_path={vae}",
        "--ref_vae_dtype=fp32",
        "--latent_cache_epochs=2",
        "--max_failure_fraction=0.5",
        *extra,
    ]


def cli_args(data: dict, vae: Path, output: Path, *extra: str) -> list[str]:
    return [
        "--config",
        TEST_CONFIG,
        *overrides(data, vae),
        "--output",
        str(output),
        "--shard_size",
        "2",
        "--dtype",
        "fp32",
        *extra,
    ]


def build_here(args: list[str]) -> None:
    """The builder's entry point in this process, with Accelerate's process state as a new
    process has it, and reset afterwards."""
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        main(args)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def online(vae: ReferenceVAE, frames: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """What training computes for one clip: uint8 frames -> [0, 1] NTCHW -> raw latents."""
    return vae.encode(frames_to_unit(frames[None], "cpu"), generator)[0]


def dataset_and_vae(data: dict, vae_path: Path, *extra: str) -> tuple[TrainConfig, VideoClipDataset, ReferenceVAE]:
    """The config, training set and reference VAE that training would build."""
    config = load_config(TEST_CONFIG, overrides(data, vae_path, *extra))
    vae = ReferenceVAE.from_config(config, "cpu")
    return config, build_datasets(config)[0], vae


def shard_files(directory: Path) -> dict[str, Path]:
    return {p.relative_to(directory).as_posix(): p for p in sorted(directory.glob("epoch*/shard*.safetensors"))}


@pytest.fixture(scope="module")
def sampled_cache(data, tiny_cogvideox_vae, tmp_path_factory) -> Path:
    """One process, latent_dist.sample(), one clip per VAE call (bit-exact comparisons)."""
    output = tmp_path_factory.mktemp("sampled") / "cache"
    build_here(cli_args(data, tiny_cogvideox_vae, output, "--batch_size", "1"))
    return output


def test_sampled_latents_equal_online_latents(sampled_cache, data, tiny_cogvideox_vae):
    config, dataset, vae = dataset_and_vae(data, tiny_cogvideox_vae)
    cache = LatentCache(sampled_cache)
    cache.check(config, len(dataset))
    assert list(shard_files(sampled_cache)) == [
        f"epoch00{e}/shard00000{k}.safetensors" for e in (0, 1) for k in (0, 1, 2)
    ]
    for epoch in (0, 1):
        dataset.set_epoch(epoch)
        for index in range(len(dataset)):
            expected = online(vae, dataset[index]["frames"], latent_sample_generator(config.seed, epoch, index))
            cached = cache.latents(epoch, index)
            assert cached.dtype == torch.float32 and cached.shape == LATENT_SHAPE
            assert torch.equal(cached, expected), (epoch, index)
            assert torch.equal(cache.latents(epoch + 2, index), cached)  # epochs repeat modulo the cached ones
    assert not torch.equal(cache.latents(0, 0), cache.latents(1, 0))  # each epoch has its own draws


def test_mode_latents_equal_online_latents(data, tiny_cogvideox_vae, tmp_path):
    output = tmp_path / "cache"
    build_here(cli_args(data, tiny_cogvideox_vae, output, "--ref_latent_sample=false", "--batch_size", "1"))
    config, dataset, vae = dataset_and_vae(data, tiny_cogvideox_vae, "--ref_latent_sample=false")
    cache = LatentCache(output)
    cache.check(config, len(dataset))
    for epoch in (0, 1):
        dataset.set_epoch(epoch)
        for index in range(len(dataset)):
            assert torch.equal(cache.latents(epoch, index), online(vae, dataset[index]["frames"])), (epoch, index)


@pytest.mark.slow
def test_rerun_computes_only_missing_shards(sampled_cache, data, tiny_cogvideox_vae, tmp_path):
    """An interrupted cache finished with three clips per VAE call: complete shards are
    untouched, missing ones come back with the same latents."""
    output = tmp_path / "cache"
    shutil.copytree(sampled_cache, output)
    deleted = [
        "epoch000/shard000000.safetensors",
        "epoch000/shard000002.safetensors",
        "epoch001/shard000001.safetensors",
    ]
    for name in deleted:
        (output / name).unlink()
    config, dataset, _ = dataset_and_vae(data, tiny_cogvideox_vae)
    with pytest.raises(UserError, match="incomplete: 3 shard"):
        LatentCache(output).check(config, len(dataset))
    kept = {name: path.stat().st_mtime_ns for name, path in shard_files(output).items()}

    # Indices 0, 1 and 4 of epoch 0 share a batch that straddles two missing shards.
    build_here(cli_args(data, tiny_cogvideox_vae, output, "--batch_size", "3"))
    files = shard_files(output)
    assert sorted(files) == sorted(shard_files(sampled_cache))
    assert {name: files[name].stat().st_mtime_ns for name in kept} == kept
    reference, rerun = LatentCache(sampled_cache), LatentCache(output)
    rerun.check(config, len(dataset))
    for epoch, index in [(0, 0), (0, 1), (0, 4), (0, 5), (1, 2), (1, 3)]:
        # Same per-sample noise whatever the batch; batched CPU convolutions differ from
        # single-clip ones in the last bits only.
        torch.testing.assert_close(rerun.latents(epoch, index), reference.latents(epoch, index), rtol=0, atol=1e-5)
        assert rerun.clip(epoch, index) == reference.clip(epoch, index)


def test_manifest_mismatch_is_a_clear_error(sampled_cache, data, tiny_cogvideox_vae, capsys):
    before = (sampled_cache / "manifest.json").read_text()
    with pytest.raises(SystemExit) as exit_info:
        entry_point(cli_args(data, tiny_cogvideox_vae, sampled_cache, "--stride_max=1"))
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert "stride_max: cache 2, now 1" in message and "delete" in message and "another --output" in message
    assert (sampled_cache / "manifest.json").read_text() == before

    config, dataset, _ = dataset_and_vae(data, tiny_cogvideox_vae)
    cache = LatentCache(sampled_cache)
    with pytest.raises(UserError, match=r"n_frames: cache 9, now 17") as error:
        cache.check(config.replace(n_frames=17, hflip=False), len(dataset))
    assert "hflip: cache True, now False" in str(error.value)
    with pytest.raises(UserError, match=r"n_clips: cache 6, now 7"):
        cache.check(config, len(dataset) + 1)


def test_cached_dataset_gives_the_latents_of_a_replaced_clip(sampled_cache, data, tiny_cogvideox_vae):
    config, dataset, vae = dataset_and_vae(data, tiny_cogvideox_vae)
    wrapped = CachedLatentDataset.from_config(dataset, config.replace(latent_cache_dir=str(sampled_cache)))
    for epoch in (1, 2, 3):
        wrapped.set_epoch(epoch)
        assert (wrapped.epoch, dataset.epoch) == (epoch, epoch % 2)
        item = wrapped[MISSING]
        assert item["failures"] >= 1 and item["index"] != MISSING
        assert item["latents"].shape == LATENT_SHAPE
        generator = latent_sample_generator(config.seed, epoch % 2, MISSING)
        assert torch.equal(item["latents"], online(vae, item["frames"], generator))
        # The replacement's crop and window come from the requested index's draws: the same
        # clip requested directly is another sample, with other latents.
        direct = dataset[item["index"]]
        assert not torch.equal(direct["frames"], item["frames"])

    dataset.set_epoch(5)  # bypassing the wrapper would pair epoch-5 frames with cached epoch 1
    with pytest.raises(ValueError, match="set_epoch"):
        wrapped[0]

    loader = build_dataloader(wrapped, batch_size=2, num_workers=0, shuffle=True, seed=config.seed)
    loader.sampler.set_epoch(2)
    assert dataset.epoch == 0
    batches = list(loader)
    assert len(batches) == 3 and all(b["latents"].shape == (2, *LATENT_SHAPE) for b in batches)


def test_cached_dataset_refuses_a_clip_that_changed_since_caching(sampled_cache, data, tiny_cogvideox_vae, tmp_path):
    """The missing file appears after caching: sample 5 now uses its own clip, whose
    latents the cache does not hold."""
    root = tmp_path / "data"
    shutil.copytree(data["root"], root)
    shutil.copy(root / "videos" / "clip_00000.mp4", root / "videos" / "missing.mp4")
    _, dataset, _ = dataset_and_vae({**data, "root": root}, tiny_cogvideox_vae)
    wrapped = CachedLatentDataset(dataset, LatentCache(sampled_cache))
    assert wrapped[0]["latents"].shape == LATENT_SHAPE
    with pytest.raises(VideoDataError, match="changed since the cache was built"):
        wrapped[MISSING]


def test_errors_exit_with_status_2_and_say_what_to_set(data, tiny_cogvideox_vae, tmp_path, capsys):
    args = cli_args(data, tiny_cogvideox_vae, tmp_path / "cache")
    with pytest.raises(SystemExit) as exit_info:
        entry_point([*args, "--ref_vae_path="])
    assert exit_info.value.code == 2 and "set ref_vae_path" in capsys.readouterr().err

    without_output = args[: args.index("--output")] + args[args.index("--output") + 2 :]
    with pytest.raises(SystemExit) as exit_info:
        entry_point(without_output)
    assert exit_info.value.code == 2 and "--output DIR or set latent_cache_dir" in capsys.readouterr().err

    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "notes.txt").write_text("not a cache")
    with pytest.raises(SystemExit) as exit_info:
        entry_point(args)
    assert exit_info.value.code == 2 and "not empty" in capsys.readouterr().err
    assert not (tmp_path / "cache" / "manifest.json").exists()


@pytest.mark.slow
@pytest.mark.skipif(
    subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0,
    reason="needs unshare -rm (a private mount namespace) for a small tmpfs",
)
def test_a_full_disk_is_one_line_and_its_command_finishes_the_cache(data, tiny_cogvideox_vae, tmp_path):
    """A real full disk: the cache folder is on a 16 KiB tmpfs, room for the manifest and
    some of the 6 shards. The build ends in one line (shards written, what the rest needs,
    what is free, the command), leaves no partial shard, and once there is room the printed
    command writes the missing shards."""
    disk, logs = tmp_path / "disk", tmp_path / "logs"
    disk.mkdir(), logs.mkdir()
    build = shlex.join(
        [
            sys.executable,
            "-m",
            "taehv_train.training.build_latent_cache",
            *cli_args(data, tiny_cogvideox_vae, disk / "cache"),
        ]
    )
    script = f"""
        mount -t tmpfs -o size=16k none {disk}
        {build} > {logs}/full.out 2> {logs}/full.err; echo $? > {logs}/full.status
        ls -A {disk}/cache/epoch000 {disk}/cache/epoch001 > {logs}/kept 2>&1
        mount -o remount,size=1m {disk}
        sed -n 's/.*re-run (it keeps the written shards): //p' {logs}/full.err > {logs}/command
        bash -c "$(cat {logs}/command)" > {logs}/rerun.out 2>&1; echo $? > {logs}/rerun.status
        cp -r {disk}/cache {logs}/cache
    """
    subprocess.run(
        ["unshare", "-rm", "bash", "-c", script],
        cwd=REPO_ROOT,
        timeout=600,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    full = subprocess.CompletedProcess(
        [], int((logs / "full.status").read_text()), (logs / "full.out").read_text(), (logs / "full.err").read_text()
    )
    line = one_line_error(full)
    found = re.search(
        rf"error: no space left on the device of {disk / 'cache'} for the latent cache: ([1-5]) of 6 shards are "
        r"written, the other ([1-5]) need about [0-9.]+ KiB, [0-9.]+ KiB are free\. Free space there, then re-run "
        r"\(it keeps the written shards\): .* -m taehv_train\.training\.build_latent_cache --config .* "
        rf"--output {disk / 'cache'} ",
        line,
    )
    assert found and int(found.group(1)) + int(found.group(2)) == 6, line
    assert ".tmp-" not in (logs / "kept").read_text()  # no partial shard holds the space
    assert int((logs / "rerun.status").read_text()) == 0, (logs / "rerun.out").read_text()[-3000:]
    config, dataset, _ = dataset_and_vae(data, tiny_cogvideox_vae)
    LatentCache(logs / "cache").check(config, len(dataset))  # complete and for these settings


@pytest.mark.slow
def test_training_refuses_a_cache_made_for_other_settings_or_with_a_damaged_shard(
    sampled_cache, data, tiny_cogvideox_vae, tmp_path
):
    """Through the training entry point: a cache made for another size, or with a shard
    whose header does not open, is refused in one line before the first step (these starts
    in this process: the imports are paid once); a shard whose latent bytes were overwritten
    (same size) stops the run, a process exiting 2 in one line, when the row is read, after
    saving, with the shard and row named."""
    cache = tmp_path / "cache"
    shutil.copytree(sampled_cache, cache)
    options = (f"--ref_vae_path={tiny_cogvideox_vae}", "--ref_vae_dtype=fp32", "--latent_cache_epochs=2")
    options += ("--max_failure_fraction=0.5", f"--latent_cache_dir={cache}", "--validation_every=100")

    def refusal(*extra: str) -> str:  # the run below shows the same through a process
        return refused_here(tmp_path / "out", data, *options, *extra)

    def train(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "taehv_train.training.taehv_train",
                "--config",
                TEST_CONFIG,
                *overrides(
                    data,
                    tiny_cogvideox_vae,
                    f"--latent_cache_dir={cache}",
                    f"--output_dir={tmp_path / 'out'}",
                    "--validation_every=100",
                    *extra,
                ),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=REPO_ROOT,
        )

    assert "was made for other settings (width: cache 32, now 48)" in refusal("--width=48")
    shard = cache / "epoch001" / "shard000002.safetensors"
    original = shard.read_bytes()
    shard.write_bytes(b"\xff" * 8 + original[8:])  # the header's length
    line = refusal()
    assert (
        f"has 1 damaged shard(s) (e.g. {shard} does not open" in line
        and "rerun `python -m taehv_train.training.build_latent_cache`" in line
    )
    shard.write_bytes(original)

    def damage_rows(shard: Path) -> bytes:
        original = shard.read_bytes()
        with open(shard, "r+b") as f:  # inside the latents of the shard's two rows
            f.seek(len(original) // 2)
            f.write(os.urandom(64))
        return original

    shard = cache / "epoch000" / "shard000000.safetensors"  # read by the start-up's latent-scale check
    original = damage_rows(shard)
    line = refusal()
    assert re.search(rf"error: latent cache shard {shard}, row [01] is damaged \(checksum\): delete", line), line
    shard.write_bytes(original)
    shard = cache / "epoch000" / "shard000002.safetensors"  # read in the first epoch
    damage_rows(shard)
    line = one_line_error(train("--run_name=run", "--max_train_steps=8", "--checkpointing_steps=100"))
    assert re.search(
        rf"the training data became unreadable at step \d+ \(latent cache shard {shard}, row [01] is "
        r"damaged \(checksum\): delete .*\); saved .*checkpoint-\d+\. .* resume with: ",
        line,
    ), line


def test_a_cache_built_from_shards_holds_the_latents_of_the_same_clips_as_files(
    sampled_cache, data, tiny_cogvideox_vae, tmp_path, monkeypatch
):
    """The annotated clips packed in the same order into a shard, a member that does not
    decode where the annotation's file is missing: both are replaced by the same clip, and
    every latent is the one the files gave."""
    monkeypatch.setenv("TAEHV_SHARD_INDEX_CACHE", str(tmp_path / "index"))
    entries = json.loads(data["train"].read_text())["list"]
    clips = []
    for i, entry in enumerate(entries):
        path = Path(data["root"]) / entry["path"]
        clips.append((f"{i:04d}.mp4", path.read_bytes() if path.exists() else b"no video", {"frames": entry["frames"]}))
    shard = tmp_path / "train.tar"
    shard.write_bytes(clip_shard(clips))
    output = tmp_path / "cache"
    build_here(cli_args(data | {"train": shard}, tiny_cogvideox_vae, output, "--batch_size", "1"))
    files, shards = LatentCache(sampled_cache), LatentCache(output)
    for epoch in (0, 1):
        for index in range(len(entries)):
            assert torch.equal(shards.latents(epoch, index), files.latents(epoch, index)), (epoch, index)
            assert shards.clip(epoch, index) == files.clip(epoch, index)
