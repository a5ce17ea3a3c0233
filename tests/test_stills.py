"""Pictures for the report: which frames, tile sizes, the difference heat map, the latent
picture, and the labelled side-by-side comparison videos."""

from __future__ import annotations

import numpy as np
import torch

from evaluation.stills import HEADER_HEIGHT, comparison_stills, difference_heat_map, frame_indices
from evaluation.videos import latent_picture, rgb_beside_alpha, side_by_side


def test_frame_indices_are_first_middle_last():
    assert frame_indices(9) == [0, 4, 8] and frame_indices(17) == [0, 8, 16]
    assert frame_indices(2) == [0, 1] and frame_indices(1) == [0]


def test_the_heat_map_is_black_where_exact_and_bright_where_off():
    image = np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    assert difference_heat_map(image, image, 4).max() <= 4  # inferno's darkest colour
    off = image.copy()
    off[:4] = 255 - off[:4]
    heat = difference_heat_map(image, off, 4).astype(int).sum(axis=2)
    assert heat[4:].max() <= 4 and heat[:4].mean() > 300


def test_small_clips_are_upscaled_to_256_px_tiles_with_nearest_neighbour():
    video = np.random.default_rng(1).integers(0, 256, (9, 32, 48, 3), dtype=np.uint8)
    picture, shown = comparison_stills(video, video, video[:5])
    assert shown == [0, 2, 4]  # the reference VAE decoded only 5 frames: stay within both
    tile = 48 * 6  # ceil(256 / 48) = 6
    assert picture.shape == (HEADER_HEIGHT + 3 * (32 * 6 + 4), 4 * tile + 3 * 4, 3)
    first = picture[HEADER_HEIGHT : HEADER_HEIGHT + 32 * 6, :tile]
    assert np.array_equal(first[::6, ::6][12:, 40:], video[0][12:, 40:])  # nearest-neighbour (label corner left out)
    without_reference, _ = comparison_stills(video, video)
    assert without_reference.shape[1] == 3 * tile + 2 * 4


def test_small_comparison_videos_are_enlarged_with_sharp_pixels_and_labels():
    rng = np.random.default_rng(0)
    left, right = (rng.integers(0, 200, (2, 40, 60, 3), dtype=np.uint8) for _ in range(2))
    video = side_by_side(left, right)
    assert video.shape == (2, 280, 840, 3)  # x7: at least 256 px high
    below_labels = video[:, 70:, :420]
    assert (below_labels == np.repeat(np.repeat(left, 7, axis=1), 7, axis=2)[:, 70:]).all()
    assert (video[:, :70, :420] == 255).any() and (video[:, :70, 420:] == 255).any()  # both labels, in white
    assert side_by_side(left.repeat(8, axis=1), right.repeat(8, axis=1)).shape == (2, 320, 120, 3)


def test_comparison_videos_of_full_size_frames_in_any_memory_layout_get_their_labels():
    # decoded frames arrive as a permuted (T, C, H, W) tensor's view: not C-ordered
    planar = np.random.default_rng(0).integers(0, 200, (2, 3, 256, 32), dtype=np.uint8)
    frames = planar.transpose(0, 2, 3, 1)
    video = side_by_side(frames, frames)
    assert video.shape == (2, 256, 64, 3) and (video[:, :40] == 255).any()


def test_the_latent_picture_is_the_same_in_every_run():
    """Exact PCA with fixed signs: the same latents give the same picture whatever the global
    RNG holds (a randomised PCA made it vary from run to run), one tile per latent frame."""
    latents = torch.randn(3, 16, 6, 8, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    first = latent_picture(latents, scale=1)
    torch.manual_seed(2)
    assert np.array_equal(first, latent_picture(latents, scale=1))
    assert first.shape == (6, 3 * (8 + 2), 3) and first.std() > 20
    assert latent_picture(latents[:, :2], scale=1).shape == first.shape  # fewer than 3 channels


def test_rgba_stills_keep_the_alpha_and_rgba_videos_show_it_beside_the_colours():
    """RGBA clips: the image tiles of the stills keep their alpha (bands, labels and the heat
    map stay opaque); a video frame is the colours with the alpha in grey beside them."""
    video = np.random.default_rng(2).integers(0, 256, (3, 32, 32, 4), dtype=np.uint8)
    video[..., 3] = 0  # fully transparent
    picture, _ = comparison_stills(video, video)
    assert picture.shape[2] == 4
    tile = 32 * 8  # ceil(256 / 32) = 8
    first = picture[HEADER_HEIGHT : HEADER_HEIGHT + tile]
    assert (first[: tile // 2, :tile, 3] == 0).all()  # the original, above its opaque "frame 0" label
    assert (first[:, -tile:, 3] == 255).all()  # the heat map
    assert (picture[:HEADER_HEIGHT, ..., 3] == 255).all() and (first[:, tile : tile + 4, 3] == 255).all()
    assert (rgb_beside_alpha(video[..., :3]) == video[..., :3]).all()  # RGB frames as they are
    shown = rgb_beside_alpha(video)
    assert (
        shown.shape == (3, 32, 64, 3) and (shown[:, :, :32] == video[..., :3]).all() and (shown[:, :, 32:] == 0).all()
    )
