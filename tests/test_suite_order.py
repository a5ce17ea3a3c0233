"""The order test files start in under pytest-xdist (tests/conftest.py): longest first, a
file the record does not name before them, a file with an ``alone`` test last, each file's
tests in their own order; and the record a run writes."""

from __future__ import annotations

import importlib.metadata
import json
from dataclasses import dataclass, field

import pytest

import conftest


@dataclass
class Item:
    nodeid: str
    markers: set[str] = field(default_factory=set)

    def get_closest_marker(self, name: str):
        return name if name in self.markers else None


def test_files_start_longest_first_unknown_before_and_alone_last(monkeypatch, tmp_path):
    record = tmp_path / "file_durations.json"
    record.write_text(json.dumps({"tests/test_a.py": 1.0, "tests/test_b.py": 30.0, "tests/test_c.py": 90.0}))
    monkeypatch.setattr(conftest, "FILE_DURATIONS", record)
    items = [
        Item("tests/test_a.py::test_1"),
        Item("tests/test_b.py::test_1"),
        Item("tests/test_c.py::test_2"),
        Item("tests/test_c.py::test_1", {"alone"}),
        Item("tests/test_new.py::test_1"),
        Item("tests/test_b.py::test_2"),
    ]
    conftest.pytest_collection_modifyitems(None, items)
    assert [item.nodeid for item in items] == [
        "tests/test_new.py::test_1",  # not in the record: its length is unknown
        "tests/test_b.py::test_1",
        "tests/test_b.py::test_2",
        "tests/test_a.py::test_1",
        "tests/test_c.py::test_2",  # the longest, but it holds an alone test
        "tests/test_c.py::test_1",
    ]


@pytest.mark.parametrize("option", [True, False])
def test_a_run_adds_its_files_seconds_to_the_record_when_asked(monkeypatch, tmp_path, option):
    record = tmp_path / "file_durations.json"
    record.write_text(json.dumps({"tests/test_a.py": 5.0, "tests/test_b.py": 7.0}))
    monkeypatch.setattr(conftest, "FILE_DURATIONS", record)
    monkeypatch.setattr(conftest, "_file_seconds", {})
    for nodeid, seconds in [("tests/test_b.py::test_1", 2.0), ("tests/test_b.py::test_2", 1.5)]:
        conftest.pytest_runtest_logreport(
            pytest.TestReport(nodeid, ("", 0, ""), {}, "passed", None, "call", duration=seconds)
        )

    class Config:
        def getoption(self, name):
            assert name == "record_file_durations"
            return option

    class Session:
        config = Config()

    conftest.pytest_sessionfinish(Session())
    expected = (
        {"tests/test_a.py": 5.0, "tests/test_b.py": 3.5} if option else {"tests/test_a.py": 5.0, "tests/test_b.py": 7.0}
    )
    assert json.loads(record.read_text()) == expected


def test_pytest_xdist_keeps_the_order_the_files_were_given(pytestconfig):
    """pytest-xdist (3.5 on) would start the files with the most tests first, whatever order
    collection gave them; from 3.8 that is an option, which conftest turns off."""
    installed = tuple(int(part) for part in importlib.metadata.version("pytest-xdist").split(".")[:2])
    assert installed >= (3, 8)
    assert pytestconfig.option.loadscopereorder is False
