"""Shared test fixtures: where the read-only shared data lives.

Tests read real clips and compatibility fixtures from ``../shared`` (next to the repo),
overridable with ``TAEHV_SHARED_DIR``. A missing directory skips those tests on a
developer machine but fails them in CI (``CI=true``), so CI can never go green by
silently skipping the compatibility and real-video checks.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def shared_dir() -> Path:
    return Path(os.environ.get("TAEHV_SHARED_DIR", REPO_ROOT.parent / "shared")).resolve()


def _require(path: Path, what: str) -> Path:
    if path.exists():
        return path
    message = f"{what} not found at {path} (set TAEHV_SHARED_DIR to the shared/ folder)"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def compat_dir() -> Path:
    return _require(shared_dir() / "compat", "compat fixtures")


@pytest.fixture(scope="session")
def videos_dir() -> Path:
    return _require(shared_dir() / "videos", "shared video clips")
