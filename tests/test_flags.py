"""Every tool's flags: documented in snake_case, accepted in kebab-case too."""

from __future__ import annotations

import argparse
import importlib

import pytest

from taehv_train.base.flags import ArgumentParser


def parser() -> ArgumentParser:
    p = ArgumentParser(allow_abbrev=False)
    p.add_argument("--num_clips", type=int, default=1)
    p.add_argument("--channels_last", action=argparse.BooleanOptionalAction, default=True)
    group = p.add_argument_group("data")
    group.add_argument("--data_root", default=None)
    return p


def test_both_spellings_of_every_flag():
    for args in (["--num_clips", "3", "--data_root=x"], ["--num-clips=3", "--data-root", "x"]):
        assert vars(parser().parse_args(args)) == {"num_clips": 3, "channels_last": True, "data_root": "x"}


def test_the_negative_of_a_boolean_flag_in_each_spelling():
    for flag in ("--no_channels_last", "--no-channels-last", "--no-channels_last"):
        assert parser().parse_args([flag]).channels_last is False
    assert "--no_channels_last" in parser().format_help()


def test_unknown_arguments_and_values_pass_through_as_given():
    args, rest = parser().parse_known_args(["--learning-rate=3e-4", "--num-clips", "2", "--", "--data-root"])
    assert args.num_clips == 2 and args.data_root is None and rest == ["--learning-rate=3e-4", "--", "--data-root"]


def test_a_mistyped_flag_names_the_closest_one(capsys):
    for args, closest in ((["--num_clps", "3"], "--num_clips"), (["--data-rot=x"], "--data_root")):
        with pytest.raises(SystemExit) as stop:
            parser().parse_args(args)
        assert stop.value.code == 2 and capsys.readouterr().err.endswith(f"did you mean {closest}?\n")
    _, rest = parser().parse_known_args(["--data-rot=x"])  # passed on as given for the trainer's overrides
    assert rest == ["--data-rot=x"]


@pytest.mark.parametrize(
    "tool, args, closest",
    [
        ("taehv_train.training.make_annotations", ["videos", "-o", "a.json", "--val_fracton", "0.2"], "--val_fraction"),
        ("inference", ["--model_path", "w.pth", "--vidoes", "clip.mp4"], "--videos"),
        ("taehv_train.training.export", ["w.pth", "--out", "bundle", "--forse"], "--force"),
    ],
)
def test_every_tool_says_which_flag_was_meant(tool, args, closest, capsys):
    with pytest.raises(SystemExit) as stop:
        importlib.import_module(tool).main(args)
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2 and error.endswith(f"did you mean {closest}?"), error
