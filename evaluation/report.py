"""summary_report.html: one self-contained page (tables, a per-sample chart, embedded videos)."""
from __future__ import annotations

import base64
import html
from pathlib import Path

MAX_EMBED_BYTES = 64 * 2**20  # larger sets of videos are linked, not embedded

STYLE = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1200px}
table{border-collapse:collapse;margin:12px 0}td,th{border:1px solid #ccc;padding:4px 10px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}
video{max-width:100%;background:#000}.sample{margin:18px 0;padding-top:8px;border-top:1px solid #ddd}
.bar{fill:#3b7dd8}.ref{fill:#e08a2c}small{color:#666}
"""

# Each video reports its duration into the DOM once its metadata loads (tests read it).
SCRIPT = """
document.querySelectorAll('video').forEach(function(v){
  function mark(){ v.dataset.duration = v.duration; }
  if (v.readyState >= 1) { mark(); } else { v.addEventListener('loadedmetadata', mark); }
  v.addEventListener('error', function(){ v.dataset.error = 'failed'; });
});
"""


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(str(value))


def _table(headers: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _chart(samples: list[dict]) -> str:
    """Inline SVG bar chart of PSNR per sample (TAEHV, and the reference VAE when measured)."""
    values = [(s["taehv"]["psnr"], s.get("reference", {}).get("psnr")) for s in samples]
    top = max([v for pair in values for v in pair if v is not None] + [1.0]) * 1.1
    width, height, bar = max(240, 40 * len(values) + 40), 180, 14
    parts = [f'<svg width="{width}" height="{height + 30}" role="img" aria-label="PSNR per sample">']
    for i, (ours, ref) in enumerate(values):
        x = 30 + i * 40
        h = height * ours / top
        parts.append(f'<rect class="bar" x="{x}" y="{height - h:.1f}" width="{bar}" height="{h:.1f}">'
                     f"<title>sample {i}: {ours:.2f} dB</title></rect>")
        if ref is not None:
            h = height * ref / top
            parts.append(f'<rect class="ref" x="{x + bar}" y="{height - h:.1f}" width="{bar}" height="{h:.1f}">'
                         f"<title>reference {i}: {ref:.2f} dB</title></rect>")
        parts.append(f'<text x="{x}" y="{height + 15}" font-size="11">{i}</text>')
    parts.append(f'<text x="0" y="12" font-size="11">{top:.0f} dB</text></svg>')
    return "".join(parts)


def _video_tag(path: Path, output_dir: Path, embed: bool) -> str:
    src = (f"data:video/mp4;base64,{base64.b64encode(path.read_bytes()).decode()}" if embed
           else html.escape(str(path.relative_to(output_dir))))
    return f'<video controls muted loop playsinline preload="metadata" src="{src}"></video>'


def write_report(output_dir: Path, results: dict) -> Path:
    samples = results["samples"]
    videos = [output_dir / s["files"]["comparison_video"] for s in samples]
    embed = sum(v.stat().st_size for v in videos) <= MAX_EMBED_BYTES
    summary = results["summary"]
    metric_rows = [[name, f"{stats['mean']:.4g} ± {stats['std']:.2g}"] + (
        [f"{summary['reference'][name]['mean']:.4g} ± {summary['reference'][name]['std']:.2g}"]
        if "reference" in summary and name in summary["reference"] else [])
        for name, stats in summary["taehv"].items()]
    headers = ["metric", "TAEHV"] + (["reference VAE"] if "reference" in summary else [])
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>TAEHV evaluation</title>",
        f"<style>{STYLE}</style></head><body>",
        "<h1>TAEHV evaluation</h1>",
        f"<p><small>model {html.escape(results['model']['path'])} ({html.escape(results['model']['variant'])}, "
        f"{results['model']['parameters_m']:.2f}M parameters); {len(samples)} samples; "
        f"{results['settings']['n_frames']} frames at {results['settings']['height']}x{results['settings']['width']}; "
        f"device {html.escape(results['settings']['device'])}, {html.escape(results['settings']['dtype'])}</small></p>",
        "<h2>Summary</h2>", _table(headers, metric_rows),
    ]
    if "comparison" in summary:
        parts += ["<h2>TAEHV vs reference VAE</h2>",
                  _table(["measure", "value"], [[k, v] for k, v in summary["comparison"].items()])]
    parts += ["<h2>PSNR per sample</h2>", _chart(samples), "<h2>Samples</h2>"]
    sample_headers = ["sample", "source", "PSNR dB", "SSIM", "MSE", "temporal error", "encode s", "decode s"]
    parts.append(_table(sample_headers, [[i, Path(s["source"]).name, s["taehv"]["psnr"], s["taehv"]["ssim"],
                                          s["taehv"]["mse"], s["taehv"]["temporal_error"], s["taehv"]["encode_s"],
                                          s["taehv"]["decode_s"]] for i, s in enumerate(samples)]))
    for i, (sample, video) in enumerate(zip(samples, videos)):
        latents = output_dir / sample["files"]["latents_png"]
        parts += [f"<div class='sample'><h3>Sample {i}: {html.escape(Path(sample['source']).name)}</h3>",
                  _video_tag(video, output_dir, embed),
                  f"<p><img alt='latents' src='data:image/png;base64,{base64.b64encode(latents.read_bytes()).decode()}'>"
                  "<br><small>latents: 3 principal components per latent frame</small></p></div>"]
    parts += [f"<script>{SCRIPT}</script></body></html>"]
    path = output_dir / "summary_report.html"
    path.write_text("".join(parts), encoding="utf-8")
    return path
