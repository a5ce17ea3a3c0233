"""summary_report.html: one self-contained page a person can read: summary tables, the
preview score beside the whole-clip score, a per-frame PSNR chart, and for each sample
whether the run held it out or trained on it, still frames (original | reconstruction |
reference VAE | amplified difference), the comparison video with a poster frame, and its
latents. Pictures and videos keep their clip's aspect ratio and scale down to the page's
column (1200 pixels), so the page fits a 1280-pixel window whatever the clips' size."""

from __future__ import annotations

import base64
import html
import math
from pathlib import Path

import cv2

from taehv_train.base.atomic import atomic_write
from taehv_train.evaluation.evaluator import mean_text
from taehv_train.evaluation.frame_size import describe

MAX_EMBED_BYTES = 64 * 2**20  # larger sets of videos are linked, not embedded

STYLE = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1200px}
table{border-collapse:collapse;margin:12px 0}td,th{border:1px solid #ccc;padding:4px 10px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}
img,video{max-width:100%;height:auto}video{background:#000}
.sample{margin:18px 0;padding-top:8px;border-top:1px solid #ddd}
.stills img,.latents img{display:block}.latents img{image-rendering:pixelated}
.axis{stroke:#444}.grid{stroke:#e4e4e4}.line{fill:none;stroke-width:2}.ref{stroke-dasharray:5 3}
small{color:#666}
"""
COLORS = ("#3b7dd8", "#e0482c", "#2ca05a", "#9b4dca", "#e08a2c", "#1bb3c4", "#7f7f7f", "#c4a11b")
MIN_VIDEO_WIDTH, MAX_VIDEO_WIDTH, MAX_VIDEO_HEIGHT = 512, 1150, 720

# Each video reports its duration, each still picture its natural and displayed size and
# position on the page, and the page its full width, into the DOM once loaded (tests read them).
SCRIPT = """
window.addEventListener('load', function(){
  document.body.dataset.scrollWidth = document.documentElement.scrollWidth;
});
document.querySelectorAll('video').forEach(function(v){
  function mark(){ v.dataset.duration = v.duration; }
  if (v.readyState >= 1) { mark(); } else { v.addEventListener('loadedmetadata', mark); }
  v.addEventListener('error', function(){ v.dataset.error = 'failed'; });
});
document.querySelectorAll('.stills img').forEach(function(img){
  function mark(){
    var r = img.getBoundingClientRect();
    img.dataset.natural = img.naturalWidth + 'x' + img.naturalHeight;
    img.dataset.shown = Math.round(r.width) + 'x' + Math.round(r.height);
    img.dataset.at = Math.round(r.left + window.scrollX) + ',' + Math.round(r.top + window.scrollY);
  }
  if (img.complete) { mark(); } else { img.addEventListener('load', mark); }
});
"""


SETS = (
    "set: held-out (in the run's validation set: never trained on), training (the model saw it: its "
    "scores flatter it), neither (in neither of the run's sets), unknown (no run config to tell)"
)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(str(value))


def _table(headers: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _png(path: Path) -> str:
    return f"data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()}"


def _ticks(low: float, high: float, most: int = 6) -> list[float]:
    """Round tick values (steps of 1, 2 or 5 times a power of ten) from ``low`` to ``high``."""
    step = next(m * 10**e for e in range(-2, 6) for m in (1, 2, 5) if (high - low) / (m * 10**e) <= most)
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) // step) + 1)]


def _frame_chart(samples: list[dict]) -> str:
    """Inline SVG line chart: PSNR (dB) against frame index, one line per sample (dashed:
    the reference VAE on the same sample); a one-frame sample (an image) is a dot."""
    lines = [(i, "taehv", s["taehv"]["psnr_per_frame"]) for i, s in enumerate(samples)]
    lines += [(i, "reference", s["reference"]["psnr_per_frame"]) for i, s in enumerate(samples) if "reference" in s]
    values = [v for _, _, series in lines for v in series if math.isfinite(v)]
    low, high = math.floor(min(values, default=0.0)) - 1, math.ceil(max(values, default=1.0)) + 1
    frames = max(len(series) for _, _, series in lines)
    left, top, width, height = 56, 10, 640, 220

    def x(t: float) -> float:
        return left + width * t / max(frames - 1, 1)

    def y(v: float) -> float:
        return top + height * (high - min(max(v, low), high)) / (high - low)

    parts = [
        f'<svg width="{left + width + 180}" height="{top + height + 46}" role="img" '
        'aria-label="PSNR per frame" font-size="11">'
    ]
    for v in _ticks(low, high):
        parts.append(
            f'<line class="grid" x1="{left}" x2="{left + width}" y1="{y(v):.1f}" y2="{y(v):.1f}"/>'
            f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:g}</text>'
        )
    for t in sorted({round(v) for v in _ticks(0, max(frames - 1, 1), 8)} & set(range(frames))):
        parts.append(f'<text x="{x(t):.1f}" y="{top + height + 16}" text-anchor="middle">{t}</text>')
    parts.append(
        f'<line class="axis" x1="{left}" x2="{left}" y1="{top}" y2="{top + height}"/>'
        f'<line class="axis" x1="{left}" x2="{left + width}" y1="{top + height}" y2="{top + height}"/>'
        f'<text x="{left + width / 2}" y="{top + height + 36}" text-anchor="middle">frame</text>'
        f'<text transform="translate(14,{top + height / 2}) rotate(-90)" text-anchor="middle">PSNR (dB)</text>'
    )
    for n, (i, who, series) in enumerate(lines):
        color = COLORS[i % len(COLORS)]
        finite = [(x(t), y(v)) for t, v in enumerate(series) if math.isfinite(v)]
        points = " ".join(f"{px:.1f},{py:.1f}" for px, py in finite)
        dashed = " ref" if who == "reference" else ""
        label = f"sample {i}" + (" reference VAE" if who == "reference" else "")
        if len(finite) == 1:  # a polyline of one point draws nothing; the reference VAE's dot is hollow
            fill = "white" if who == "reference" else color
            parts.append(
                f'<circle cx="{finite[0][0]:.1f}" cy="{finite[0][1]:.1f}" r="3" fill="{fill}" stroke="{color}"/>'
            )
        parts.append(
            f'<polyline class="line{dashed}" stroke="{color}" points="{points}"><title>{label}</title></polyline>'
            f'<line class="line{dashed}" stroke="{color}" x1="{left + width + 12}" x2="{left + width + 36}" '
            f'y1="{top + 8 + 16 * n}" y2="{top + 8 + 16 * n}"/>'
            f'<text x="{left + width + 42}" y="{top + 12 + 16 * n}">{html.escape(label)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _video_tag(path: Path, poster: Path, output_dir: Path, embed: bool) -> str:
    """The comparison video at its poster's aspect ratio: at least MIN_VIDEO_WIDTH wide, at
    most MAX_VIDEO_WIDTH wide and MAX_VIDEO_HEIGHT high (a portrait clip stays on screen)."""
    src = (
        f"data:video/mp4;base64,{base64.b64encode(path.read_bytes()).decode()}"
        if embed
        else html.escape(str(path.relative_to(output_dir)))
    )
    height, width = cv2.imread(str(poster)).shape[:2]
    shown = round(min(max(width, MIN_VIDEO_WIDTH), MAX_VIDEO_WIDTH, MAX_VIDEO_HEIGHT * width / height))
    return (
        f'<video controls muted loop playsinline preload="metadata" width="{shown}" poster="{_png(poster)}" '
        f'src="{src}"></video>'
    )


def _stills(path: Path, frames: list[int], reference: bool) -> str:
    height, width = cv2.imread(str(path)).shape[:2]
    columns = "original | TAEHV | " + ("reference VAE | " if reference else "") + "difference"
    return (
        f"<div class='stills'><img alt='stills: {columns}, frames {frames}' width='{width}' height='{height}' "
        f"src='{_png(path)}'></div><small>frames {', '.join(map(str, frames))}: {columns} "
        "(absolute difference, amplified; black is exact)</small>"
    )


def _preview_section(summary: dict, frames: list[int]) -> list[str]:
    """The preview score beside the whole-clip score: what a live preview shows (ComfyUI's
    previewer decodes the first latent frame alone) is the first frame(s), not the clip."""
    decoded = f"frame {frames[0]}" if len(frames) == 1 else f"frames {frames[0]}-{frames[-1]}"
    shown = f"input {decoded}"
    preview, whole = summary["preview"], summary["taehv"]

    def row(label: str, stats: dict, psnr: str, ssim: str) -> list:
        return [label, mean_text(stats[psnr], ".4g", ".2g"), mean_text(stats[ssim], ".4g", ".2g")]

    rows = [
        row("whole clip: every compared frame against its input frame", whole, "psnr", "ssim"),
        row(f"preview: the first latent decoded alone against {shown}", preview, "psnr", "ssim"),
    ]
    if "psnr_vs_reference_decode" in preview:
        rows += [
            row(
                f"preview of the reference VAE's latents against {shown}",
                preview,
                "psnr_from_reference_latents",
                "ssim_from_reference_latents",
            ),
            row(
                f"preview of the reference VAE's latents against that VAE's own decode of {decoded} (the final video)",
                preview,
                "psnr_vs_reference_decode",
                "ssim_vs_reference_decode",
            ),
        ]
    return [
        "<h2>Preview score</h2><p><small>what a live preview shows while a video model samples: ComfyUI's "
        "previewer decodes the first latent frame of the denoised estimate alone, with no temporal context, "
        "and shows the frame it gives</small></p>",
        _table(["decode", "PSNR dB", "SSIM"], rows),
    ]


def write_report(output_dir: Path, results: dict) -> Path:
    samples = results["samples"]
    videos = [output_dir / s["files"]["comparison_video"] for s in samples]
    embed = sum(v.stat().st_size for v in videos) <= MAX_EMBED_BYTES
    summary = results["summary"]
    metric_rows = [
        [name, mean_text(stats, ".4g", ".2g")]
        + (
            [mean_text(summary["reference"][name], ".4g", ".2g")]
            if "reference" in summary and name in summary["reference"]
            else []
        )
        for name, stats in summary["taehv"].items()
    ]
    spread = "mean ± standard deviation over the samples" if len(samples) > 1 else "one sample: no spread"
    headers = ["metric", "TAEHV"] + (["reference VAE"] if "reference" in summary else [])
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>TAEHV evaluation</title>",
        f"<style>{STYLE}</style></head><body>",
        "<h1>TAEHV evaluation</h1>",
        f"<p><small>model {html.escape(results['model']['path'])} ({html.escape(results['model']['variant'])}, "
        f"{results['model']['parameters_m']:.2f}M parameters); {len(samples)} sample{'s' * (len(samples) != 1)}; "
        f"{results['settings']['n_frames']} frames at stride {results['settings']['stride']}, "
        f"{describe(results['settings']['height'], results['settings']['width'])}; "
        f"device {html.escape(results['settings']['device'])}, {html.escape(results['settings']['dtype'])}</small></p>",
        f"<h2>Summary</h2><p><small>{spread}</small></p>",
        _table(headers, metric_rows),
        *_preview_section(summary, samples[0]["preview"]["frames"]),
    ]
    if "comparison" in summary:
        parts += [
            "<h2>TAEHV vs reference VAE</h2>",
            _table(["measure", "value"], [[k, v] for k, v in summary["comparison"].items()]),
        ]
    parts += ["<h2>PSNR per frame</h2>", _frame_chart(samples), "<h2>Samples</h2>", f"<p><small>{SETS}</small></p>"]
    sample_headers = [
        "sample",
        "source",
        "set",
        "size",
        "PSNR dB",
        "SSIM",
        "preview PSNR dB",
        "sharpness",
        "MSE",
        "temporal error",
        "encode s",
        "decode s",
    ]
    parts.append(
        _table(
            sample_headers,
            [
                [
                    i,
                    Path(s["source"]).name,
                    s["split"],
                    f"{s['height']}x{s['width']}",
                    s["taehv"]["psnr"],
                    s["taehv"]["ssim"],
                    s["preview"]["psnr"],
                    s["taehv"]["sharpness"],
                    s["taehv"]["mse"],
                    s["taehv"]["temporal_error"],
                    s["taehv"]["encode_s"],
                    s["taehv"]["decode_s"],
                ]
                for i, s in enumerate(samples)
            ],
        )
    )
    if results["skipped"]:
        parts += [
            "<h2>Skipped clips</h2><p><small>not in the means: they cannot give a sample at these settings</small></p>",
            _table(["source", "reason"], [[s["source"], s["reason"]] for s in results["skipped"]]),
        ]
    for i, (sample, video) in enumerate(zip(samples, videos)):
        files = sample["files"]
        parts += [
            f"<div class='sample'><h3>Sample {i}: {html.escape(Path(sample['source']).name)} "
            f"<small>{html.escape(sample['split'])} clip, {sample['height']}x{sample['width']}; "
            f"PSNR {sample['taehv']['psnr']:.2f} dB, SSIM {sample['taehv']['ssim']:.3f}, "
            f"preview PSNR {sample['preview']['psnr']:.2f} dB</small></h3>",
            _stills(output_dir / files["stills_png"], files["stills_frames"], "reference" in sample),
            "<p>",
            _video_tag(video, output_dir / files["poster_png"], output_dir, embed),
            "<br><small>original | TAEHV, all compared frames (looping)</small></p>",
            f"<p class='latents'><img alt='latents' src='{_png(output_dir / files['latents_png'])}'>"
            "<small>latents: 3 principal components per latent frame (one block per latent)</small></p></div>",
        ]
    parts += [f"<script>{SCRIPT}</script></body></html>"]
    path = output_dir / "summary_report.html"
    return atomic_write(path, "".join(parts))
