"""The size each evaluated sample is read at: one size for every clip, or each clip's own
cropped down to the model's multiple, so that a portrait clip stays portrait beside
landscape ones (one clip at a time: no batch needs the clips to share a size)."""

from __future__ import annotations

from dataclasses import dataclass

from taehv_train.common.video.files import BadClipError


def describe(height: int | None, width: int | None) -> str:
    """A size as the messages and the report say it (None: the side of each clip)."""
    if height is None and width is None:
        return "each clip at its own size"
    return f"{height or 'native'}x{width or 'native'}"


@dataclass(frozen=True)
class FrameSize:
    """``height`` and ``width`` as given; None takes that side from each clip."""

    height: int | None
    width: int | None
    multiple: int  # 8 * the model's patch size: what every side is cropped down to
    variant: str  # the model's, for the message about a clip that is too small

    @property
    def native(self) -> bool:
        """Whether a side comes from each clip (samples may differ in size)."""
        return self.height is None or self.width is None

    def __str__(self) -> str:
        return describe(self.height, self.width)

    def of(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) of the sample of a ``width x height`` clip; BadClipError when a
        side taken from the clip is smaller than one multiple."""
        step = self.multiple
        if (self.height is None and height < step) or (self.width is None and width < step):
            raise BadClipError(
                "too small",
                f"{width}x{height} pixels, smaller than the {step}x{step} {self.variant} needs at least "
                f"(multiples of {step}, 8 * its patch size {step // 8}): give --height and --width "
                f"(multiples of {step}) to evaluate it resized",
            )
        return self.height or height // step * step, self.width or width // step * step
