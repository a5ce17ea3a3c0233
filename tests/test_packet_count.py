"""Frame counts from packets (common/video/packet_count.py): ``probe_video`` counts an H.264/HEVC
video's frames without decoding them where the packets prove the count, and the count is
the full decode's on real clips, damaged copies and encoder settings that change it."""

from __future__ import annotations

import fractions
from pathlib import Path

import av
import numpy as np
import pytest
from test_dataset import DOG, GOPRO, SHADOW, START, VEHDET, write_audio_only_mp4, write_rgba

from bench.bench_annotate import damaged_copies
from taehv_train.common.video.files import BadClipError
from taehv_train.common.video.packet_count import PacketCount, count_frames_from_packets
from taehv_train.common.video.probe import VideoInfo, probe_video
from taehv_train.common.video.reader import VideoReader


def write_encoded_clip(
    path: Path, codec: str, n_frames: int = 30, options: dict[str, str] | None = None, irregular: bool = False
) -> Path:
    """A 64x96 clip of drifting noise (so that encoders use B-frames) encoded by PyAV with
    ``codec`` and ``options``, in the container its suffix names; ``irregular``: frames 40 ms
    apart, every third one 13 ms late (a variable frame rate)."""
    noise = np.random.default_rng(0).integers(0, 256, (64, 96, 3), np.uint8)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=25, options=options or {})
        stream.width, stream.height, stream.pix_fmt = 96, 64, "yuv420p"
        if irregular:
            stream.codec_context.time_base = fractions.Fraction(1, 1000)
        for i in range(n_frames):
            frame = av.VideoFrame.from_ndarray(np.roll(noise, 3 * i, axis=1), format="rgb24")
            if irregular:
                frame.pts, frame.time_base = 40 * i + 13 * (i % 3 == 2), fractions.Fraction(1, 1000)
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


def write_trimmed_copy(source: Path, path: Path, frames: int) -> Path:
    """``source``'s video packets with timestamps ``frames`` frames earlier: the MP4 gets an
    edit list starting at 0, so its first ``frames`` frames (presentation order, B-frames
    included) are read as packets flagged discard, which decode but are not output."""
    with av.open(str(source)) as original, av.open(str(path), "w") as copy:
        video = original.streams.video[0]
        stream = copy.add_stream_from_template(video)
        for packet in original.demux(video):
            if packet.size:
                packet.pts -= frames * packet.duration
                packet.dts -= frames * packet.duration
                packet.stream = stream
                copy.mux(packet)
    return path


def write_long_audio_tail(path: Path) -> Path:
    """10 H.264 frames (B-frames) in Matroska, then 5000 tiny PCM audio packets: OpenCV's
    grab gives up after 4096 packets of other streams, before draining the decoder."""
    with av.open(str(path), "w") as container:
        video = container.add_stream("libx264", rate=25, options={"bframes": "3"})
        video.width, video.height, video.pix_fmt = 96, 64, "yuv420p"
        audio = container.add_stream("pcm_s16le", rate=8000)
        noise = np.random.default_rng(0).integers(0, 256, (64, 96, 3), np.uint8)
        for i in range(10):
            container.mux(video.encode(av.VideoFrame.from_ndarray(np.roll(noise, 3 * i, axis=1), format="rgb24")))
        container.mux(video.encode(None))
        for i in range(5000):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 16), np.int16), format="s16", layout="mono")
            frame.sample_rate, frame.pts = 8000, 16 * i
            container.mux(audio.encode(frame))
        container.mux(audio.encode(None))
    return path


def probed(path: Path, exact_decode: bool) -> VideoInfo | str:
    """probe_video's result, or the skip reason it raises."""
    try:
        return probe_video(path, exact_decode=exact_decode)
    except BadClipError as err:
        return str(err)


def packet_count(path: Path) -> PacketCount:
    with VideoReader(str(path)) as reader:
        return count_frames_from_packets(str(path), reader.container_frame_count)


ENCODED = {  # (codec, suffix, encoder options): the packets prove the count
    "x264-b-pyramid": ("libx264", ".mp4", {"bframes": "3", "b-pyramid": "normal", "keyint": "12", "preset": "medium"}),
    "x264-open-gop": ("libx264", ".mp4", {"bframes": "3", "x264-params": "open-gop=1:keyint=10:min-keyint=10"}),
    "x264-4-slices": ("libx264", ".mp4", {"bframes": "2", "x264-params": "slices=4"}),
    "x264-intra-refresh": ("libx264", ".mp4", {"x264-params": "intra-refresh=1:keyint=10"}),
    "x264-mkv": ("libx264", ".mkv", {"bframes": "3"}),
    "x264-mov": ("libx264", ".mov", {"bframes": "3"}),
    "x265-open-gop": ("libx265", ".mp4", {"x265-params": "log-level=error:keyint=12:bframes=3"}),
    "x265-mkv": ("libx265", ".mkv", {"x265-params": "log-level=error"}),
}
DECODED = {  # the packets do not prove the count: every frame is decoded
    "x264-interlaced": ("libx264", ".mp4", {"bframes": "2", "x264-params": "interlaced=1"}),
    "mpeg4-avi": ("mpeg4", ".avi", {"bf": "2"}),
    "vp9-webm": ("libvpx-vp9", ".webm", {"deadline": "realtime", "cpu-used": "8"}),
}


@pytest.mark.parametrize("name", [GOPRO, "imageio_cockatoo_yuv420.mp4", DOG, SHADOW, START, VEHDET])
def test_real_clips_are_counted_from_packets_as_the_full_decode_counts(videos_dir, name):
    """Each shared clip's length comes from its packets, equal to decoding every frame (the
    shadow clip: 162 packets, the first two flagged discard by its edit list, 160 frames)."""
    exact = probe_video(videos_dir / name, exact_decode=True)
    assert probe_video(videos_dir / name) == exact
    assert packet_count(videos_dir / name) == PacketCount(exact.frames)


@pytest.mark.parametrize("name", [DOG, VEHDET])  # moov first: every cut still opens
def test_damaged_copies_are_counted_or_refused_as_the_full_decode_does(videos_dir, tmp_path, name):
    """Cut at 30/60/90 %, 4 KB of zeros at 50 %, header or index zeroed: the same length or
    the same skip reason as decoding every frame; a cut or zeroed clip is left to the decode."""
    copies = damaged_copies(videos_dir / name, tmp_path)
    for path in copies:
        assert probed(path, exact_decode=False) == probed(path, exact_decode=True), path.name
    stem = Path(name).stem
    for damage in ("cut30", "cut60", "cut90", "zeros50"):
        assert packet_count(tmp_path / f"{stem}_{damage}.mp4").frames is None, damage


@pytest.mark.parametrize("case", ENCODED)
def test_h264_and_hevc_clips_are_counted_from_packets_exactly(tmp_path, case):
    codec, suffix, options = ENCODED[case]
    path = write_encoded_clip(tmp_path / f"clip{suffix}", codec, options=options)
    assert probe_video(path) == probe_video(path, exact_decode=True)
    assert packet_count(path) == PacketCount(30)


@pytest.mark.parametrize("case", DECODED)
def test_clips_the_packets_do_not_prove_are_decoded(tmp_path, case):
    codec, suffix, options = DECODED[case]
    path = write_encoded_clip(tmp_path / f"clip{suffix}", codec, options=options)
    assert probe_video(path) == probe_video(path, exact_decode=True)
    assert probe_video(path).frames == 30
    assert packet_count(path).frames is None and packet_count(path).unproven


def test_variable_frame_rate_and_edit_list_trimmed_b_frames_are_counted_exactly(tmp_path):
    for suffix in (".mp4", ".mkv"):
        path = write_encoded_clip(tmp_path / f"vfr{suffix}", "libx264", options={"bframes": "2"}, irregular=True)
        assert probe_video(path) == probe_video(path, exact_decode=True)
        assert packet_count(path) == PacketCount(30)
    source = write_encoded_clip(tmp_path / "b.mp4", "libx264", options={"bframes": "3", "b-pyramid": "normal"})
    trimmed = write_trimmed_copy(source, tmp_path / "trimmed.mp4", frames=2)
    assert probe_video(trimmed, exact_decode=True).frames == 28
    assert probe_video(trimmed) == probe_video(trimmed, exact_decode=True)
    assert packet_count(trimmed) == PacketCount(28)


def test_other_streams_running_on_after_the_video_are_decoded(tmp_path):
    """OpenCV stops after 4096 packets of other streams in one grab, losing the frames the
    decoder still holds (8 of 10 decode): such a file is not counted from its packets, even
    where its stated count would agree."""
    path = write_long_audio_tail(tmp_path / "tail.mkv")
    assert probe_video(path, exact_decode=True).frames == 8
    assert probe_video(path) == probe_video(path, exact_decode=True)
    assert "packets of other streams" in count_frames_from_packets(str(path), 10).unproven


def test_non_video_files_keep_their_skip_reasons_and_images_their_reader(tmp_path):
    audio = write_audio_only_mp4(tmp_path / "audio.mp4")
    (tmp_path / "notes.mp4").write_text("not a video\n" * 100)
    reason = "no video stream: it has only audio streams"
    assert probed(audio, exact_decode=False) == probed(audio, exact_decode=True) == reason
    notes = probed(tmp_path / "notes.mp4", exact_decode=False)
    assert notes == probed(tmp_path / "notes.mp4", exact_decode=True) and notes.startswith("unreadable")
    write_rgba(tmp_path / "still.png")
    assert probe_video(tmp_path / "still.png") == probe_video(tmp_path / "still.png", exact_decode=True)
    assert probe_video(tmp_path / "still.png").frames == 1
