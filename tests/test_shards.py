"""Clips in tar shards on local disk: the member index (sidecar, built from tar headers,
remembered), samples equal to the same clips read as files, the shard order each training
process reads, and a run from shards against a run from files."""

from __future__ import annotations

import json
import runpy
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate.data_loader import BatchSamplerShard, SkipBatchSampler
from torch.utils.data import BatchSampler

from conftest import REPO_ROOT, clip_shard
from taehv_train.common.annotation_file import read_annotation
from taehv_train.common.clip_table import ClipTable
from taehv_train.common.clips import VideoClipDataset
from taehv_train.common.shard_index import cache_dir, index_text, load_index, sidecar_url
from taehv_train.common.video.files import BadClipError
from taehv_train.common.video.probe import probe_video
from taehv_train.models.taehv import TAEHV
from taehv_train.models.weights import save_weights
from taehv_train.training.data.clip_loader import ShardOrderSampler, buffer_shuffle
from taehv_train.training.own_data import shard_overrides
from train_runs import DDP_ENV, ddp, train, train_here

INFERENCE = str(REPO_ROOT / "inference.py")


def pack(shard: Path, files: list[Path], json_of=lambda path: {}) -> Path:
    """``files`` as the shard ``shard`` in video2dataset's layout (``clip_shard``): its JSON
    states no frame count unless ``json_of`` says."""
    clips = [(f"{shard.stem}{i:04d}{path.suffix}", path.read_bytes(), json_of(path)) for i, path in enumerate(files)]
    shard.write_bytes(clip_shard(clips))
    return shard


@pytest.fixture(autouse=True)
def index_cache(tmp_path, monkeypatch) -> Path:
    """This test's own remembered indexes."""
    monkeypatch.setenv("TAEHV_SHARD_INDEX_CACHE", str(tmp_path / "index_cache"))
    return tmp_path / "index_cache"


@pytest.fixture(scope="module")
def clip_files(demo_clips) -> list[Path]:
    return sorted(Path(demo_clips["root"]).rglob("*.mp4"))


def annotation_of(path: Path, files: list[Path]) -> Path:
    """The users' annotation listing ``files`` in this order, with their probed frame counts."""
    entries = [{"full_path": str(file), "frames": probe_video(file).frames} for file in files]
    path.write_text(json.dumps({"total": len(entries), "list": entries}))
    return path


def test_samples_from_a_shard_equal_the_same_clips_read_as_files(tmp_path, clip_files):
    shard = pack(tmp_path / "a.tar", clip_files)
    annotation = annotation_of(tmp_path / "files.json", clip_files)
    common = dict(n_frames=5, height=32, width=32, seed=7, stride_range=(1, 3), crop_scale=(0.5, 1.0))
    for mode in ("train", "val"):
        from_shard = VideoClipDataset(None, str(shard), mode=mode, **common)
        from_files = VideoClipDataset(None, annotation, mode=mode, **common)
        assert len(from_shard) == len(from_files) == len(clip_files)
        for epoch in (0, 1):
            from_shard.set_epoch(epoch)
            from_files.set_epoch(epoch)
            for i in range(len(clip_files)):
                assert torch.equal(from_shard[i]["frames"], from_files[i]["frames"]), (mode, epoch, i)
    table = from_shard.clips
    assert [table.path(i) for i in range(len(table))] == [f"{shard}#a{i:04d}.mp4" for i in range(len(clip_files))]
    assert table.clip(2).data == clip_files[2].read_bytes()


def test_a_shard_is_indexed_from_its_tar_headers_once_and_again_when_it_changes(tmp_path, clip_files, caplog):
    shard = pack(tmp_path / "a.tar", clip_files[:2])
    with caplog.at_level("INFO", logger="taehv_train.common.shard_index"):
        first = load_index(str(shard))
        assert "indexed shard" in caplog.text  # probed: the JSON states no frame count
        caplog.clear()
        assert load_index(str(shard)) == first  # remembered on this machine
        assert "indexed shard" not in caplog.text
        assert len(list(cache_dir().glob("*.json"))) == 1
        pack(shard, clip_files[:3])  # the shard changed: its size and version
        assert len(load_index(str(shard)).members) == 3
    assert [m.frames for m in first.members] == [probe_video(f).frames for f in clip_files[:2]]
    for member, file in zip(first.members, clip_files, strict=False):
        with open(shard, "rb") as tar:
            tar.seek(member.offset)
            assert tar.read(member.size) == file.read_bytes()


def test_a_sidecar_index_is_read_instead_of_the_shard(tmp_path, clip_files, caplog):
    shard = pack(tmp_path / "a.tar", clip_files[:2], json_of=lambda path: {"frames": probe_video(path).frames})
    built = load_index(str(shard))
    stated = replace(built, members=(replace(built.members[0], path="from the sidecar"),))
    Path(sidecar_url(str(shard))).write_text(index_text(stated))
    with caplog.at_level("INFO", logger="taehv_train.common.shard_index"):
        assert load_index(str(shard)) == stated
    assert "indexed shard" not in caplog.text


def test_a_damaged_or_stale_sidecar_is_passed_over_for_the_tar_headers(tmp_path, clip_files, caplog):
    shard = pack(tmp_path / "a.tar", clip_files[:2], json_of=lambda path: {"frames": probe_video(path).frames})
    built = load_index(str(shard))
    sidecar = Path(sidecar_url(str(shard)))
    for text, said in (
        ("{not json", "is damaged"),
        (index_text(replace(built, shard_bytes=10)), "of a shard of 10 bytes"),
    ):
        sidecar.write_text(text)
        caplog.clear()
        assert load_index(str(shard)) == built
        assert said in caplog.text


def test_a_shard_cut_short_keeps_its_whole_clips_and_a_clip_that_does_not_decode_is_left_out(
    tmp_path, clip_files, caplog
):
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(3000))
    shard = pack(tmp_path / "a.tar", [clip_files[0], bad, *clip_files[1:3]])
    whole = load_index(str(shard))
    assert [m.name for m in whole.members] == ["a0000.mp4", "a0002.mp4", "a0003.mp4"]
    assert "a0001.mp4 left out" in caplog.text
    cut = tmp_path / "cut.tar"
    cut.write_bytes(shard.read_bytes()[: whole.members[2].offset + 100])  # inside the last clip
    with caplog.at_level("WARNING"):
        assert [m.name for m in load_index(str(cut)).members] == ["a0000.mp4", "a0002.mp4"]
    assert "ends inside a member" in caplog.text


def test_a_clip_whose_bytes_do_not_decode_is_replaced_and_counted(tmp_path, clip_files):
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(bytes(2000))
    shard = pack(tmp_path / "a.tar", [bad, clip_files[0]], json_of=lambda path: {"frames": 12})  # stated, not probed
    dataset = VideoClipDataset(None, str(shard), n_frames=5, height=32, width=32, seed=0)
    sample = dataset[0]
    assert (sample["index"], sample["failures"]) == (1, 1)


def test_a_missing_member_range_is_a_bad_clip_of_its_kind(tmp_path, clip_files):
    shard = pack(tmp_path / "a.tar", clip_files[:2])
    table = ClipTable.from_shards(str(shard))
    shard.write_bytes(shard.read_bytes()[:1024])  # the shard shrank after it was indexed
    with pytest.raises(BadClipError, match="shard truncated"):
        table.clip(1)


def shard_table_dataset(sizes: list[int]) -> VideoClipDataset:
    """A dataset object over a shard table of ``sizes`` clips per shard (nothing is read)."""
    names = [f"s{s}.tar#{i}.mp4" for s, size in enumerate(sizes) for i in range(size)]
    table = ClipTable.from_lists("", names, [10] * len(names))
    shard_of = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)
    ranges = np.zeros((len(names), 2), dtype=np.int64)
    dataset = VideoClipDataset.__new__(VideoClipDataset)
    dataset.clips = replace(
        table, shards=tuple(f"s{s}.tar" for s in range(len(sizes))), shard_of=shard_of, ranges=ranges
    )
    dataset._epoch = torch.zeros((), dtype=torch.int64)
    return dataset


def rank_indices(sampler, batch_size: int, processes: int, rank: int, skip: int = 0) -> list[int]:
    """What training process ``rank`` draws, dealt by Accelerate's own batch sampler shard
    (and its skip on resume)."""
    batches = BatchSamplerShard(BatchSampler(sampler, batch_size, drop_last=True), processes, rank)
    if skip:
        batches = SkipBatchSampler(batches, skip)
    return [i for batch in batches for i in batch]


def test_each_process_reads_its_own_run_of_shards_each_clip_at_most_once_an_epoch():
    sizes = [7, 3, 9, 5, 4]  # 28 clips
    dataset = shard_table_dataset(sizes)
    batch, processes = 2, 3
    sampler = ShardOrderSampler(dataset, seed=5, batch_size=batch, processes=processes, buffer=1)
    assert len(sampler) == 28 // 3 // 2 * 2 * 3  # 24: 4 left out, fewer than processes x batch
    shard_of = dataset.clips.shard_of
    runs = [rank_indices(sampler, batch, processes, rank) for rank in range(processes)]
    drawn = [i for run in runs for i in run]
    assert len(drawn) == len(set(drawn)) == len(sampler)
    order = [i for run in runs for i in run]
    shards_in_order = [int(shard_of[i]) for i in order]
    # buffer 1: the runs are the shards in one permuted order, cut in three, each shard's clips in tar order
    assert shards_in_order == sorted(shards_in_order, key=lambda s: shards_in_order.index(s))
    assert all(
        np.diff([i for i in order if shard_of[i] == s]).tolist() == [1] * (sum(shard_of[order] == s) - 1)
        for s in range(5)
    )
    dataset.set_epoch(1)
    assert [rank_indices(sampler, batch, processes, r) for r in range(processes)] != runs  # another order each epoch
    dataset.set_epoch(0)
    assert [
        rank_indices(sampler, batch, processes, r) for r in range(processes)
    ] == runs  # a pure function of the epoch
    shuffled = ShardOrderSampler(dataset, seed=5, batch_size=batch, processes=processes, buffer=4)
    tail = rank_indices(shuffled, batch, processes, 1, skip=2)
    assert tail == rank_indices(shuffled, batch, processes, 1)[2 * batch :]  # a resume skips the batches taken


def test_a_shuffle_buffer_gives_a_permutation_in_which_no_clip_comes_out_before_it_went_in():
    items = np.arange(100)
    rng = np.random.default_rng(0)
    for size in (1, 8, 1000):
        out = buffer_shuffle(items, size, rng)
        assert sorted(out.tolist()) == items.tolist()
        assert all(out[j] < j + size for j in range(len(out)))
    assert buffer_shuffle(items, 1, rng).tolist() == items.tolist()
    assert buffer_shuffle(items, 8, rng).tolist() != items.tolist()


def demo_as_shards(tmp_path: Path, demo_clips: dict, training_clips: int | None = None) -> tuple[dict, dict]:
    """The demo clips (the first ``training_clips`` training ones) as annotation files and,
    in the same order, as a training and a validation shard stating their frame counts."""
    entries = {split: read_annotation(demo_clips[split])["list"] for split in ("train", "val")}
    entries["train"] = entries["train"][:training_clips]
    root = Path(demo_clips["root"])
    files = {"root": root, "train": tmp_path / "train.json", "val": tmp_path / "val.json"}
    shards = {"root": root}
    for split, listed in entries.items():
        files[split].write_text(json.dumps({"total": len(listed), "list": listed}))
        stated = {root / entry["path"]: {"frames": entry["frames"]} for entry in listed}
        shards[split] = pack(tmp_path / f"{split}.tar", list(stated), json_of=lambda path, stated=stated: stated[path])
    return files, shards


# the smallest clips a step takes, a checkpoint only at the end
SMALL_RUN = ("--n_frames=5", "--height=16", "--width=16", "--checkpointing_steps=4")


@pytest.mark.slow  # two short training runs, in this process
def test_a_run_from_shards_validates_as_the_same_run_from_files(tmp_path, demo_clips):
    """With one training clip the sampling is the same whatever the order rule (the clip's
    draws depend on (seed, epoch, index) alone), so the runs are the same run: their
    validation numbers are equal, not close."""
    files, shards = demo_as_shards(tmp_path, demo_clips, training_clips=1)
    histories = []
    for name, data in (("files", files), ("shards", shards)):
        run = train_here(tmp_path / name, data, "--dataloader_num_workers=1", *SMALL_RUN)
        histories.append(json.loads((run / "validation_history.json").read_text()))
    assert histories[0] == histories[1] and len(histories[0]) == 2


@pytest.mark.slow  # a short run of two processes
def test_two_processes_train_from_shards_each_on_its_own_run_of_clips(tmp_path, demo_clips):
    """5 training clips, 2 processes, batch 1: each process's run is 2 clips, so an epoch is
    2 steps and step 4 ends the second (epoch 1, both its batches taken; were the runs cut
    for one process, Accelerate would deal each rank 3 batches an epoch). No validation: the
    training clips are the subject."""
    _, shards = demo_as_shards(tmp_path, demo_clips)
    shards["val"] = ""
    train(
        ddp(29580),
        tmp_path,
        shards,
        "--run_name=run",
        "--max_train_steps=4",
        "--dataloader_num_workers=1",
        *SMALL_RUN,
        env=DDP_ENV,
    )
    state = json.loads((tmp_path / "run" / "checkpoints" / "checkpoint-4" / "trainer_state.json").read_text())
    assert (state["progress"]["epoch"], state["progress"]["batch_in_epoch"]) == (1, 2)


def test_inference_scores_clips_from_a_shard_as_the_same_clips_from_files(tmp_path, clip_files, monkeypatch):
    torch.manual_seed(0)
    weights = save_weights(TAEHV(variant="taecvx"), tmp_path / "final_model.safetensors")
    sources = {"shard": pack(tmp_path / "v.tar", clip_files[:2])}
    sources["files"] = annotation_of(tmp_path / "v.json", clip_files[:2])
    scores = {}
    for name, source in sources.items():
        out = tmp_path / name
        args = ["--model_path", str(weights), "--annotation_file", str(source), "--n_frames", "5", "--height", "32"]
        monkeypatch.setattr(sys, "argv", [INFERENCE, *args, "--width", "32", "--output_dir", str(out)])
        runpy.run_path(INFERENCE, run_name="__main__")  # the script in this process (its imports are done)
        metrics = json.loads((out / "metrics.json").read_text())
        scores[name] = [{k: v for k, v in s["taehv"].items() if not k.endswith("_s")} for s in metrics["samples"]]
        if name == "shard":
            assert [s["source"] for s in metrics["samples"]] == [f"{source}#v{i:04d}.mp4" for i in range(2)]
    assert scores["shard"] == scores["files"]


def test_data_naming_packed_shards_trains_on_them_as_they_are(tmp_path, clip_files, capsys):
    out = tmp_path / "packed"
    (out / "train").mkdir(parents=True)
    pack(out / "train" / "00000.tar", clip_files[:2])
    assert shard_overrides(str(out)) == [
        f"--data_root={out}/train/*.tar",
        "--annotation_file=",
        "--val_annotation_file=",
    ]
    assert "no val/ shards: training without validation" in capsys.readouterr().out
    (out / "val").mkdir()
    pack(out / "val" / "00000.tar", clip_files[2:3])
    assert shard_overrides(str(out))[2] == f"--val_annotation_file={out}/val/*.tar"
    assert shard_overrides(str(clip_files[0].parent)) is None  # a folder of videos: annotated
