"""Pictures for the report: which frames, tile sizes, the difference heat map, the latent
picture, and the labelled side-by-side comparison videos."""

from __future__ import annotations

import cv2
import numpy as np
import torch

from taehv_train.evaluation.stills import (
    HEADER_HEIGHT,
    comparison_stills,
    difference_heat_map,
    frame_indices,
    tile_size,
)
from taehv_train.evaluation.videos import latent_picture, rgb_beside_alpha, side_by_side


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


def test_small_clips_are_enlarged_smoothly_until_the_shorter_side_is_256_px():
    video = np.random.default_rng(1).integers(0, 256, (9, 32, 48, 3), dtype=np.uint8)
    picture, shown = comparison_stills(video, video, video[:5])
    assert shown == [0, 2, 4]  # the reference VAE decoded only 5 frames: stay within both
    tile_h, tile_w = 256, 384  # x8: the shorter side 32 -> 256, the aspect ratio kept
    assert picture.shape == (HEADER_HEIGHT + 3 * (tile_h + 4), 4 * tile_w + 3 * 4, 3)
    first = picture[HEADER_HEIGHT : HEADER_HEIGHT + tile_h, :tile_w]
    bicubic = cv2.resize(video[0], (tile_w, tile_h), interpolation=cv2.INTER_CUBIC)
    assert np.array_equal(first[:200], bicubic[:200])  # above the frame label
    assert len(np.unique(first[:8, :8].reshape(-1, 3), axis=0)) > 8  # no 8x8 blocks of one colour
    without_reference, _ = comparison_stills(video, video)
    assert without_reference.shape[1] == 3 * tile_w + 2 * 4


def test_tiles_keep_the_aspect_ratio_between_256_and_640_px():
    assert tile_size(32, 48) == (256, 384) and tile_size(72, 40) == (461, 256)  # landscape, portrait
    assert tile_size(480, 848) == (362, 640) and tile_size(1928, 1080) == (640, 359)  # large ones reduced
    assert tile_size(300, 400) == (300, 400)  # within both bounds: as it is
    assert tile_size(16, 512) == (256, 8192)  # an extreme strip: the shorter side wins
    portrait = np.random.default_rng(3).integers(0, 256, (3, 1928, 1080, 3), dtype=np.uint8)
    picture, _ = comparison_stills(portrait, portrait)
    assert picture.shape == (HEADER_HEIGHT + 3 * (640 + 4), 3 * 359 + 2 * 4, 3)


def test_small_comparison_videos_are_enlarged_smoothly_with_labels():
    rng = np.random.default_rng(0)
    left, right = (rng.integers(0, 200, (2, 40, 60, 3), dtype=np.uint8) for _ in range(2))
    video = side_by_side(left, right)
    assert video.shape == (2, 280, 840, 3)  # x7: at least 256 px high
    below_labels = video[:, 70:, :420]
    assert (below_labels[0] == cv2.resize(left[0], (420, 280), interpolation=cv2.INTER_CUBIC)[70:]).all()
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


def test_the_latent_picture_is_legible_and_wraps_long_clips():
    """By default a latent frame's tile is at least 128 px on its shorter side (whole blocks
    per latent); frames beyond 1200 px go on to further rows."""
    small = latent_picture(torch.randn(3, 16, 4, 6))  # a 32x48 clip's latents: x32
    assert small.shape == (4 * 32, 3 * (6 + 2) * 32, 3)
    assert (small[:32, :32] == small[0, 0]).all()  # one latent, one block
    many = latent_picture(torch.randn(13, 16, 135, 240))  # 49 frames of 1080x1920: 4 tiles a row, 4 rows
    assert many.shape == (4 * (135 + 2), 4 * (240 + 2), 3) and (many[-137:, -242:] == 255).all()


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
