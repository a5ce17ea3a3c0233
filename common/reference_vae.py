"""The frozen reference VAE: any diffusers video VAE of ``models.vae_classes.REF_VAE_CLASSES``.

TAEHV lives in the reference VAE's latent space, so its latents are what the TAE learns: encoder
targets, and decoder inputs. They come out of ``encode`` (and go into ``decode``) in the TAE's
own space (raw, scaled or normalised: ``models.latent_spaces``), converted by one
``LatentTransform``, so the training targets, the latent cache, validation and
``inference.py --use_ref_vae`` all see the same latents. Training and the latent-cache builder build it from a config's
``ref_vae_*`` keys (``ReferenceVAE.from_config``), ``inference.py --use_ref_vae`` from its
options (``ReferenceVAE.for_variant``): loaded once, frozen, kept out of
``accelerator.prepare`` (DeepSpeed would demand an optimizer for it). A missing or
broken model, or one whose latent space does not fit the TAE variant, is an error at
start-up, never a silent fallback to another VAE or to random latents.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from taehv_train.base.errors import UserError
from taehv_train.common.config import DTYPES, TrainConfig
from taehv_train.models.latent_spaces import AUTO_SPACE, OWN, SPACES, LatentTransform
from taehv_train.models.vae_classes import REF_VAE_CLASSES
from taehv_train.models.vae_registry import (
    AUTO_CLASS,
    latent_space,
    read_vae_config,
    ref_vae_problems,
    reference_transform,
    reference_vae_frames,
    reference_vae_rule,
    resolve_ref_vae_class,
    resolve_space,
    spaces_of,
)
from taehv_train.models.variants import VariantSpec

logger = logging.getLogger(__name__)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def to_diffusers(frames: torch.Tensor, pixels: str = "signed") -> torch.Tensor:
    """NTCHW in [0, 1] -> diffusers' NCTHW: in [-1, 1], or ImageNet-normalised (MiniMax H3)."""
    x = frames.permute(0, 2, 1, 3, 4)
    if pixels == "imagenet":
        mean, std = (
            torch.tensor(v, device=x.device, dtype=x.dtype).view(1, 3, 1, 1, 1) for v in (IMAGENET_MEAN, IMAGENET_STD)
        )
        return (x - mean) / std
    return x.mul(2).sub(1)


def from_diffusers_pixels(x: torch.Tensor, pixels: str = "signed") -> torch.Tensor:
    """diffusers' NCTHW decoded pixels -> NTCHW frames in [0, 1] (the inverse of ``to_diffusers``)."""
    if pixels == "imagenet":
        mean, std = (
            torch.tensor(v, device=x.device, dtype=x.dtype).view(1, 3, 1, 1, 1) for v in (IMAGENET_MEAN, IMAGENET_STD)
        )
        x = x * std + mean
    else:
        x = x.add(1).div(2)
    return x.permute(0, 2, 1, 3, 4).clamp(0, 1)


def from_diffusers(latents: torch.Tensor) -> torch.Tensor:
    """diffusers' NCTHW latents -> NTCHW (TAEHV's layout)."""
    return latents.permute(0, 2, 1, 3, 4)


def folder_problems(config: TrainConfig, variant: str) -> list[str]:
    """What makes ``ref_vae_path`` unfit to teach ``variant``, read from the model folder's
    ``config.json`` and its weight files' headers (``weight_problems``): checked before
    launch, and before the weights are loaded."""
    folder = Path(config.ref_vae_path) / config.ref_vae_subfolder
    return ref_vae_problems(config.ref_vae_class, folder, variant) or weight_problems(config.ref_vae_class, folder)


# the files diffusers' from_pretrained reads the weights from (no variant), in its order
SHARDED_WEIGHTS, SAFETENSORS_WEIGHTS, PICKLED_WEIGHTS = (
    "diffusion_pytorch_model.safetensors.index.json",
    "diffusion_pytorch_model.safetensors",
    "diffusion_pytorch_model.bin",
)
LFS_POINTER = b"version https://git-lfs"
LOAD_ADVICE = "are its config.json and weights complete and from the same model?"


def weight_problems(ref_vae_class: str, folder: Path) -> list[str]:
    """What keeps diffusers from loading the weights in ``folder`` into the model its
    ``config.json`` describes: no weight file, an unreadable one, or tensors of other shapes
    than the model's, or missing ones (diffusers would leave those random). Read from the
    safetensors headers and the model built on the meta device, so no weights are loaded
    (milliseconds); a ``.bin`` file is only found, its shapes are checked when it loads.
    Call it on a folder whose ``config.json`` passed ``ref_vae_problems``."""
    folder = Path(folder)
    try:
        saved, weights = _saved_shapes(folder)
    except ValueError as err:
        return [f"reference VAE {folder}: {err}"]
    if saved is None:
        return []
    diffusers_class = REF_VAE_CLASSES[resolve_ref_vae_class(ref_vae_class, folder)].diffusers_class
    try:
        expected = _model_shapes(diffusers_class, read_vae_config(folder))
    except (TypeError, ValueError, KeyError) as err:
        return [
            f"reference VAE {folder}: diffusers cannot build an {diffusers_class} from its config.json "
            f"({type(err).__name__}: {err}): {LOAD_ADVICE}"
        ]
    differ = [(key, saved[key], shape) for key, shape in expected.items() if key in saved and saved[key] != shape]
    if differ:
        key, in_file, in_model = differ[0]
        return [
            f"reference VAE {folder}: {len(differ)} of the {len(expected)} tensors in {weights} do not fit the "
            f"{diffusers_class} its config.json describes; the first, {key}, is {list(in_file)} there and "
            f"{list(in_model)} in the model: {LOAD_ADVICE}"
        ]
    missing = [key for key in expected if key not in saved]
    if missing:
        return [
            f"reference VAE {folder}: {weights} lacks {len(missing)} of the {len(expected)} tensors of the "
            f"{diffusers_class} its config.json describes (the first: {missing[0]}), which diffusers would leave "
            f"random: {LOAD_ADVICE}"
        ]
    return []


def _saved_shapes(folder: Path) -> tuple[dict[str, tuple[int, ...]] | None, str]:
    """The shape of every tensor in the weights diffusers would load from ``folder``, and
    their file name for messages; None for the shapes of a ``.bin`` file. ValueError saying
    what is missing or unreadable."""
    if (folder / SHARDED_WEIGHTS).is_file():
        shards = _shard_files(folder / SHARDED_WEIGHTS)
        shapes = {}
        for shard in shards:
            shapes.update(_header_shapes(folder / shard))
        return shapes, f"the {len(shards)} shards of {SHARDED_WEIGHTS}"
    if (folder / SAFETENSORS_WEIGHTS).is_file():
        return _header_shapes(folder / SAFETENSORS_WEIGHTS), SAFETENSORS_WEIGHTS
    if (folder / PICKLED_WEIGHTS).is_file():
        return None, PICKLED_WEIGHTS
    others = sorted(
        p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")
    )
    raise ValueError(
        f"no weights next to its config.json: diffusers looks for {SAFETENSORS_WEIGHTS}, "
        f"{SHARDED_WEIGHTS} (sharded) or {PICKLED_WEIGHTS}"
        + (f", and the folder holds only {', '.join(others)}" if others else "")
        + ": copy the VAE's weights there"
    )


def _shard_files(index_file: Path) -> list[str]:
    """The shard file names a safetensors index lists, each checked to be in its folder."""
    try:
        index = json.loads(index_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{index_file.name} is not valid JSON ({err})") from None
    if not (isinstance(index, dict) and isinstance(index.get("weight_map"), dict) and "metadata" in index):
        raise ValueError(
            f"{index_file.name} is not a safetensors index (a JSON object with 'metadata' and 'weight_map')"
        )
    shards = sorted({str(name) for name in index["weight_map"].values()})
    absent = [name for name in shards if Path(name).name != name or not (index_file.parent / name).is_file()]
    if absent:
        raise ValueError(
            f"{index_file.name} lists {len(absent)} shard(s) not in the folder ({', '.join(absent[:3])}"
            + (", ..." if len(absent) > 3 else "")
            + "): copy every shard there"
        )
    return shards


def _header_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Tensor shapes from a safetensors file's header (its tensors are not read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with file.open("rb") as head:
            start = head.read(len(LFS_POINTER))
    except OSError as err:
        raise ValueError(f"cannot read {file.name} ({err.strerror or err}): check its permissions") from None
    if start == LFS_POINTER:
        raise ValueError(
            f"{file.name} is a git-lfs pointer, not the weights: run `git lfs pull` in the model's repository"
        )
    try:
        with safe_open(str(file), framework="pt") as weights:
            return {key: tuple(weights.get_slice(key).get_shape()) for key in weights.keys()}
    except SafetensorError as err:
        raise ValueError(f"{file.name} is not a readable safetensors file ({err}): copy it again") from None


def _model_shapes(diffusers_class: str, config: dict) -> dict[str, tuple[int, ...]]:
    """The state dict shapes of the diffusers model ``config`` describes, built on the meta
    device (no memory, no initialisation), as ``from_pretrained`` builds it."""
    import diffusers
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=True):
        model = getattr(diffusers, diffusers_class).from_config(dict(config))
    return {key: tuple(value.shape) for key, value in model.state_dict().items()}


def config_errors(config: TrainConfig, spec: VariantSpec) -> list[str]:
    """What is wrong with the ``ref_vae_*`` keys: the class, the dtype, the frame count the
    reference VAE takes, and the model folder itself."""
    found = []
    known = config.ref_vae_class in REF_VAE_CLASSES or config.ref_vae_class == AUTO_CLASS
    if not known:
        found.append(f"ref_vae_class must be {AUTO_CLASS} or one of {', '.join(REF_VAE_CLASSES)}")
    if config.ref_vae_dtype not in DTYPES:
        found.append(f"ref_vae_dtype must be one of {', '.join(DTYPES)}")
    if not config.ref_vae_path:
        if config.latent_space not in (AUTO_SPACE, OWN):
            found.append(
                f"latent_space={config.latent_space} needs a reference VAE (ref_vae_path); without one the TAE "
                f"learns a space of its own ({OWN})"
            )
        return found
    if config.latent_space not in (AUTO_SPACE, *SPACES):
        found.append(f"latent_space must be {AUTO_SPACE} or one of {', '.join(SPACES)}, got {config.latent_space!r}")
    plan = spec.plan(config.n_frames)
    if not (plan.exact and reference_vae_frames(config.n_frames, spec)):
        exact = spec.exact_frame_counts(64)
        valid = [t for t in exact if reference_vae_frames(t, spec)][:8]  # for the message; the rule has no limit
        found.append(
            f"n_frames={config.n_frames} does not work with a reference VAE and {spec.name}: the reference "
            f"VAE {reference_vae_rule(spec)} and the decoder must return exactly the input frames "
            f"(here {plan.decoded_frames} from {plan.latent_frames} latents). Valid: {', '.join(map(str, valid))}, ..."
        )
    if Path(config.ref_vae_path).exists() and known:
        found.extend(folder_problems(config, config.variant))
    return found


def _diffusers_reason(err: BaseException) -> str:
    """diffusers' message for a folder it cannot load, without its advice about its own
    loading arguments: the first sentence."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text.split(". ", 1)[0].rstrip(".")


class ReferenceVAE:
    """Frozen diffusers VAE between NTCHW frames and NTCHW latents in a TAE's space
    (``space``: one of ``models.latent_spaces.SPACES``)."""

    def __init__(
        self,
        path: str | Path,
        vae_class: str = AUTO_CLASS,
        subfolder: str = "vae",
        dtype: str = "bf16",
        device: torch.device | str = "cpu",
        sample: bool = True,
        space: str = "raw",
    ):
        import diffusers

        if vae_class not in REF_VAE_CLASSES and vae_class != AUTO_CLASS:
            raise UserError(
                f"ref_vae_class must be {AUTO_CLASS} or one of {', '.join(REF_VAE_CLASSES)}, got {vae_class!r}"
            )
        path = Path(path)
        try:
            read_vae_config(path / subfolder)
        except ValueError as err:
            raise UserError(
                f"reference VAE: {err}; point at a local copy of the video model with its '{subfolder}' subfolder"
            ) from None
        try:
            vae_class = resolve_ref_vae_class(vae_class, path / subfolder)
        except ValueError as err:
            raise UserError(f"ref_vae_class=auto: {err}") from None
        self.ref, self.vae_class = REF_VAE_CLASSES[vae_class], vae_class
        if self.ref.refused:
            raise UserError(f"reference VAE {path / subfolder}: {self.ref.refused}")
        if self.ref.fp32_on_cpu and dtype != "fp32" and torch.device(device).type == "cpu":
            raise UserError(
                f"reference VAE {path / subfolder}: a {self.ref.diffusers_class} runs on the CPU in fp32 "
                f"only (its {dtype} average pooling is missing there): pass --ref_vae_dtype=fp32"
            )
        if found := weight_problems(vae_class, path / subfolder):
            raise UserError(found[0])
        self.vae = self._load(getattr(diffusers, self.ref.diffusers_class), path, subfolder, dtype).to(device).eval()
        self.vae.requires_grad_(False)
        if self.ref.time_tiles:  # it has no untiled path
            self.vae.enable_tiling()
        self.dtype = DTYPES[dtype]
        self.sample = sample and self.ref.latents == "sample"
        self.pixels, self.one_clip_at_a_time = self.ref.pixels, self.ref.one_clip_at_a_time
        self.latent_space = latent_space(vae_class, dict(self.vae.config))
        self.latent_channels = self.latent_space.latent_channels
        try:
            self.transform = reference_transform(space, vae_class, dict(self.vae.config), self.vae)
        except ValueError as err:
            raise UserError(f"reference VAE {path / subfolder}: {err}: set latent_space to one it has") from None
        # LTX VAEs with timestep conditioning decode at a timestep; 0 is the clean video
        self.decode_timestep = bool(getattr(self.vae.config, "timestep_conditioning", False))
        logger.info(
            "reference VAE %s from %s (%s, %.1fM parameters, %s); the TAE works on its %s",
            self.ref.diffusers_class,
            path,
            dtype,
            sum(p.numel() for p in self.vae.parameters()) / 1e6,
            self.latent_space.describe(),
            self.transform.describe(),
        )

    @staticmethod
    def _load(cls: type, path: Path, subfolder: str, dtype: str) -> torch.nn.Module:
        """``cls.from_pretrained`` of the folder; what diffusers cannot load (a missing or
        unreadable file, tensors of other shapes, tensors it would leave random) is a
        UserError naming the folder."""
        folder = path / subfolder
        try:
            vae, info = cls.from_pretrained(
                path, subfolder=subfolder, torch_dtype=DTYPES[dtype], output_loading_info=True
            )
        except (OSError, ValueError) as err:  # missing or unreadable files, other shapes (its meta load)
            raise UserError(f"reference VAE {folder}: {_diffusers_reason(err)}: {LOAD_ADVICE}") from err
        except RuntimeError as err:  # other shapes, when diffusers loads into initialised weights
            if "Error(s) in loading state_dict" not in str(err):
                raise
            raise UserError(f"reference VAE {folder}: {_diffusers_reason(err)}: {LOAD_ADVICE}") from err
        if info["missing_keys"]:
            missing = sorted(info["missing_keys"])
            raise UserError(
                f"reference VAE {folder}: its weights lack {len(missing)} tensors of the {cls.__name__} its "
                f"config.json describes (the first: {missing[0]}), which diffusers left random: {LOAD_ADVICE}"
            )
        return vae

    @classmethod
    def for_variant(
        cls,
        variant: str,
        path: str | Path,
        vae_class: str = AUTO_CLASS,
        subfolder: str = "vae",
        dtype: str = "bf16",
        device: torch.device | str = "cpu",
        sample: bool = True,
        space: str = AUTO_SPACE,
    ) -> ReferenceVAE:
        """The reference VAE in ``path``, checked (before loading it) against the TAE
        ``variant`` it teaches or is compared with, giving latents in ``space`` ("auto": the
        variant's, ``models.vae_registry.tae_space``)."""
        found = ref_vae_problems(vae_class, Path(path) / subfolder, variant)
        if found:
            raise UserError("; ".join(found))
        resolved_class = resolve_ref_vae_class(vae_class, Path(path) / subfolder)
        return cls(path, vae_class, subfolder, dtype, device, sample, resolve_space(space, variant, resolved_class))

    @classmethod
    def from_config(cls, config: TrainConfig, device: torch.device | str) -> ReferenceVAE:
        """The reference VAE a config names (``ref_vae_*`` keys), checked (before loading it)
        against the TAE variant it teaches."""
        return cls.for_variant(
            config.variant,
            config.ref_vae_path,
            config.ref_vae_class,
            config.ref_vae_subfolder,
            config.ref_vae_dtype,
            device,
            config.ref_latent_sample,
            config.latent_space,
        )

    def spaces(self) -> dict[str, LatentTransform]:
        """Every space this VAE's statistics define (``models.vae_registry.spaces_of``)."""
        return spaces_of(self.vae_class, dict(self.vae.config), self.vae)

    @torch.no_grad()
    def encode(
        self, frames: torch.Tensor, generator: torch.Generator | list[torch.Generator] | None = None
    ) -> torch.Tensor:
        """Latents in the TAE's space (NTCHW, float32) of NTCHW frames in [0, 1]."""
        if self.one_clip_at_a_time and frames.shape[0] > 1:
            generators = generator if isinstance(generator, list) else [generator] * frames.shape[0]
            return torch.cat([self.encode(clip[None], g) for clip, g in zip(frames, generators)])
        x = to_diffusers(frames, self.pixels).to(self.dtype)
        if self.ref.image_encoder:  # (N*T)CHW frames through a 2-D encoder
            x = x.transpose(1, 2).flatten(0, 1)
        elif self.ref.frames_in_front:  # as the class's own forward: the first frame repeated in front
            x = torch.cat([x[:, :, :1].expand(-1, -1, self.latent_space.temporal_compression - 1, -1, -1), x], 2)
        self._tile_whole_frames(x.shape[-2:])
        dist = self.vae.encode(x).latent_dist
        latents = dist.sample(generator=generator) if self.sample else dist.mode()
        if self.ref.image_encoder:
            return self.transform.to_tae(latents.unflatten(0, (frames.shape[0], -1)))
        return self.transform.to_tae(from_diffusers(latents))

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """NTCHW frames in [0, 1] from NTCHW latents in the TAE's space."""
        if self.one_clip_at_a_time and latents.shape[0] > 1:
            return torch.cat([self.decode(clip[None]) for clip in latents])
        latents = self.transform.to_raw(latents)
        if self.ref.image_encoder:  # one decode call sees all frames of a clip (its temporal layers mix them)
            frames = self.vae.decode(latents.flatten(0, 1).to(self.dtype), num_frames=latents.shape[1]).sample
            return from_diffusers_pixels(frames.unflatten(0, latents.shape[:2]).transpose(1, 2).float(), self.pixels)
        z = latents.permute(0, 2, 1, 3, 4).to(self.dtype)
        self._tile_whole_frames(tuple(side * self.latent_space.spatial_compression for side in z.shape[-2:]))
        if self.ref.time_tiles:  # its tiled decode returns NTCHW
            return from_diffusers_pixels(self.vae.decode(z).sample.transpose(1, 2).float(), self.pixels)
        if self.decode_timestep:
            frames = self.vae.decode(z, torch.zeros(z.shape[0], device=z.device, dtype=z.dtype)).sample
        else:
            output = self.vae.decode(z)
            frames = output if isinstance(output, torch.Tensor) else output.sample  # VidTok returns the tensor
        return from_diffusers_pixels(frames.float(), self.pixels)

    def _tile_whole_frames(self, size: tuple[int, int]) -> None:
        """Allegro tiles time as released (24 frames, 8 shared) and here takes each frame whole
        as one spatial tile: its released spatial tiles (its sample_size, fixed overlaps of
        120/80 pixels) cover only some frame sizes and silently leave the rest empty."""
        if self.ref.time_tiles:
            frames, stride = self.ref.time_tiles
            self.vae.kernel, self.vae.stride = (frames, *size), (stride, *size)
