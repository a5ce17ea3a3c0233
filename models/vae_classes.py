"""The one table of reference VAE classes a TAE lives next to (``REF_VAE_CLASSES``): per
``ref_vae_class``, the diffusers class that loads it, its TAEs and how it is run (pixels,
batches, which latents, its frame rule, the space its pipeline hands the transformer).
``variant="auto"``, the diffusers wrapper's config lookup and the exported model card all
read it; what a folder's ``config.json`` says against it is ``models.vae_registry``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .latent_spaces import NORMALISED, NORMALISED_SCALED, RAW, SCALED


@dataclass(frozen=True)
class FrameRule:
    """Which clip lengths a reference VAE encodes and decodes faithfully, where that is not
    the TAE's own exact counts (``t_downscale * k + 1``)."""

    takes: Callable[[int], bool]
    says: str


@dataclass(frozen=True)
class RefVAEClass:
    diffusers_class: str
    variants: dict[str, str]  # its TAEs -> the video model each belongs to; variant="auto" takes the first that fits
    pixels: str = "signed"  # "signed": [-1, 1]; "imagenet": ImageNet-normalised [0, 1] (MiniMax H3)
    one_clip_at_a_time: bool = False  # diffusers 0.42's HunyuanVideo 1.5 attention mask breaks on batches > 1
    family: str | None = (
        None  # the TAE this package builds for it (models.variants.BUILT_FAMILIES), if none is published
    )
    latents: str = "sample"  # "mode": the posterior's mean (KVAE's has unit variance; Cosmos's none)
    frames_in_front: bool = False  # VidTok: t_downscale - 1 copies of the first frame before encoding (its forward's)
    image_encoder: bool = False  # SVD: a 2-D encoder over frames, decode(z, num_frames)
    time_tiles: tuple[int, int] | None = None  # Allegro: only tiled, (frames, stride); decode gives NTCHW
    frame_rule: FrameRule | None = None  # None: the TAE's exact counts
    refused: str | None = None  # why training with it is not possible yet
    fp32_on_cpu: bool = False  # Cosmos: its bf16/fp16 average pooling is missing on CPU
    # the space its pipeline hands the transformer (docs/reference_vaes.md, "Which latents go in");
    # raw where diffusers has no pipeline for it
    pipeline_space: str = SCALED
    sampler_scale: float | None = (
        None  # Cosmos: the pipeline scales by its EDM scheduler's sigma_data, not scaling_factor
    )


# ref_vae_class (the config key's values) -> the diffusers class that loads it and its TAEs
REF_VAE_CLASSES = {
    "cogvideox": RefVAEClass("AutoencoderKLCogVideoX", {"taecvx": "CogVideoX"}),
    "hunyuan": RefVAEClass("AutoencoderKLHunyuanVideo", {"taehv": "HunyuanVideo"}),
    "hunyuan15": RefVAEClass(
        "AutoencoderKLHunyuanVideo15",
        {"taehv1_5": "HunyuanVideo 1.5", "lighttaehy1_5": "HunyuanVideo 1.5"},
        one_clip_at_a_time=True,
    ),
    "wan": RefVAEClass(
        "AutoencoderKLWan",
        {"taew2_1": "Wan 2.1", "taew2_2": "Wan 2.2", "lighttaew2_1": "Wan 2.1", "lighttaew2_2": "Wan 2.2"},
        pipeline_space=NORMALISED,
    ),
    "ltx": RefVAEClass("AutoencoderKLLTXVideo", {"taeltx_2": "LTX-2"}, pipeline_space=NORMALISED_SCALED),
    "ltx2": RefVAEClass(
        "AutoencoderKLLTX2Video",
        {"taeltx2_3": "LTX-2.3 and LTX-2.5", "taeltx_2": "LTX-2", "taeltx2_3_wide": "LTX-2.3 and LTX-2.5"},
        pipeline_space=NORMALISED_SCALED,
    ),
    "h3": RefVAEClass("AutoencoderKLMiniMaxH3", {"taeh3": "MiniMax H3"}, pixels="imagenet", pipeline_space=NORMALISED),
    # no published TAE: the package builds one (models.variants.BUILT_FAMILIES)
    "allegro": RefVAEClass(
        "AutoencoderKLAllegro",
        {"tae_allegro": "Allegro"},
        family="tae_allegro",
        one_clip_at_a_time=True,
        time_tiles=(24, 16),
        frame_rule=FrameRule(
            lambda t: t >= 24 and (t - 24) % 16 == 0,
            "encodes clips of 24 + 16m frames (24, 40, 56, ...: its tiles of 24 frames, 8 shared)",
        ),
    ),
    "cosmos": RefVAEClass(
        "AutoencoderKLCosmos",
        {"tae_cosmos": "Cosmos 1.0"},
        family="tae_cosmos",
        latents="mode",
        fp32_on_cpu=True,
        pipeline_space=NORMALISED_SCALED,
        sampler_scale=0.5,  # EDMEulerScheduler's sigma_data, as Cosmos 1.0's pipelines are released
    ),
    "kvae": RefVAEClass(
        "AutoencoderKLKVAEVideo",
        {"tae_kvae": "KVAE"},
        family="tae_kvae",
        latents="mode",
        frame_rule=FrameRule(
            lambda t: (t - 1) % 4 == 0 and not (t > 17 and t % 16 == 5),
            "encodes 4k+1 frames, but not 21, 37, 53, ... (its 16-frame segments "
            "would end in one latent, which decodes to one frame)",
        ),
        pipeline_space=RAW,
    ),
    "easyanimate": RefVAEClass("AutoencoderKLMagvit", {"tae_easyanimate": "EasyAnimate"}, family="tae_easyanimate"),
    "vidtok": RefVAEClass(
        "AutoencoderVidTok",
        {"tae_vidtok": "VidTok"},
        family="tae_vidtok",
        latents="mode",
        frames_in_front=True,
        pipeline_space=RAW,
    ),
    "mochi": RefVAEClass(
        "AutoencoderKLMochi", {"tae_mochi": "Mochi 1"}, family="tae_mochi", pipeline_space=NORMALISED_SCALED
    ),
    "qwenimage21": RefVAEClass(
        "AutoencoderKLQwenImage21",
        {"tae_qwenimage2_1": "Qwen-Image 2.1"},
        family="tae_qwenimage2_1",
        latents="mode",
        frame_rule=FrameRule(lambda t: t == 1, "encodes single RGBA images (T = 1)"),
        pipeline_space=NORMALISED,
    ),
    "svd": RefVAEClass(
        "AutoencoderKLTemporalDecoder",
        {"tae_svd": "Stable Video Diffusion"},
        family="tae_svd",
        latents="mode",
        image_encoder=True,
    ),
    "hunyuanimage_refiner": RefVAEClass(
        "AutoencoderKLHunyuanImageRefiner",
        {"tae_hunyuanimage_refiner": "HunyuanImage 2.1's refiner"},
        family="tae_hunyuanimage_refiner",
    ),
}
