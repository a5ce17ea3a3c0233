"""Quality curves as a PNG: held-out PSNR and SSIM against steps or seconds, one line per
arm, drawn with OpenCV (bench/bench_quality.py, bench/bench_time_to_quality.py).
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

PALETTE = [
    (216, 125, 59),
    (44, 72, 224),
    (60, 160, 60),
    (160, 60, 160),
    (40, 170, 200),
    (120, 120, 120),
    (30, 30, 30),
    (200, 80, 140),
    (0, 140, 255),
]  # BGR


def plot(
    curves: dict[str, list[dict]], path: Path, title: str, x: str, colours: dict[str, tuple[int, int, int]]
) -> None:
    """Two panels (PSNR and SSIM against ``x``: "step" or "seconds"), one line per curve,
    drawn with OpenCV in its colour from ``colours`` (BGR, by curve name)."""
    width, height, margin = 560, 360, 60
    panels = []
    for key, label in (("psnr", "held-out PSNR (dB)"), ("ssim", "held-out SSIM")):
        image = np.full((height, width, 3), 255, np.uint8)
        values = [p[key] for curve in curves.values() for p in curve]
        low, high = min(values), max(values)
        low, high = low - 0.05 * (high - low + 1e-6), high + 0.05 * (high - low + 1e-6)
        last = max(p[x] for curve in curves.values() for p in curve)

        def xy(step: float, value: float) -> tuple[int, int]:
            return (
                int(margin + (width - 1.5 * margin) * step / last),  # noqa: B023
                int(height - margin - (height - 1.6 * margin) * (value - low) / (high - low)),  # noqa: B023
            )

        cv2.line(image, xy(0, low), xy(last, low), (0, 0, 0), 1)
        cv2.line(image, xy(0, low), xy(0, high), (0, 0, 0), 1)
        for i in range(5):
            value = low + (high - low) * i / 4
            cv2.putText(image, f"{value:.3g}", (4, xy(0, value)[1] + 4), cv2.FONT_HERSHEY_SIMPLEX, 0.38, (0, 0, 0), 1)
            step = last * i / 4
            cv2.putText(
                image,
                f"{step:.0f}",
                (xy(step, low)[0] - 8, height - margin + 16),
                cv2.FONT_HERSHEY_SIMPLEX,
                0.38,
                (0, 0, 0),
                1,
            )
        cv2.putText(image, x, (width // 2 - 12, height - 14), cv2.FONT_HERSHEY_SIMPLEX, 0.45, (0, 0, 0), 1)
        cv2.putText(image, label, (margin, 24), cv2.FONT_HERSHEY_SIMPLEX, 0.5, (0, 0, 0), 1)
        for n, (arm, curve) in enumerate(curves.items()):
            points = np.array([xy(p[x], p[key]) for p in curve], np.int32)
            cv2.polylines(image, [points], False, colours[arm], 2, cv2.LINE_AA)
            for point in points:  # a curve of one point (one budget) shows too
                cv2.circle(image, (int(point[0]), int(point[1])), 3, colours[arm], -1, cv2.LINE_AA)
            legend_y = height - margin - 12 - 18 * (len(curves) - 1 - n)  # bottom right: the curves rise to the top
            cv2.putText(image, arm, (width - 120, legend_y), cv2.FONT_HERSHEY_SIMPLEX, 0.45, colours[arm], 1)
        panels.append(image)
    header = np.full((30, 2 * width, 3), 255, np.uint8)
    cv2.putText(header, title, (10, 20), cv2.FONT_HERSHEY_SIMPLEX, 0.45, (0, 0, 0), 1)
    if not cv2.imwrite(str(path), np.concatenate([header, np.concatenate(panels, 1)], 0)):
        raise OSError(f"cannot write {path}")
