"""torch.compile as an option: ``TAEHV.compile``, training's ``compile=true``,
``TAEVideoVAE(..., compile=True)`` and ``inference.py --compile``.

Inductor takes about a minute per block sequence and chunk shape on a 2-core CPU, so
nothing here compiles with it: equality tests use ``aot_eager`` (dynamo's whole tracing
and AOTAutograd's forward/backward split, with ``fullgraph=True``, so any graph break is
an error) and the entry points that compile with inductor by default get that backend
through ``torch.compile``'s keyword default (a real ``torch.compile``, only cheaper). The
benchmark script's test, which checks the script and not what compiling computes, uses
dynamo's ``eager`` backend (tracing and guards, no AOTAutograd).
"""

from __future__ import annotations

import functools
import json
import logging

import pytest
import torch
from test_train import scalars
from torch._dynamo.testing import CompileCounterWithBackend

import taehv_train.models.taehv as taehv_module
from conftest import valid_config
from taehv_train import inference
from taehv_train.base.errors import UserError
from taehv_train.common.config import TrainConfig
from taehv_train.models.blocks import RunOptions
from taehv_train.models.diffusers_vae import TAEVideoVAE
from taehv_train.models.taehv import TAEHV, run_blocks
from taehv_train.models.variants import known_variants
from taehv_train.models.weights import save_weights
from taehv_train.training.data.loading import ReferenceLatents
from taehv_train.training.loop.optimisation import compiles
from taehv_train.training.loop.step import TrainStep
from taehv_train.training.preflight import check
from train_runs import tiny_train_step, train_here

pytestmark = pytest.mark.slow  # torch.compile and training processes

ATOL = 1e-5


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every compiled ``run_blocks`` shares one code object, so its dynamo cache (and the
    recompile limit, a hard error under ``fullgraph=True``) is shared by all tests here."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def cheap_compile(monkeypatch):
    """``torch.compile`` with ``aot_eager`` as its default backend (an explicit backend wins)."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))


def compiled_copy(model: TAEHV, backend: object = "aot_eager") -> TAEHV:
    twin = TAEHV(variant=model.variant)
    twin.load_state_dict(model.state_dict())
    twin.train(model.training)
    twin.compile(backend=backend)
    return twin


# One variant per distinct block sequence (dynamo takes seconds per sequence, and more on
# a loaded 2-core CPU): the other variants build the same blocks with other channel counts
# (taew2_1, taeos1_3, taecvx and lighttaew2_1: taehv's; taew2_2 and lighttaew2_2: taehv1_5's;
# every *_super: the same super decoder; taeltx_2: taeltx2_3's; the built TAEs: taehv's or
# taeltx2_3's, but Mochi's 3x stages and the 1x time of Stable Video Diffusion and Qwen-Image
# 2.1; lighttaehy1_5: taehv1_5's with LeakyReLUs).
DISTINCT_ARCHITECTURES = [
    "taehv",
    "taehv1_5",
    "lighttaehy1_5",
    "taehv1_5_super",
    "taeh3",
    "taeltx2_3",
    "taeltx2_3_wide",
    "tae_mochi",
    "tae_svd",
]


def test_the_subset_covers_every_architecture():
    """Each known variant's block sequences (block types, temporal strides) are those of
    a variant in the subset."""

    def signature(variant: str) -> tuple:
        model = TAEHV(variant=variant)
        return tuple(
            tuple((type(b).__name__, getattr(b, "stride", None)) for b in blocks)
            for blocks in (model.encoder, model.decoder)
        )

    covered = {signature(v) for v in DISTINCT_ARCHITECTURES}
    assert {v: signature(v) in covered for v in known_variants()} == dict.fromkeys(known_variants(), True)


@pytest.mark.parametrize("variant", DISTINCT_ARCHITECTURES)
def test_no_graph_breaks_in_the_blocks(variant):
    """Encoder on a chunk of ``t_downscale`` frames and decoder on one latent (sequential,
    its trimmed frames dropped), each with empty memory: one graph, no break
    (``TAEHV.compile`` uses fullgraph=True). A subset of the variants, one per
    architecture (``test_the_subset_covers_every_architecture``)."""
    model = TAEHV(variant=variant)
    p = model.patch_size
    frames = torch.rand(1, model.t_downscale, 3 * p * p, 16, 16)  # after pixel_unshuffle: (16p)x(16p) pixels
    latents = torch.randn(1, 1, model.latent_channels, 2, 2)
    for blocks, x, drop in ((model.encoder, frames, 0), (model.decoder, latents, model.frames_to_trim)):
        options = RunOptions(split_grown_frames=True, trimmed=drop)
        explained = torch._dynamo.explain(run_blocks)(blocks, x, [None] * len(blocks), options)
        torch._dynamo.reset()
        assert explained.graph_break_count == 0, explained.break_reasons
        assert explained.graph_count == 1


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "sequential"])
@torch.no_grad()
def test_compiled_encode_decode_match_eager(parallel, monkeypatch):
    monkeypatch.setattr(taehv_module, "SEQUENTIAL_CHUNK_BYTES", 1)  # sequential: one latent a chunk
    torch.manual_seed(0)
    model = TAEHV(variant="taehv").eval()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = compiled_copy(model, backend=counter)
    frames = torch.rand(1, 9, 3, 16, 24)
    latents = model.encode_video(frames, parallel=parallel)
    torch.testing.assert_close(compiled.encode_video(frames, parallel=parallel), latents, atol=ATOL, rtol=0)
    decoded = model.decode_video(latents, parallel=parallel)
    assert decoded.shape == (1, 9, 3, 16, 24)
    torch.testing.assert_close(compiled.decode_video(latents, parallel=parallel), decoded, atol=ATOL, rtol=0)
    # the compiled path really ran: encoder and decoder graphs (sequential: first chunk and the rest)
    assert counter.frame_count >= (2 if parallel else 4)


@torch.no_grad()
def test_compiled_and_eager_models_follow_in_place_weight_updates():
    """Validation swaps the EMA weights in through ``param.data`` and AdamW (fused) updates
    weights in place, neither bumping the version counter: outputs must follow the
    weights' values, compiled (weights are graph inputs) and eager (cached derived
    weights) alike, as a model freshly built with those weights gives them."""
    torch.manual_seed(0)
    eager = TAEHV(variant="taehv").eval()
    compiled = compiled_copy(eager)
    frames = torch.rand(1, 5, 3, 16, 16)
    for model in (eager, compiled):  # caches and graphs made with the old weights
        model.encode_video(frames)
    shifts = [0.01 * torch.randn_like(p) for p in eager.parameters()]
    for model in (eager, compiled):
        torch._foreach_copy_(
            [p.data for p in model.parameters()], [p + d for p, d in zip(model.parameters(), shifts)]
        )  # as EMAModel.copy_to
    fresh = TAEHV(variant="taehv").eval()
    fresh.load_state_dict(eager.state_dict())
    want = fresh.encode_video(frames)
    torch.testing.assert_close(compiled.encode_video(frames), want, atol=ATOL, rtol=0)
    torch.testing.assert_close(eager.encode_video(frames), want, atol=ATOL, rtol=0)


def test_a_compiled_model_takes_the_shapes_of_a_training_run():
    """Training steps, validation at another size with a smaller last batch, then
    sequential inference, in one process: each shape and mode adds dynamo cache entries
    for the one ``run_blocks`` code object, and under ``fullgraph=True`` running out of
    them (``torch._dynamo.config.recompile_limit``) is an error, not a fallback."""
    torch.manual_seed(0)
    model = TAEHV(variant="taehv")
    model.compile(backend="eager")  # dynamo's tracing and caching, nothing generated
    for _ in range(2):
        model.train()
        out = model(torch.rand(2, 9, 3, 16, 16), reference_latents=torch.randn(2, 3, 16, 2, 2))
        sum(t.mean() for t in out).backward()
        model.eval()
        with torch.no_grad():
            for batch in (2, 1):
                model.decode_video(model.encode_video(torch.rand(batch, 9, 3, 32, 48)))
    frames = torch.rand(1, 9, 3, 24, 32)
    with torch.no_grad():
        latents = model.encode_video(frames, parallel=False)
        decoded = model.decode_video(latents, parallel=False)
        eager = TAEHV(variant="taehv").eval()
        eager.load_state_dict(model.state_dict())
        torch.testing.assert_close(latents, eager.encode_video(frames, parallel=False), atol=ATOL, rtol=0)
        torch.testing.assert_close(decoded, eager.decode_video(latents, parallel=False), atol=ATOL, rtol=0)


def make_step(**changes) -> TrainStep:
    return tiny_train_step(9, 16, latents=ReferenceLatents(None, cached=True), train_batch_size=2, **changes)[0]


def test_train_step_compiles_the_model_and_matches_eager():
    """``compile=true`` makes ``TrainStep.build`` compile the model it prepares. Its forward
    pass (``model(frames, reference_latents)``: latents, own decoding and the reference
    latents' decoding) and gradients, then a whole step's losses and gradient norm, are
    the uncompiled step's."""
    eager, compiled = make_step(), make_step(compile=True, compile_backend="aot_eager")
    assert eager.unwrapped_model.run_blocks is run_blocks and compiled.unwrapped_model.run_blocks is not run_blocks
    assert all(
        torch.equal(a, b) for a, b in zip(eager.unwrapped_model.parameters(), compiled.unwrapped_model.parameters())
    )
    torch.manual_seed(1)
    frames = torch.randint(0, 256, (2, 9, 3, 16, 16), dtype=torch.uint8)
    z_ref = torch.randn(2, 3, 16, 2, 2)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    outputs, grads = [], []
    for step in (eager, compiled):
        forward = step.forward(frames.float() / 255, z_ref)
        step.accelerator.backward(forward.losses["loss"])
        outputs.append([t.detach() for t in forward.out])
        grads.append([p.grad.clone() for p in step.unwrapped_model.parameters()])
        step.optimizer.zero_grad(set_to_none=True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= graphs + 3  # encoder, 2 decoder calls
    assert [o.shape for o in outputs[0]] == [(2, 3, 16, 2, 2), (2, 9, 3, 16, 16), (2, 9, 3, 16, 16)]
    for got, want in zip(outputs[1], outputs[0]):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)
    batch = {"frames": frames, "latents": z_ref}
    want, got = eager(iter([batch]), window=1), compiled(iter([batch]), window=1)
    assert got.applied and want.applied and set(got.losses[0]) == set(want.losses[0])
    for name in want.losses[0]:
        torch.testing.assert_close(got.losses[0][name], want.losses[0][name], atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(torch.as_tensor(got.grad_norm), torch.as_tensor(want.grad_norm), atol=0, rtol=1e-4)


def test_config_refuses_an_unknown_compile_backend(tmp_path):
    base = valid_config(tmp_path, variant="taehv", height=64, width=64, n_frames=9)
    check(base.replace(compile=True, compile_backend="aot_eager"))
    check(base.replace(compile_backend="no_such_backend"))  # only read when compile=true
    with pytest.raises(UserError, match="compile_backend='no_such_backend' is not a torch.compile backend.*inductor"):
        check(base.replace(compile=True, compile_backend="no_such_backend"))
    with pytest.raises(UserError, match="compile='sometimes': expected auto"):
        check(base.replace(compile="sometimes"))


def test_compile_auto_compiles_on_cuda_only():
    assert compiles(TrainConfig()) == torch.cuda.is_available()
    assert compiles(TrainConfig(compile="true")) and compiles(TrainConfig(compile=True))
    assert not compiles(TrainConfig(compile="false"))


def test_a_compilation_that_fails_leaves_the_model_eager_with_one_warning(caplog):
    def broken_backend(graph, example_inputs):
        raise RuntimeError("no C compiler found")

    model, eager = TAEHV(variant="taehv"), TAEHV(variant="taehv")
    eager.load_state_dict(model.state_dict())
    model.compile(backend=broken_backend)
    frames = torch.rand(1, 5, 3, 16, 16)
    with caplog.at_level(logging.WARNING, logger="taehv_train.models.taehv"):
        first, second = model.encode_video(frames), model.encode_video(frames)
    warnings = [r.getMessage() for r in caplog.records if "torch.compile failed" in r.getMessage()]
    assert warnings == ["torch.compile failed (RuntimeError: no C compiler found): running eager from now on"]
    assert model.run_blocks is run_blocks
    assert torch.equal(first, eager.encode_video(frames)) and torch.equal(second, first)


def test_training_run_with_compile(tmp_path, demo_clips):
    """A real run of the test config shortened to 2 steps (a validation with the EMA
    weights, a checkpoint, export; fp32) with ``--compile=true`` logs the losses and metrics
    of the same run without it (both runs are deterministic). Both run in this process:
    what is tested is what the runs log, not their processes."""
    short, compiling = ("--max_train_steps=2", "--use_ema=true"), ("--compile=true", "--compile_backend=aot_eager")
    runs = {
        "eager": train_here(tmp_path / "eager", demo_clips, *short),
        "compiled": train_here(tmp_path / "compiled", demo_clips, *short, *compiling),
    }
    log = (runs["compiled"] / "train.log").read_text()
    assert "torch.compile (backend aot_eager)" in log and "torch.compile: compiled a" in log  # with its time
    assert "torch.compile" not in (runs["eager"] / "train.log").read_text()
    eager, compiled = scalars(runs["eager"]), scalars(runs["compiled"])
    for tag in ("train/loss", "val/psnr", "val/ssim"):
        assert len(compiled[tag]) == len(eager[tag]) > 0, tag
        assert compiled[tag] == pytest.approx(eager[tag], rel=1e-4, abs=1e-5), tag
    TAEHV(runs["compiled"] / "final_model.safetensors")  # the export loads strictly


@torch.no_grad()
def test_diffusers_wrapper_compiles_on_request(tmp_path, cheap_compile):
    torch.manual_seed(0)
    path = save_weights(TAEHV(variant="taecvx"), tmp_path / "taecvx.pth")
    plain, compiled = TAEVideoVAE.from_file(path), TAEVideoVAE.from_file(path, compile=True)
    assert plain.tae.run_blocks is run_blocks and compiled.tae.run_blocks is not run_blocks
    video = torch.rand(1, 3, 9, 16, 16) * 2 - 1  # NCTHW in [-1, 1]
    latents = plain.encode(video).latents
    torch.testing.assert_close(compiled.encode(video).latents, latents, atol=ATOL, rtol=0)
    torch.testing.assert_close(compiled.decode(latents).sample, plain.decode(latents).sample, atol=2 * ATOL, rtol=0)
    tae = TAEHV(variant="taecvx")
    TAEVideoVAE(tae, compiled.config, compile=True)
    assert tae.run_blocks is not run_blocks


def test_inference_compile_gives_the_uncompiled_metrics(tmp_path, videos_dir, cheap_compile):
    """``inference.py --compile`` (in process, so the cheap backend applies) runs compiled
    graphs and reports the metrics of the run without it."""
    torch.manual_seed(0)
    weights = save_weights(TAEHV(variant="taehv"), tmp_path / "taehv.safetensors")
    results, graphs = {}, {}
    for name, flags in (("eager", []), ("compiled", ["--compile"])):
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        inference.main(
            [
                "--model_path",
                str(weights),
                "--videos",
                str(videos_dir / "udacity_vehdet_test_video.mp4"),
                "--n_frames",
                "5",
                "--height",
                "32",
                "--width",
                "48",
                "--num_samples",
                "1",
                "--output_dir",
                str(tmp_path / name),
                *flags,
            ]
        )
        graphs[name] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
        results[name] = json.loads((tmp_path / name / "metrics.json").read_text())
    assert graphs["eager"] == 0 and graphs["compiled"] >= 2  # the encoder's and the decoder's
    assert results["compiled"]["settings"]["compile"] and not results["eager"]["settings"]["compile"]
    got, want = results["compiled"]["samples"][0]["taehv"], results["eager"]["samples"][0]["taehv"]
    for key in ("mse", "psnr", "ssim"):
        assert got[key] == pytest.approx(want[key], rel=1e-4), key


def test_bench_compile_runs_at_a_tiny_size():
    """bench/bench_compile.py end to end with dynamo's ``eager`` backend (whole-graph tracing,
    nothing generated; the equality tests above take the compiled step through AOTAutograd):
    an inference case and the training step (``parallel`` runs the same code as
    ``sequential``), four fresh processes."""
    from bench import bench_compile

    result = bench_compile.main(
        [
            "--cases",
            "sequential",
            "train",
            "--frames",
            "5",
            "--height",
            "16",
            "--width",
            "16",
            "--train-height",
            "16",
            "--train-width",
            "16",
            "--batch",
            "1",
            "--backend",
            "eager",
            "--warmup",
            "0",
            "--repeats",
            "1",
        ]
    )
    json.dumps(result)
    assert [row["case"] for row in result["rows"]] == ["sequential", "train"]
    for row in result["rows"]:
        names = ["step"] if row["case"] == "train" else ["encode", "decode"]
        assert sorted(row["eager"]) == sorted(names) and sorted(row["compiled"]) == sorted(names)
        for name in names:
            compiled = row["compiled"][name]
            assert compiled["compile_s"] > 0 and compiled["speedup"] > 0, (row["case"], name)
            assert compiled["max_abs_diff"] < ATOL, (row["case"], name)
