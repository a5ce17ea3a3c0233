"""Published TAEs whose reference VAE diffusers cannot load (taeos1_3): what no config
says about it (its statistics, its time axis), kept here (``UNLOADED_REFERENCES``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .frames import opensora13_agrees, opensora13_latent_frames, plan_frames
from .latent_spaces import NORMALISED, LatentTransform
from .variants import SUPER_SUFFIX

# Open-Sora 1.3's latent statistics, per channel: hpcaitech/Open-Sora (tag v1.3)
# opensora/models/vae_v1_3/constants.py, VAE_STAT_DICT["video"] (lines 176-213). Its VAE's
# normalize_z (vae.py, lines 118-125) hands its DiT (z - mean) / std with them, as the 1.3
# inference and training configs set normalization="video" (configs/opensora-v1-3/inference/t2v.py,
# line 32). Diffusers has no class for that VAE, so no config holds them: they are kept here.
OPENSORA13_MEAN = (
    -0.19016949832439423, -0.04480062797665596, 0.020789705216884613, 0.01865335740149021,
    -0.011585569009184837, 0.0010865575168281794, 0.08378933370113373, 0.08902134001255035,
    0.00940945465117693, 0.08086848258972168, -0.07251627743244171, 0.05052144080400467,
    -0.0209724809974432, -0.1223079189658165, -0.003862356534227729, -0.023072388023138046,
)  # fmt: skip
OPENSORA13_STD = (
    0.9490776062011719, 0.9594117999076843, 0.9444302916526794, 0.9103284478187561,
    0.959351658821106, 0.8430351614952087, 0.8888124823570251, 0.9291136860847473,
    0.972594141960144, 0.8917953968048096, 0.8630853891372681, 0.8279891610145569,
    0.9114300012588501, 0.7922844886779785, 0.8991407155990601, 0.9473513960838318,
)  # fmt: skip


@dataclass(frozen=True)
class UnloadedReference:
    """A published TAE's reference VAE that diffusers has no class for: what no config says."""

    video_model: str
    transform: LatentTransform  # the map into the TAE's space, with the VAE's statistics
    latent_frames: Callable[[int], int]  # how many latents its pipeline has for a clip of T frames
    agrees: Callable[[int], bool]  # whether the TAE's latents of a clip of T frames line up with them
    time_axis: str  # how its VAE lays out time, for messages


# published TAEs whose reference VAE diffusers cannot load (a diffusers class's statistics are
# its defaults, ``class_defaults``)
UNLOADED_REFERENCES = {
    "taeos1_3": UnloadedReference(
        "Open-Sora 1.3",
        LatentTransform(NORMALISED, 1.0, OPENSORA13_MEAN, OPENSORA13_STD),
        opensora13_latent_frames,
        opensora13_agrees,
        "its VAE encodes 17-frame chunks sharing a frame, 5 latents each",
    ),
}


def published_transform(variant: str) -> LatentTransform | None:
    """The map into the space of a published TAE (a super decoder: its base's) whose
    reference VAE diffusers cannot load, None for every other."""
    found = UNLOADED_REFERENCES.get(variant.removesuffix(SUPER_SUFFIX))
    return found.transform if found else None


def reference_latents_note(variant: str, n_frames: int) -> str | None:
    """What scores of ``variant`` on clips of ``n_frames`` frames do not show, where its
    reference VAE (one diffusers cannot load) lays out such a clip's latents otherwise than
    the TAE (``models.frames.plan_frames``): the TAE's own roundtrip is scored, not its
    decode of the video model's latents. None where the two line up."""
    reference = UNLOADED_REFERENCES.get(variant.removesuffix(SUPER_SUFFIX))
    if reference is None or reference.agrees(n_frames):
        return None
    theirs, ours = reference.latent_frames(n_frames), plan_frames(n_frames).latent_frames
    return (
        f"{reference.video_model}'s pipeline has {theirs} latents for {n_frames} frames ({reference.time_axis}), "
        f"{variant} encodes them to {ours} as one sequence: these scores are of {variant}'s own latents, not of its "
        f"decode of {reference.video_model}'s (docs/evaluation.md, frame rules)"
    )
