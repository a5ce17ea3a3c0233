"""Shared test fixtures: where the read-only shared data lives.

Tests read real clips and compatibility fixtures from ``../shared`` (next to the repo),
overridable with ``TAEHV_SHARED_DIR``. A missing directory skips those tests on a
developer machine but fails them in CI (``CI=true``), so CI can never go green by
silently skipping the compatibility and real-video checks.
"""

from __future__ import annotations

import fcntl
import io
import json
import os
import shutil
import tarfile
import tempfile
import uuid
from pathlib import Path

import pytest

from bench.lib.harness import shared_dir  # the one rule for ../shared, shared with the benchmarks
from bench.lib.s3_loopback import CLEARED_VARIABLES, FaultProxy, MotoServer, S3Bucket, client_environment

REPO_ROOT = Path(__file__).resolve().parents[1]  # on sys.path through pytest.ini's pythonpath


# The suite's peak disk use is one training test's checkpoints per process running tests
# (2.5 GB measured on a full run in one process; on two workers at most 11.1 GiB over the disk's
# use before set-up, the 1.9 GiB venv included; pytest.ini removes a passing test's tmp_path).
# With less free space than this per worker, tests would fail halfway with ENOSPC in
# unrelated places, so the session stops at once instead.
MIN_FREE_DISK_GIB_PER_WORKER = 5


def pytest_configure(config: pytest.Config) -> None:
    """A pytest-xdist worker (``make test-fast`` runs one per core) takes its share of the
    cores for torch and for the processes its tests start: with torch's default, one thread
    per core in every worker, the workers fight over the same cores and the tier ran three
    times slower than one process. An ``OMP_NUM_THREADS`` the user set is kept.

    pytest-xdist's own reordering of files (those with the most tests first) is turned off:
    files start in the order ``pytest_collection_modifyitems`` gives them."""
    config.option.loadscopereorder = False  # pytest-xdist >= 3.8 (requirements-dev.txt)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    threads = max(1, torch.get_num_threads() // workers)  # torch's default: one per core
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Under pytest-xdist a test marked ``alone`` (it measures wall-clock time) runs while no
    other worker runs a test: every test (its fixtures' set-up and tear-down included) holds a
    shared lock, an ``alone`` test the exclusive one. It first closes a gate the others pass
    to take their lock, so a worker going from test to test cannot keep it waiting. The lock
    files lie in the run's base temporary folder (the workers' folders are inside it)."""
    if not hasattr(item.config, "workerinput"):  # one process: nothing runs beside a test
        yield
        return
    folder = Path(item.config.option.basetemp).parent
    alone = item.get_closest_marker("alone") is not None
    with open(folder / "tests.gate", "a") as gate, open(folder / "tests.lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield


# The seconds each test file took on two pytest-xdist workers (setup, call and teardown of
# its tests summed), updated by `--record-file-durations`: only the order files start in
# depends on it, never a result.
FILE_DURATIONS = Path(__file__).with_name("file_durations.json")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-file-durations",
        action="store_true",
        help=f"record the seconds each test file run took in tests/{FILE_DURATIONS.name} (the order files start in)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files start longest first: under ``--dist loadfile`` a worker that frees up takes the
    next file, so a long file started last would run on while the other worker has nothing
    left. A file the record does not name starts before the others (its length is unknown).
    A file with a test marked ``alone`` starts last, when the other worker's tests are short,
    so it waits least for them to end. The tests of a file keep their order."""
    seconds = json.loads(FILE_DURATIONS.read_text()) if FILE_DURATIONS.is_file() else {}
    alone = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("alone") is not None}

    def key(item: pytest.Item) -> tuple[bool, float]:
        path = item.nodeid.split("::")[0]
        return path in alone, -seconds.get(path, float("inf"))

    items.sort(key=key)  # stable: a file's tests stay together and in their order, files of equal keys too


_file_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::")[0]
    _file_seconds[path] = _file_seconds.get(path, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    if config.getoption("record_file_durations") and not hasattr(config, "workerinput"):
        recorded = json.loads(FILE_DURATIONS.read_text()) if FILE_DURATIONS.is_file() else {}
        recorded.update((path, round(seconds, 1)) for path, seconds in _file_seconds.items())  # the files run
        FILE_DURATIONS.write_text(json.dumps(dict(sorted(recorded.items(), key=lambda kv: -kv[1])), indent=1) + "\n")


def pytest_sessionstart(session: pytest.Session) -> None:
    where = Path(session.config.option.basetemp or tempfile.gettempdir()).resolve()
    while not where.exists():
        where = where.parent
    free_gib = shutil.disk_usage(where).free / 2**30
    need = MIN_FREE_DISK_GIB_PER_WORKER * int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if free_gib < need:
        pytest.exit(
            f"only {free_gib:.1f} GiB free on the disk of {where}; the test suite needs {need} GiB "
            "for its training checkpoints: free some space or pass --basetemp=DIR on a larger disk",
            returncode=1,
        )


def _require(path: Path, what: str) -> Path:
    if path.exists():
        return path
    message = f"{what} not found at {path} (set TAEHV_SHARED_DIR to the shared/ folder)"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def compat_dir() -> Path:
    return _require(shared_dir() / "compat", "compat fixtures")


@pytest.fixture(scope="session")
def videos_dir() -> Path:
    return _require(shared_dir() / "videos", "shared video clips")


def valid_config(tmp_path: Path, **changes):
    """A config that passes the check: a data folder holding a clip (by its name: the check
    reads no frames), no pretrained weights; ``changes`` on top."""
    from taehv_train.common.config import TrainConfig

    (tmp_path / "videos").mkdir(exist_ok=True)
    (tmp_path / "videos" / "clip.mp4").touch()
    return TrainConfig(data_root=str(tmp_path / "videos"), pretrained_model_path="").replace(**changes)


def published_format_weights(variant: str, path: Path) -> Path:
    """The compat recipe's deterministic weights (``../shared/compat/recipe.py``) for
    ``variant``'s keys, saved with ``torch.save`` at ``path`` without metadata: a file as the
    published ones are, read by its name alone."""
    import importlib.util

    import torch

    from taehv_train.models.taehv import TAEHV

    recipe_file = _require(shared_dir() / "compat" / "recipe.py", "compat fixtures")
    spec = importlib.util.spec_from_file_location("compat_recipe", recipe_file)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    with torch.device("meta"):
        shapes = [(key, tuple(value.shape)) for key, value in TAEHV(variant=variant).state_dict().items()]
    torch.save(recipe.recipe_state_dict(shapes), path)
    return path


@pytest.fixture(scope="module")
def recipe_files(tmp_path_factory):
    """Published-format weights (the compat recipe's, under the published file name, no
    metadata) by variant, each written once and only read."""
    root = tmp_path_factory.mktemp("published_format")

    def file(variant: str) -> Path:
        path = root / f"{variant}.pth"
        return path if path.is_file() else published_format_weights(variant, path)

    return file


@pytest.fixture(scope="session")
def demo_clips(tmp_path_factory) -> dict[str, Path]:
    """Six procedural clips (48x64, 12 frames) with train/val annotations, for training runs."""
    from taehv_train.training.demo_data import make_demo_dataset

    root = tmp_path_factory.mktemp("demo_clips")
    paths = make_demo_dataset(root, num_clips=6, n_frames=12, height=48, width=64, seed=1)
    return {"root": root, **paths}


def demo_validation_config(demo_clips: dict[str, Path], **changes):
    """A taehv config at 5 frames of 16x16 over ``demo_clips``, validating on one clip; ``changes`` on top."""
    from taehv_train.common.config import TrainConfig

    return TrainConfig(
        variant="taehv",
        n_frames=5,
        height=16,
        width=16,
        data_root=str(demo_clips["root"]),
        annotation_file=str(demo_clips["train"]),
        val_annotation_file=str(demo_clips["val"]),
        num_validation_samples=1,
    ).replace(**changes)


@pytest.fixture(scope="session")
def tiny_cogvideox_vae(tmp_path_factory) -> Path:
    """A tiny CogVideoX VAE (16 latent channels) saved by diffusers, for the real loading path."""
    import torch
    from diffusers import AutoencoderKLCogVideoX

    root = tmp_path_factory.mktemp("cogvideox")
    torch.manual_seed(0)
    vae = AutoencoderKLCogVideoX(
        block_out_channels=(16, 16, 32, 32),
        latent_channels=16,
        layers_per_block=1,
        norm_num_groups=8,
        down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4,
    )
    vae.save_pretrained(root / "vae")
    return root


# The smallest configs of each reference VAE class that keep its real latent channels and
# compression (docs/reference_vaes.md); built, saved and loaded through diffusers in tests.
TINY_VAES = {
    "cogvideox": {
        "block_out_channels": (4, 4, 4, 4),
        "layers_per_block": 1,
        "norm_num_groups": 1,
        "latent_channels": 16,
    },
    "hunyuan": {"block_out_channels": (4, 4, 4, 4), "layers_per_block": 1, "norm_num_groups": 1, "latent_channels": 16},
    "hunyuan15": {"block_out_channels": (4, 4, 8, 16, 64), "layers_per_block": 1, "latent_channels": 32},
    "wan": {"base_dim": 4, "z_dim": 16, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1},
    "wan22": {
        "base_dim": 4,
        "decoder_base_dim": 4,
        "z_dim": 48,
        "dim_mult": [1, 1, 1, 1],
        "num_res_blocks": 1,
        "is_residual": True,
        "in_channels": 12,
        "out_channels": 12,
        "patch_size": 2,
        "scale_factor_spatial": 16,
        "scale_factor_temporal": 4,
        "latents_mean": [0.0] * 48,
        "latents_std": [1.0] * 48,
    },
    "ltx": {
        "block_out_channels": (8, 8, 8, 8),
        "decoder_block_out_channels": (8, 8, 8, 8),
        "layers_per_block": (1, 1, 1, 1, 1),
        "decoder_layers_per_block": (1, 1, 1, 1, 1),
        "latent_channels": 128,
    },
    "ltx2": {
        "block_out_channels": (8, 8, 16, 32),
        "decoder_block_out_channels": (8, 16, 32),
        "layers_per_block": (1, 1, 1, 1, 1),
        "decoder_layers_per_block": (1, 1, 1, 1),
        "latent_channels": 128,
        "decoder_causal": False,
        "spatial_compression_ratio": 32,
        "temporal_compression_ratio": 8,
    },
    "h3": {
        "latent_channels": 24,
        "block_out_channels": (4, 4, 4, 4),
        "layers_per_block": 1,
        "spatial_downsample_factors": (2, 2, 2, 2),
        "temporal_downsample_factors": (1, 2, 2, 1),
        "norm_num_groups": 2,
        "decoder_num_layers": 1,
        "decoder_num_attention_heads": 1,
        "decoder_attention_head_dim": 8,
        "decoder_num_register_tokens": 1,
        "decoder_ffn_mult": 1,
        "latents_mean": (0.0,) * 24,
        "latents_std": (1.0,) * 24,
    },
    # no published TAE: the package builds one; sizes from measuring each class
    "allegro": {"block_out_channels": (8, 8, 8, 8), "layers_per_block": 1, "norm_num_groups": 4, "sample_size": 32},
    "cosmos": {"encoder_block_out_channels": (8, 8, 8, 8), "decode_block_out_channels": (8, 8, 8, 8), "num_layers": 1},
    "kvae": {"ch": 32, "ch_mult": (1, 1, 1, 1), "num_res_blocks": 0},  # GroupNorm(32) is fixed
    "easyanimate": {"block_out_channels": (8, 8, 8, 8), "layers_per_block": 1, "norm_num_groups": 4},
    "vidtok": {"ch": 8, "ch_mult": (1, 1, 1, 1), "num_res_blocks": 1},
    "mochi": {
        "encoder_block_out_channels": (32,) * 4,
        "decoder_block_out_channels": (32,) * 4,
        "layers_per_block": (1, 1, 1, 1, 1),
    },  # widths of 32: its GroupNorm and attention heads
    "qwenimage21": {"base_dim": 8, "decoder_base_dim": 8, "dim_mult": [1, 1, 1, 1, 1], "num_res_blocks": 1},
    "svd": {"block_out_channels": (32,) * 4, "down_block_types": ("DownEncoderBlock2D",) * 4, "layers_per_block": 1},
    "hunyuanimage_refiner": {
        "block_out_channels": (4, 4, 8, 16, 64),
        "layers_per_block": 1,
        "latent_channels": 32,
    },  # the last width holds 2 x 32 channels
}


def save_tiny_vae(root: Path, name: str, **overrides) -> Path:
    """A tiny VAE of ``name`` (a TINY_VAES key) saved with ``save_pretrained`` into
    ``root/vae``; returns ``root`` (what ``ref_vae_path`` names)."""
    import diffusers
    import torch

    from taehv_train.models.vae_classes import REF_VAE_CLASSES

    torch.manual_seed(0)
    ref_vae = REF_VAE_CLASSES["wan" if name == "wan22" else name]
    getattr(diffusers, ref_vae.diffusers_class)(**{**TINY_VAES[name], **overrides}).save_pretrained(root / "vae")
    return root


def clip_shard(clips: list[tuple[str, bytes, dict]]) -> bytes:
    """A tar shard in the layout video2dataset writes, made with the stdlib as a foreign
    packer makes it: per ``(member name, its bytes, JSON fields)``, the member and beside it
    ``{key}.json`` (the key: the name up to its first ".")."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data, fields in clips:
            key = name.split(".")[0]
            for member, content in ((name, data), (f"{key}.json", json.dumps({"key": key, **fields}).encode())):
                info = tarfile.TarInfo(member)
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


def tool_exit(capsys, main, *args: str) -> tuple[int, str, list[str]]:
    """A tool's ``main`` run in this process as its ``python -m`` entry point runs it
    (``exit_on_user_error``): exit status, stdout, stderr lines."""
    from taehv_train.base.errors import exit_on_user_error

    capsys.readouterr()
    try:
        exit_on_user_error(main, list(args))
        status = 0
    except SystemExit as stop:
        status = stop.code or 0
    out, err = capsys.readouterr()
    return status, out, err.splitlines()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """moto's S3 server on loopback, one for the session (bench/lib/s3_loopback.py)."""
    server = MotoServer(tmp_path_factory.mktemp("s3-server"))
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server, monkeypatch, tmp_path):
    """A fresh bucket per test, with the client environment set for the test and the
    processes it starts: the server's endpoint, fake keys, no ~/.aws."""
    for name in CLEARED_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    environment = client_environment(s3_server.endpoint, tmp_path)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    return S3Bucket(s3_server, f"bucket-{uuid.uuid4().hex[:12]}", environment)


@pytest.fixture(scope="session")
def s3_auth_server(tmp_path_factory):
    """A second moto server that authenticates every request: made-up keys get its 403."""
    server = MotoServer(tmp_path_factory.mktemp("s3-auth-server"), auth=True)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_proxy(s3_server):
    """The fault-injecting proxy in front of the session's server (bench/lib/s3_loopback.py)."""
    return FaultProxy(s3_server.port)


@pytest.fixture
def s3_through_proxy(s3_bucket, s3_proxy, monkeypatch):
    """The test's bucket reached through the proxy, which passes everything until told."""
    s3_proxy.drop_responses(0, 0)
    s3_proxy.go_up()
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_proxy.endpoint)
    yield s3_proxy
    s3_proxy.go_down()
