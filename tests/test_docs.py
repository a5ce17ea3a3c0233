"""The docs name only what exists: the README's layout table has one row per folder and
names files that are there, every repository path and `python -m` module the docs (README,
docs/, tests/README.md, checkpoints/README.md) name exists, and every `--flag` /
`--key=value` they show is a config key or a flag of a tool, and every test they cite is there."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from dataclasses import fields
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from taehv_train.common.config import TrainConfig
from taehv_train.models.downloads import GITHUB_FILES, HUB_FILES, HUB_VAES, fetch_command
from taehv_train.training.launch_args import OPTIONS as LAUNCH_OPTIONS

DOCS = [
    REPO_ROOT / "README.md",
    REPO_ROOT / "checkpoints" / "README.md",
    REPO_ROOT / "tests" / "README.md",
    *sorted((REPO_ROOT / "docs").glob("*.md")),
]
EXTENSIONS = ("py", "md", "sh", "yaml", "yml", "txt", "json", "ini", "png")
# flags of other programs the docs show (pytest, tensorboard, accelerate launch, pip, curl, hf download)
# and the placeholder --key=value
OTHER_FLAGS = {
    "basetemp",
    "dist",
    "logdir",
    "multi_gpu",
    "num_processes",
    "extra_index_url",
    "key",
    "fail",
    "create_dirs",
    "include",
    "local_dir",
}
PACKAGES_RUN = "training|bench|tools|evaluation|models|common"  # what `python -m` may name
OURS = (
    "base",
    "models",
    "common",
    "training",
    "evaluation",
    "bench",
    "tools",
    "docs",
    "tests",
    "scripts",
    "accelerate_configs",
)  # not run outputs


def tracked_files() -> list[str]:
    """The repository's files in the working tree: tracked ones that still exist and new ones
    git does not ignore (a folder added or moved before it is committed counts)."""
    result = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"], capture_output=True, text=True, cwd=REPO_ROOT
    )
    if result.returncode != 0:
        pytest.skip("not a git checkout")
    return [path for path in result.stdout.split() if (REPO_ROOT / path).exists()]


def code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def layout_rows() -> dict[str, str]:
    readme = (REPO_ROOT / "README.md").read_text()
    table = readme[readme.index("## Layout") :]
    return dict(re.findall(r"^\| `([^`]+/)` \| (.*) \|$", table, flags=re.M))


def test_the_layout_table_has_one_row_per_folder_and_names_its_files():
    folders = {path.rpartition("/")[0] + "/" for path in tracked_files() if "/" in path}
    folders = {f for f in folders if not f.startswith((".", "docs/images/", "tests/fixtures/"))}
    rows = layout_rows()
    assert set(rows) == folders, f"README layout rows {sorted(set(rows) ^ folders)} do not match the folders"
    for folder, text in rows.items():
        for name in re.findall(r"`([\w.]+\.(?:py|sh|md))`", text):
            assert (REPO_ROOT / folder / name).exists() or (REPO_ROOT / name).exists(), f"{folder}{name} (layout table)"


def test_every_path_and_module_the_docs_name_exists():
    missing = []
    for doc in DOCS:
        for span in code_spans(doc.read_text()):
            for token in span.split():
                token = token.strip("(),;:'\"")
                if (
                    re.fullmatch(rf"[\w.-]+(/[\w.-]+)+\.({'|'.join(EXTENSIONS)})", token)
                    and token.split("/")[0] in OURS
                    and not (REPO_ROOT / token).exists()
                ):
                    missing.append(f"{doc.name}: {token}")
            modules = re.findall(
                rf"python3? -m (?:taehv_train\.)?((?:{PACKAGES_RUN})(?:\.\w+)+)(?![\w<.])",
                span,
            )
            for module in modules:
                if not (REPO_ROOT / (module.replace(".", "/") + ".py")).exists():
                    missing.append(f"{doc.name}: python -m {module}")
    assert missing == []


def test_every_test_the_docs_name_exists():
    """``tests/test_x.py::test_name`` (a trailing ``*`` for a prefix) names a test function
    that is there, so a table's "tested by" column never points at a renamed test."""
    missing = []
    for doc in DOCS:
        for file, name, prefix in re.findall(r"(test_\w+\.py)::(test_\w+)(\*?)", doc.read_text()):
            source = REPO_ROOT / "tests" / file
            pattern = rf"^def {name}" + ("" if prefix else r"\(")
            if not (source.is_file() and re.search(pattern, source.read_text(), flags=re.M)):
                missing.append(f"{doc.name}: {file}::{name}{prefix}")
    assert missing == []


def tool_flags() -> set[str]:
    """Every long flag some tool defines (snake_case; both spellings are accepted)."""
    flags = set()
    for path in [
        *REPO_ROOT.glob("training/**/*.py"),
        *REPO_ROOT.glob("common/*.py"),
        *REPO_ROOT.glob("bench/*.py"),
        *REPO_ROOT.glob("tools/*.py"),
        REPO_ROOT / "inference.py",
        REPO_ROOT / "tests" / "conftest.py",  # the test suite's own options (pytest's addoption)
    ]:
        flags |= set(re.findall(r"(?:add_argument|addoption)\(\s*\"--([\w-]+)\"", path.read_text()))
    flags |= {option.removeprefix("--") for option in LAUNCH_OPTIONS}  # the launch script's own
    return {flag.replace("-", "_") for flag in flags}


def test_every_flag_the_docs_show_is_a_config_key_or_a_flag():
    known, unknown = {f.name for f in fields(TrainConfig)} | tool_flags() | OTHER_FLAGS, []
    for doc in DOCS:
        for span in code_spans(doc.read_text()):
            for flag in re.findall(r"(?:^|[\s\[(])--([a-z][\w-]*)", span):
                flag = flag.replace("-", "_")
                if flag not in known and flag.removeprefix("no_") not in known:  # --no_x of a boolean --x
                    unknown.append(f"{doc.name}: --{flag}")
    assert unknown == []


def test_checkpoints_readme_gives_the_command_the_errors_give_for_every_published_file():
    """The download table of checkpoints/README.md and the commands missing-weights errors
    print (``models.downloads``) agree, file by file."""
    readme = (REPO_ROOT / "checkpoints" / "README.md").read_text()
    missing = [
        name for name in [*GITHUB_FILES, *HUB_FILES, *HUB_VAES] if fetch_command(f"checkpoints/{name}") not in readme
    ]
    assert missing == []


def python_blocks(doc: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)


# Runs each snippet that stands on its own as written, in a folder of the user's own: the
# imports, then the snippet, then a check of every `name = ...  # (shape)` comment.
RUN_SNIPPETS = textwrap.dedent("""
    import ast, re, sys
    for source in sys.argv[1:]:
        namespace = {}
        exec(compile(source, "<snippet>", "exec"), namespace)
        for name, shape in re.findall(r"^\\s*(\\w+) = .*# (\\([\\d, ]+\\))", source, re.M):
            assert tuple(namespace[name].shape) == ast.literal_eval(shape), (name, namespace[name].shape, shape)
        print("snippet ran")
""")


@pytest.mark.slow  # a Python process that encodes and decodes 17 frames of 480x720
def test_the_docs_python_snippets_run_from_another_folder(tmp_path):
    """The package is installed, not found through the working folder: from a folder that is
    not the repository, no top-level models/common/... is found, every Python block's
    imports work, and the README's (given taecvx-shaped weights in that folder's
    checkpoints/) runs as written, with the shapes its comments give."""
    blocks = [block for doc in DOCS for block in python_blocks(doc)]
    lines = [line for block in blocks for line in block.splitlines()]
    imports = "\n".join(line for line in lines if line.startswith(("from ", "import ")))
    assert "taehv_train" in imports
    # the package's folders are importable under its namespace only, not as top-level names
    bare = ("base", "models", "common", "training", "evaluation", "inference")
    claimed = f"import importlib.util as u; print([n for n in {bare} if u.find_spec(n)])"
    names = subprocess.run([sys.executable, "-c", claimed], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert names.stdout.strip() == "[]", names.stdout + names.stderr
    (tmp_path / "checkpoints").mkdir()
    save = "from taehv_train.models.taehv import TAEHV; from taehv_train.models.weights import save_weights; "
    save += "save_weights(TAEHV(None, variant='taecvx'), 'checkpoints/taecvx.pth')"
    result = subprocess.run(
        [sys.executable, "-c", f"{imports}\n{save}"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (readme,) = python_blocks(REPO_ROOT / "README.md")
    result = subprocess.run(
        [sys.executable, "-c", RUN_SNIPPETS, readme], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n").count("snippet ran") == 1


def test_the_module_map_names_every_module_of_the_package():
    """docs/modules.md is the one map of the code: a module added or moved without its row
    there fails here (and a row naming a module that is gone fails the path check above)."""
    text = (REPO_ROOT / "docs" / "modules.md").read_text()
    modules = [
        path
        for path in tracked_files()
        if path.endswith(".py")
        and (path == "inference.py" or path.split("/")[0] in ("base", "models", "common", "training", "evaluation"))
        and not path.endswith("__init__.py")
        and not path.startswith("training/configs/")
    ]
    assert len(modules) > 100
    missing = [path for path in modules if f"`{path}`" not in text]
    assert missing == [], f"modules missing from docs/modules.md: {missing}"
