"""Frame counts of H.264/HEVC videos from their packets, where the packets prove them.

OpenCV's FFmpeg reader (``grab``) reads packets in file order, skips those of other
streams, sends each video packet to the decoder and returns once a frame comes out; it
stops for good when the demuxer or the decoder reports an error, after 4096 packets of
other streams in one call (OPENCV_FFMPEG_READ_ATTEMPTS), or once it has returned one
frame more than the container's count. At the end it drains the decoder. So in an
intact H.264/HEVC stream every packet that carries one picture gives one frame, except
packets flagged "discard" (an edit list trims them: the decoder decodes but drops
them): the shadow clip has 162 packets, the first two (pts -2 and -1) flagged, and 160
frames. The count below is that number, taken only where the packets prove it; any
doubt returns None and the caller decodes everything.

Where the packet count and the decode part: a damaged packet the decoder rejects ends
OpenCV's reading there, and the frames the decoder still held are lost (a copy of the
dog clip cut at 30 % has 74 packets, 71 frames decode; 4 KB of zeros in the cockatoo
clip stop it at 138 of 280); an H.264 decoder not told how deep B-frames reorder guesses
and drops the frames it put out too early; interlaced fields, parameter sets changing
size, frame_num gaps and leading pictures change the count too. Damage is looked for in
the bytes of every packet (lengths, escaped zeros) rather than by decoding a part of the
stream: a hole can be anywhere, and decoding even the last GOP would cost up to half
the full decode (the cockatoo clip's last GOP is 120 of its 280 frames).
"""

from __future__ import annotations

import bisect
import logging
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from taehv_train.common.video.files import Clip, openable

logger = logging.getLogger(__name__)

_OPENCV_READ_ATTEMPTS = int(os.environ.get("OPENCV_FFMPEG_READ_ATTEMPTS", "4096"))
_MAX_DECODER_DELAY = 16  # frames an H.264/HEVC decoder holds back at most (the DPB size)


@dataclass(frozen=True)
class PacketCount:
    """``frames``: what OpenCV decodes, proven from the packets; None where they do not
    prove it, ``unproven`` saying why (the caller then decodes every frame)."""

    frames: int | None
    unproven: str = ""


class _Unproven(Exception):
    """The packets do not prove the frame count (the message says why)."""


class _Bits:
    """MSB-first bit reader over an RBSP (emulation prevention removed), with exp-Golomb codes."""

    def __init__(self, rbsp: bytes):
        self._rest = int.from_bytes(rbsp, "big")  # the bits not read yet
        self._left = 8 * len(rbsp)

    def u(self, n: int) -> int:
        if n > self._left:
            raise _Unproven("a parameter set or slice header ends early")
        self._left -= n
        value = self._rest >> self._left
        self._rest -= value << self._left
        return value

    def ue(self) -> int:
        zeros = self._left - self._rest.bit_length()  # leading zero bits
        if zeros > 31:
            raise _Unproven("an exp-Golomb code longer than 32 bits")
        return self.u(2 * zeros + 1) - 1

    def se(self) -> int:
        k = self.ue()
        return (k + 1) // 2 if k % 2 else -(k // 2)


def _rbsp(nal_payload: bytes) -> bytes:
    """A NAL unit's payload without its emulation prevention bytes (00 00 03 -> 00 00)."""
    return nal_payload.replace(b"\x00\x00\x03", b"\x00\x00")


@dataclass(frozen=True)
class _H264Sps:
    log2_max_frame_num: int
    frame_mbs_only: bool
    separate_colour_plane: bool
    max_num_reorder_frames: int | None  # None: the SPS does not say (no bitstream_restriction)


_H264_HIGH_PROFILES = (100, 110, 122, 244, 44, 83, 86, 118, 128, 138, 139, 134, 135)


def _skip_h264_hrd(bits: _Bits) -> None:
    cpb_count = bits.ue() + 1
    bits.u(8)  # bit_rate_scale, cpb_size_scale
    for _ in range(cpb_count):
        bits.ue(), bits.ue(), bits.u(1)
    bits.u(20)  # the four delay/length fields


def _parse_h264_sps(payload: bytes) -> tuple[int, _H264Sps]:
    """(seq_parameter_set_id, what the count depends on) of an H.264 SPS NAL payload."""
    bits = _Bits(_rbsp(payload))
    profile_idc = bits.u(8)
    bits.u(16)  # constraint flags, level_idc
    sps_id = bits.ue()
    separate_colour_plane = False
    if profile_idc in _H264_HIGH_PROFILES:
        chroma_format_idc = bits.ue()
        if chroma_format_idc == 3:
            separate_colour_plane = bool(bits.u(1))
        bits.ue(), bits.ue(), bits.u(1)  # bit depths, qpprime_y_zero_transform_bypass_flag
        if bits.u(1):  # seq_scaling_matrix_present_flag
            for i in range(8 if chroma_format_idc != 3 else 12):
                if bits.u(1):
                    last = next_scale = 8
                    for _ in range(16 if i < 6 else 64):
                        if next_scale:
                            next_scale = (last + bits.se() + 256) % 256
                        last = next_scale or last
    log2_max_frame_num = bits.ue() + 4
    poc_type = bits.ue()
    if poc_type == 0:
        bits.ue()
    elif poc_type == 1:
        bits.u(1), bits.se(), bits.se()
        for _ in range(bits.ue()):
            bits.se()
    bits.ue(), bits.u(1), bits.ue(), bits.ue()  # max_num_ref_frames, gaps flag, width, height
    frame_mbs_only = bool(bits.u(1))
    if not frame_mbs_only:
        bits.u(1)
    bits.u(1)  # direct_8x8_inference_flag
    if bits.u(1):  # frame_cropping_flag
        bits.ue(), bits.ue(), bits.ue(), bits.ue()
    reorder = None
    if bits.u(1):  # vui_parameters_present_flag
        if bits.u(1) and bits.u(8) == 255:  # aspect ratio: Extended_SAR
            bits.u(32)
        if bits.u(1):  # overscan_info_present_flag
            bits.u(1)
        if bits.u(1):  # video_signal_type_present_flag
            bits.u(4)
            if bits.u(1):
                bits.u(24)
        if bits.u(1):  # chroma_loc_info_present_flag
            bits.ue(), bits.ue()
        if bits.u(1):  # timing_info_present_flag
            bits.u(65)
        nal_hrd = bits.u(1)
        if nal_hrd:
            _skip_h264_hrd(bits)
        vcl_hrd = bits.u(1)
        if vcl_hrd:
            _skip_h264_hrd(bits)
        if nal_hrd or vcl_hrd:
            bits.u(1)
        bits.u(1)  # pic_struct_present_flag
        if bits.u(1):  # bitstream_restriction_flag
            bits.u(1), bits.ue(), bits.ue(), bits.ue(), bits.ue()
            reorder = bits.ue()
    return sps_id, _H264Sps(log2_max_frame_num, frame_mbs_only, separate_colour_plane, reorder)


class _H264Pictures:
    """Checks each packet of an H.264 stream (length-prefixed NAL units, as MP4 and
    Matroska store it) for exactly one whole, well-formed progressive picture; tracks the
    parameter sets and frame_num."""

    def __init__(self, extradata: bytes):
        if len(extradata) < 7 or extradata[0] != 1:
            raise _Unproven("H.264 without an avcC record (Annex B start codes)")
        self.length_size = (extradata[4] & 3) + 1
        self.sps: dict[int, _H264Sps] = {}
        self.pps: dict[int, int] = {}  # pps id -> sps id
        self.sets: dict[tuple[int, int], bytes] = {}  # (NAL type, id) -> the first NAL seen
        pos = 5
        for nal_type, mask in ((7, 31), (8, 255)):  # the SPS count shares its byte with 3 reserved bits
            if pos >= len(extradata):
                raise _Unproven("the avcC record is cut short")
            count, pos = extradata[pos] & mask, pos + 1
            for _ in range(count):
                size = int.from_bytes(extradata[pos : pos + 2], "big")
                nal = extradata[pos + 2 : pos + 2 + size]
                if len(nal) != size or not nal or nal[0] & 31 != nal_type:
                    raise _Unproven("the avcC record is cut short")
                self._parameter_set(nal_type, nal)
                pos += 2 + size
        self.prev_ref_frame_num: int | None = None

    @property
    def reorder_limit(self) -> int:
        """The B-frame reordering every SPS tells the decoder (max_num_reorder_frames); 0
        where one does not: the decoder then guesses, and drops frames it put out too early."""
        limits = [s.max_num_reorder_frames or 0 for s in self.sps.values()]
        return min(limits) if limits else 0

    def _parameter_set(self, nal_type: int, nal: bytes) -> None:
        if nal_type == 7:
            sps_id, sps = _parse_h264_sps(nal[1:])
            if not sps.frame_mbs_only:
                raise _Unproven("interlaced H.264 (fields may come in separate packets)")
            if sps.separate_colour_plane:
                raise _Unproven("H.264 with separately coded colour planes")
            key, self.sps[sps_id] = (7, sps_id), sps
        else:
            bits = _Bits(_rbsp(nal[1:16]))
            pps_id, sps_id = bits.ue(), bits.ue()
            key, self.pps[pps_id] = (8, pps_id), sps_id
        # A parameter set that changes mid-stream (a new size) makes the decoder flush.
        if self.sets.setdefault(key, nal) != nal:
            raise _Unproven("a parameter set changes within the stream")

    def picture(self, data: bytes, first: bool) -> None:
        """Check one packet (``first``: the stream's first)."""
        starts = 0
        for start, end in _nal_units(data, self.length_size):
            header = data[start]
            nal_type, ref_idc = header & 31, (header >> 5) & 3
            if nal_type in (1, 5):
                if not data[start + 1] & 0x80:  # first_mb_in_slice > 0: a later slice
                    if starts == 0:
                        raise _Unproven("a packet does not start with a picture's first slice")
                    continue
                bits = _Bits(_rbsp(data[start + 1 : min(end, start + 24)]))
                _, slice_type, pps_id = bits.ue(), bits.ue(), bits.ue()
                if slice_type > 9 or self.pps.get(pps_id) not in self.sps:
                    raise _Unproven("a slice header names no known parameter set")
                sps = self.sps[self.pps[pps_id]]
                starts += 1
                if first and nal_type != 5:
                    raise _Unproven("the stream does not start with an IDR picture")
                self._check_frame_num(bits.u(sps.log2_max_frame_num), nal_type == 5, ref_idc, sps)
            elif nal_type in (7, 8):
                self._parameter_set(nal_type, data[start:end])
            elif nal_type not in (6, 9, 12):  # SEI, access unit delimiter, filler
                raise _Unproven(f"H.264 NAL unit of type {nal_type}")
        if starts != 1:
            raise _Unproven(f"a packet holds {starts} pictures")

    def _check_frame_num(self, frame_num: int, idr: bool, ref_idc: int, sps: _H264Sps) -> None:
        # A gap in frame_num makes the decoder invent missing frames: only consecutive
        # numbering (as every encoder writes it without frame dropping) is counted here.
        if idr:
            if frame_num != 0:
                raise _Unproven("an IDR picture with frame_num != 0")
        elif self.prev_ref_frame_num is None or frame_num not in (
            self.prev_ref_frame_num,
            (self.prev_ref_frame_num + 1) % (1 << sps.log2_max_frame_num),
        ):
            raise _Unproven("a gap in frame_num")
        if ref_idc:
            self.prev_ref_frame_num = frame_num


class _HevcPictures:
    """As ``_H264Pictures`` for HEVC (hvcC, length-prefixed NAL units)."""

    def __init__(self, extradata: bytes):
        if len(extradata) < 23 or extradata[0] != 1:
            raise _Unproven("HEVC without an hvcC record (Annex B start codes)")
        self.length_size = (extradata[21] & 3) + 1
        self.sets: dict[tuple[int, int], bytes] = {}
        pos = 23
        for _ in range(extradata[22]):
            nal_type, count = extradata[pos] & 63, int.from_bytes(extradata[pos + 1 : pos + 3], "big")
            pos += 3
            for _ in range(count):
                size = int.from_bytes(extradata[pos : pos + 2], "big")
                nal = extradata[pos + 2 : pos + 2 + size]
                if len(nal) != size or len(nal) < 3:
                    raise _Unproven("the hvcC record is cut short")
                if nal_type in (32, 33, 34):
                    self._parameter_set(nal_type, nal)
                pos += 2 + size
        self.reorder_limit = _MAX_DECODER_DELAY  # HEVC states its reordering: the decoder never guesses

    def _parameter_set(self, nal_type: int, nal: bytes) -> None:
        bits = _Bits(_rbsp(nal[2:24]))
        if nal_type == 32:
            set_id = bits.u(4)
        elif nal_type == 33:
            bits.u(8)  # sps_video_parameter_set_id, max_sub_layers, temporal nesting
            set_id = -1  # the SPS id follows the profile_tier_level: compared as bytes with any SPS
        else:
            set_id = bits.ue()
            bits.ue(), bits.u(1)  # pps_seq_parameter_set_id, dependent_slice_segments_enabled_flag
            if bits.u(1):  # output_flag_present_flag: a slice may say its picture is not output
                raise _Unproven("HEVC pictures may be marked not for output")
        if self.sets.setdefault((nal_type, set_id), nal) != nal:
            raise _Unproven("a parameter set changes within the stream")

    def picture(self, data: bytes, first: bool) -> None:
        starts = 0
        for start, end in _nal_units(data, self.length_size):
            if end - start < 3:
                raise _Unproven("an HEVC NAL unit shorter than its header")
            nal_type, layer = (data[start] >> 1) & 63, ((data[start] & 1) << 5) | (data[start + 1] >> 3)
            if layer != 0 or data[start + 1] & 7 == 0:
                raise _Unproven("a multi-layer HEVC stream")
            if nal_type <= 9 or 19 <= nal_type <= 21:  # VCL: trailing, leading, IDR, CRA pictures
                if data[start + 2] & 0x80:  # first_slice_segment_in_pic_flag
                    starts += 1
                    if nal_type >= 19 and not first and data[start + 2] & 0x40:
                        raise _Unproven("an IDR/CRA picture drops the pictures not yet output")
                    if first and nal_type not in (19, 20):
                        raise _Unproven("the stream does not start with an IDR picture")
                elif starts == 0:
                    raise _Unproven("a packet does not start with a picture's first slice")
            elif nal_type in (32, 33, 34):
                self._parameter_set(nal_type, data[start:end])
            elif nal_type not in (35, 38, 39, 40):  # delimiter, filler, SEI
                raise _Unproven(f"HEVC NAL unit of type {nal_type}")
        if starts != 1:
            raise _Unproven(f"a packet holds {starts} pictures")


_UNESCAPED_ZEROS = re.compile(rb"\x00\x00[\x00-\x02]")


def _nal_units(data: bytes, length_size: int) -> Iterator[tuple[int, int]]:
    """(start, end) of each length-prefixed NAL unit of a packet. The lengths must tile the
    packet exactly, and no unit may hold 00 00 00, 00 00 01 or 00 00 02 (an encoder escapes
    them, so they mean damage: zeroed bytes, another file's data) or end in a zero byte."""
    pos, size = 0, len(data)
    while pos < size:
        if pos + length_size > size:
            raise _Unproven("NAL unit lengths do not add up to the packet")
        length = int.from_bytes(data[pos : pos + length_size], "big")
        start, end = pos + length_size, pos + length_size + length
        if length == 0 or end > size:
            raise _Unproven("NAL unit lengths do not add up to the packet")
        if data[start] & 0x80 or data[end - 1] == 0:
            raise _Unproven("a NAL unit with a forbidden bit set or a trailing zero byte")
        if _UNESCAPED_ZEROS.search(data, start, end):
            raise _Unproven("a run of zero bytes inside a NAL unit")
        yield start, end
        pos = end


def _reorder_depth(pts: Sequence[int], limit: int) -> int:
    """How many frames the decoder must hold back to output these presentation times,
    given in decode order (at most ``limit + 1``: more is not told apart)."""
    largest: list[int] = []  # the limit + 1 largest times so far, ascending
    depth = 0
    for t in pts:
        depth = max(depth, len(largest) - bisect.bisect_right(largest, t))
        bisect.insort(largest, t)
        del largest[: -(limit + 1)]
    return depth


def count_frames_from_packets(path: Clip, container_count: int) -> PacketCount:
    """The number of frames OpenCV decodes from ``path``, from its packets alone, or None
    where they do not prove it (``unproven`` says why, also logged at DEBUG).

    ``container_count`` is what OpenCV states (``VideoReader.container_frame_count``): it
    must agree with the container's index. Proven only for H.264 and HEVC stored as
    length-prefixed NAL units (MP4, MOV, Matroska), where every packet of the video stream
    OpenCV reads (its first) is read without error or short read and holds exactly one
    whole progressive picture whose NAL units are intact (lengths tile the packet, no runs
    of zero bytes, known parameter sets that never change, consecutive frame_num), the
    stream starts with an IDR picture, its B-frame reordering stays within what the decoder
    is told, and packets of other streams never come in runs OpenCV gives up on. The count
    is then the packets not flagged discard.
    """
    import av  # PyAV: the packets without decoding them

    try:
        return PacketCount(_count_frames_from_packets(path, container_count))
    except _Unproven as why:
        logger.debug("%s: counting frames by decoding them: %s", path, why)
        return PacketCount(None, str(why))
    except av.FFmpegError as err:  # the full decode meets the same error and reports the file
        logger.debug("%s: counting frames by decoding them: PyAV: %s", path, err)
        return PacketCount(None, f"PyAV: {err}")


def _count_frames_from_packets(path: Clip, container_count: int) -> int:
    import av

    # Opening probes the streams without decoding any frame, and as few packets as it may:
    # only the packets are read here (the same ones, in the same order, as OpenCV's).
    with av.open(
        openable(path), options={"skip_frame": "all", "probesize": "32"}, metadata_errors="replace"
    ) as container:
        videos = container.streams.video
        if not videos:
            raise _Unproven("no video stream")
        video = videos[0]  # the one OpenCV reads
        codec = video.codec_context.name if video.codec_context is not None else None
        extradata = (video.codec_context.extradata or b"") if codec else b""
        if codec == "h264":
            pictures: _H264Pictures | _HevcPictures = _H264Pictures(extradata)
        elif codec == "hevc":
            pictures = _HevcPictures(extradata)
        else:
            raise _Unproven(f"codec {codec}: only H.264 and HEVC are counted from packets")
        gaps: list[int] = []  # packets of other streams before each video packet
        pts: list[int] = []
        others = discarded = discard_run = longest_discard_run = 0
        ended = False
        for packet in container.demux():
            if packet.stream_index != video.index:
                others += 1
                continue
            if packet.size == 0 and packet.pts is None and packet.dts is None:
                ended = True  # PyAV's flush packet: the demuxer has ended
                continue
            if ended or packet.size == 0:
                raise _Unproven("an empty video packet")
            if packet.is_corrupt:
                raise _Unproven("a video packet is cut short (truncated file?)")
            if packet.pts is None:
                raise _Unproven("a video packet without a presentation time")
            if not pts and not packet.is_keyframe:
                raise _Unproven("the first video packet is no keyframe")
            pictures.picture(bytes(packet), first=not pts)
            gaps.append(others)
            others = 0
            pts.append(packet.pts)
            discard_run = discard_run + 1 if packet.is_discard else 0
            longest_discard_run = max(longest_discard_run, discard_run)
            discarded += packet.is_discard
        gaps.append(others)
        index_count = video.frames
    packets = len(pts)
    frames = packets - discarded
    if frames < 1:
        raise _Unproven("no video packet to count")
    if index_count > 0:
        if not packets == index_count == container_count:
            raise _Unproven(f"{packets} video packets, the index lists {index_count}, OpenCV states {container_count}")
    elif abs(container_count - frames) > 1:  # no index: OpenCV's estimate from the duration
        raise _Unproven(f"{frames} frames, OpenCV estimates {container_count} from the duration")
    depth = _reorder_depth(pts, pictures.reorder_limit)
    if depth > pictures.reorder_limit:
        raise _Unproven(f"B-frames reordered {depth} deep, more than the stream tells the decoder")
    if len(set(pts)) != packets:
        raise _Unproven("video packets share presentation times")
    # One grab reads every packet until a frame comes out: at most the decoder's delay,
    # plus discarded frames, plus one video packets, with the other streams' packets between.
    window = min(len(gaps), _MAX_DECODER_DELAY + longest_discard_run + 2)
    reads = sum(gaps[:window])
    most = reads
    for i in range(window, len(gaps)):
        reads += gaps[i] - gaps[i - window]
        most = max(most, reads)
    if most > _OPENCV_READ_ATTEMPTS:
        raise _Unproven(f"{most} packets of other streams around a few video packets (OpenCV gives up)")
    return frames
