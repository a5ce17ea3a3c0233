"""One writer per run directory (training/state/run_lock.py); the refusal between real
training processes is in test_fault_tolerance.py."""

from __future__ import annotations

import errno
import logging
import os

import pytest

from taehv_train.base.errors import UserError
from taehv_train.training.state import run_lock


def test_a_held_run_directory_is_refused_with_its_holder_until_released(tmp_path):
    first = run_lock.lock_run_dir(tmp_path)
    with pytest.raises(UserError, match=rf"is being written by another training run \(pid {os.getpid()} on "):
        run_lock.lock_run_dir(tmp_path)
    run_lock.release_run_dir(first)
    assert (tmp_path / run_lock.LOCK_NAME).read_text() == ""
    run_lock.release_run_dir(run_lock.lock_run_dir(tmp_path))


def test_a_file_system_without_locks_is_warned_about(tmp_path, monkeypatch, caplog):
    def no_locks(handle, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_lock.fcntl, "flock", no_locks)
    with caplog.at_level(logging.WARNING):
        run_lock.release_run_dir(run_lock.lock_run_dir(tmp_path))
    assert "has no locks (No locks available): two runs started into it at once are not refused" in caplog.text
