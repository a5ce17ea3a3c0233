"""The torch devices this machine has, and a ``--device`` checked against them before
anything is built: a name torch does not know, a device this machine lacks (CUDA, MPS), a
bad index or ``meta`` (shapes only, nothing computed) is one line naming what is there."""

from __future__ import annotations

import torch

from taehv_train.base.errors import UserError


def default_device() -> str:
    """``cuda`` where a GPU is available, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def usable_devices() -> list[str]:
    """The device strings that work here: ``cpu``, each GPU, ``mps`` on Apple silicon."""
    found = ["cpu"]
    if torch.cuda.is_available():
        found += ["cuda", *(f"cuda:{index}" for index in range(torch.cuda.device_count()))]
    if torch.backends.mps.is_available():
        found.append("mps")
    return found


def checked_device(text: str, flag: str = "--device") -> torch.device:
    """``text`` as a torch device; UserError unless it is one of ``usable_devices``."""
    usable = usable_devices()
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    # cpu and mps are one device each: index 0 is the device itself
    name = device.type if device is not None and device.type in ("cpu", "mps") and device.index == 0 else str(device)
    if device is None or name not in usable:
        what = "is not a device name" if device is None else "is not usable on this machine"
        raise UserError(f"{flag} {text!r} {what}; this machine has: {', '.join(usable)}")
    return device
