"""Training guards that need no training process: config paths, the frozen reference VAE,
TensorBoard hparams, low-precision dtypes, the loss plan, grad-norm checks, frame counts and Seraena's
frame groups.

Each shows a failure cannot happen in this design, or stops at start-up with a message that
says what to change. The guards that need real training processes or checkpoint folders
live in tests/test_fault_tolerance.py and tests/test_checkpointing.py;
docs/fault_tolerance.md ("Training guards") has the full table.
"""

from __future__ import annotations

import signal

import pytest
import torch
from accelerate import Accelerator

from conftest import REPO_ROOT
from conftest import valid_config as valid
from taehv_train.base.errors import UserError
from taehv_train.common.config import TrainConfig, load_config, resolve_path
from taehv_train.models.frames import group_frames, plan_frames, ungroup_frames
from taehv_train.models.taehv import TAEHV
from taehv_train.training.loop import resilience
from taehv_train.training.loop.resilience import StopRequest, WindowTrouble
from taehv_train.training.loop.trackers import tensorboard_hparams
from taehv_train.training.preflight import check

CONFIGS = REPO_ROOT / "training" / "configs"


def test_config_paths_resolve_from_the_repository_and_missing_ones_stop_start_up(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # launched from anywhere: paths still mean the repository's
    assert resolve_path("checkpoints/taecvx.pth") == REPO_ROOT / "checkpoints" / "taecvx.pth"
    with pytest.raises(UserError, match=r"pretrained_model_path: .*checkpoints/taecvx_missing.pth does not exist"):
        check(valid(tmp_path, pretrained_model_path="checkpoints/taecvx_missing.pth"))


def test_the_reference_vae_is_frozen_and_never_prepared(tiny_cogvideox_vae):
    from taehv_train.common.reference_vae import ReferenceVAE

    ref = ReferenceVAE(tiny_cogvideox_vae, dtype="fp32")
    assert not isinstance(ref, torch.nn.Module)  # cannot be handed to accelerator.prepare by mistake
    assert not any(p.requires_grad for p in ref.vae.parameters())
    latents = ref.encode(torch.rand(1, 9, 3, 32, 32))
    assert latents.shape == (1, 3, 16, 4, 4) and not latents.requires_grad
    # the 2-process ZeRO-2 run with this VAE: tests/test_train.py::test_deepspeed_zero2_two_processes


@pytest.mark.parametrize("name", ["taehv_config", "taehv_config_h100", "taehv_config_demo", "taehv_config_test"])
def test_tensorboard_hparams_keep_only_the_types_it_accepts(tmp_path, name):
    hparams = tensorboard_hparams(load_config(CONFIGS / f"{name}.py"))
    assert hparams and all(isinstance(v, (int, float, str, bool)) for v in hparams.values())


def test_a_start_and_a_resume_write_one_tensorboard_run(tmp_path):
    """The hyperparameters go into the run's own log folder once (add_hparams raises on any
    type it does not take); a resume adds no time-stamped folder, which TensorBoard would show
    as another run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from taehv_train.training.loop.monitoring import Monitor
    from taehv_train.training.loop.trackers import log_with

    config = load_config(CONFIGS / "taehv_config_test.py")
    for start_step in (0, 4):
        accelerator = Accelerator(cpu=True, log_with=log_with(config, tmp_path), project_dir=str(tmp_path))
        Monitor(accelerator, config, tmp_path, start_step)
        accelerator.log({"train/loss": 1.0}, step=start_step + 1)
        accelerator.end_training()
    assert [p.name for p in (tmp_path / "logs").iterdir() if p.is_dir()] == []
    events = EventAccumulator(str(tmp_path / "logs"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 5]
    assert "_hparams_/session_start_info" in events.PluginTagToContent("hparams")


def test_inputs_follow_the_dtype_of_low_precision_weights():
    from taehv_train.training.loop.forward import training_forward

    config = TrainConfig(n_frames=9)
    model = TAEHV(variant="taecvx").to(torch.bfloat16)  # as DeepSpeed bf16 casts the module
    frames, z_ref = torch.rand(1, 9, 3, 16, 16), torch.randn(1, 3, 16, 2, 2)  # float32, as the loop has them
    losses = training_forward(Accelerator(cpu=True), model, frames, z_ref, config, torch.bfloat16).losses
    assert losses["loss"].dtype == torch.float32 and bool(torch.isfinite(losses["loss"]))


@pytest.mark.parametrize(
    "with_reference, reconstruction, lpips, decode_own, terms",
    [
        (False, 1.0, 0.0, True, ("reconstruction_loss",)),
        (False, 1.0, 0.5, True, ("reconstruction_loss", "lpips_loss")),
        (True, 1.0, 0.0, True, ("encoder_loss", "decoder_loss", "reconstruction_loss")),
        (True, 1.0, 0.5, True, ("encoder_loss", "decoder_loss", "reconstruction_loss", "lpips_loss")),
        (True, 0.0, 0.0, False, ("encoder_loss", "decoder_loss")),
        (True, 0.0, 0.5, False, ("encoder_loss", "decoder_loss")),  # refused by the config check
    ],
)
def test_the_loss_plan_says_what_the_forward_decodes_and_computes(
    monkeypatch, with_reference, reconstruction, lpips, decode_own, terms
):
    """``loss_plan`` is the rule; the training forward's logged terms are the ones it names
    (LPIPS stood in for by a mean squared error: its network is an optional extra)."""
    from taehv_train.common import metrics
    from taehv_train.training.loop.forward import training_forward
    from taehv_train.training.loop.losses import loss_plan

    monkeypatch.setattr(metrics, "video_lpips", lambda a, b: ((a - b) ** 2).flatten(1).mean(1))
    config = TrainConfig(n_frames=9, reconstruction_loss_weight=reconstruction, lpips_loss_weight=lpips)
    plan = loss_plan(config, with_reference)
    assert (plan.decode_own, plan.terms) == (decode_own, terms)
    model = TAEHV(variant="taecvx")
    frames = torch.rand(1, 9, 3, 16, 16)
    z_ref = torch.randn(1, 3, 16, 2, 2) if with_reference else None
    forward = training_forward(Accelerator(cpu=True), model, frames, z_ref, config, torch.float32)
    assert (forward.out.decoded is not None) == decode_own
    assert set(forward.losses) - {"loss", "latent_rms_ratio"} == set(terms)


def test_a_window_settles_its_gradient_norm_as_a_float_or_a_tensor_and_names_its_problem():
    def settled(grad_norm, loss=1.0, out_of_memory=False):
        trouble = WindowTrouble(torch.device("cpu"))
        trouble.out_of_memory = out_of_memory
        trouble.add_loss(torch.tensor(loss))
        return trouble.settle(StopRequest(), grad_norm)

    assert all(settled(norm).problem is None for norm in (1.0, torch.tensor(2.0), None))
    assert settled(float("inf")).problem == settled(torch.tensor(float("nan"))).problem == "non-finite gradient"
    assert settled(1.0, loss=float("nan")).problem == "non-finite loss"
    assert settled(float("nan"), loss=float("nan"), out_of_memory=True).problem == "out of memory"


def test_a_stop_signal_that_arrives_while_the_host_waits_for_the_device_stops_this_window(monkeypatch):
    """On a GPU the host queues a window and waits for the device at its end; a signal's
    Python handler runs only once that wait returns. The stop flag is read after the wait,
    so such a signal is in this window's agreement, not the next one's."""
    stop = StopRequest()
    monkeypatch.setattr(resilience, "wait_for_device", lambda device: stop.receive(signal.SIGTERM))
    assert WindowTrouble(torch.device("cpu")).settle(stop).stop_requested


def test_19_frames_are_refused_with_a_reference_vae_and_aligned_without(tmp_path):
    (tmp_path / "vae").mkdir()
    with pytest.raises(UserError, match=r"n_frames=19 does not work with a reference VAE.*Valid: 5, 9, 13, 17"):
        check(valid(tmp_path, n_frames=19, variant="taehv", ref_vae_path=str(tmp_path)))
    plan = plan_frames(19)  # plain autoencoder: 17 decoded frames, compared with input frames 0..16
    frames = torch.rand(1, 19, 3, 8, 8)
    assert plan.decoded_frames == 17 and plan.target(frames).shape[1] == 17
    decoded = TAEHV(variant="taehv").decode_video(torch.zeros(1, plan.latent_frames, 16, 1, 1))
    assert decoded.shape[1] == plan.target(frames).shape[1]


def test_taecvx_decodes_16_frames_to_16_targets():
    model = TAEHV(variant="taecvx")
    plan = model.plan(16)
    frames = torch.rand(1, 16, 3, 8, 8)
    with torch.no_grad():
        decoded = model.decode_video(model.encode_video(frames))
    assert decoded.shape[1] == plan.decoded_frames == plan.target(frames).shape[1] == 16


def test_seraena_stays_out_of_prepare_and_trains_on_its_own():
    """The training step hands only the TAE to Accelerate (DeepSpeed takes one model per
    Accelerator); the discriminator keeps its own optimizer and still learns. The 2-process
    ZeRO-2 runs (tests/test_train.py, tests/test_fault_tolerance.py) show it identical on both ranks."""
    from taehv_train.training.data.loading import ReferenceLatents
    from taehv_train.training.loop.step import TrainStep

    config = TrainConfig(
        n_frames=9,
        height=16,
        width=16,
        train_batch_size=2,
        use_seraena=True,
        n_seraena_frames=9,
        seraena_buffer_size=8,
        mixed_precision="no",
    )
    accelerator = Accelerator(cpu=True)
    step, _ = TrainStep.build(config, accelerator, TAEHV(variant="taecvx"), ReferenceLatents(None, cached=False))
    discriminator = {id(p) for p in step.seraena.parameters()}
    assert accelerator._models == [step.model] and step.model is step.unwrapped_model
    assert not any(id(p) in discriminator for group in step.optimizer.param_groups for p in group["params"])
    before = [p.detach().clone() for p in step.seraena.parameters()]
    batch = {"frames": torch.randint(0, 256, (2, 9, 3, 16, 16), dtype=torch.uint8)}
    result = step(iter([batch]), window=1)
    assert result.applied and {"seraena_loss", "seraena_disc_loss"} <= set(result.losses[0])
    assert any(not torch.equal(a, b) for a, b in zip(before, step.seraena.parameters()))


@pytest.mark.parametrize("frames, group", [(9, 3), (12, 3), (17, 1), (17, 17), (16, 4)])
def test_seraena_frame_grouping_is_exactly_invertible(frames, group):
    clips = torch.rand(2, frames, 3, 8, 16)
    grouped = group_frames(clips, group)
    assert grouped.shape == (2 * frames // group, 3 * group, 8, 16)
    assert torch.equal(ungroup_frames(grouped, group, frames), clips)


def test_a_seraena_group_size_that_drops_frames_stops_start_up(tmp_path):
    with pytest.raises(UserError, match=r"n_seraena_frames=8 does not divide the 17 decoded frames.*Valid: 1, 17"):
        check(valid(tmp_path, variant="taehv", n_frames=20, use_seraena=True, n_seraena_frames=8, train_batch_size=2))
    with pytest.raises(ValueError, match="valid group sizes: 1, 17"):
        group_frames(torch.rand(1, 17, 3, 8, 8), 8)  # never trimmed at run time either
    check(valid(tmp_path, variant="taehv", n_frames=20, use_seraena=True, n_seraena_frames=1, train_batch_size=2))


@pytest.mark.parametrize("variant, n_frames", [("taecvx", 16), ("taecvx", 17), ("taehv", 19), ("taehv", 20)])
def test_seraena_groups_and_context_follow_the_decoded_tensor(variant, n_frames):
    """Groups and context come from the decoded tensor (16 for taecvx's 16 frames, 17 for
    taehv's 19), so frames, targets and context always line up."""
    from taehv_train.models.seraena import Seraena
    from taehv_train.training.loop.adversarial import seraena_loss

    model = TAEHV(variant=variant)
    plan = model.plan(n_frames)
    frames = torch.rand(2, n_frames, 3, 16, 16)
    with torch.no_grad():
        latents = model.encode_video(frames)
        decoded = model.decode_video(latents, clamp=False)
    assert decoded.shape[1] == plan.decoded_frames
    seraena = Seraena(3, model.latent_channels, buffer_size=8)
    loss, stats = seraena_loss(seraena, decoded.requires_grad_(), plan.target(frames), latents, group=1)
    assert loss.ndim == 0 and bool(torch.isfinite(loss)) and bool(torch.isfinite(stats["disc_loss"]))
