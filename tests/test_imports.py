"""The package's import graph: no cycles, and every module imports on its own in any order.

An import cycle works or breaks depending on which module a user (or a DataLoader worker,
or ``python -m``) imports first; a cycle hidden in a function-level import breaks at run
time. So every import counts here, wherever it stands in the file.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO_ROOT

PACKAGES = ("base", "models", "common", "training", "evaluation")
NAMESPACE = "taehv_train"  # what the package is installed as (pyproject.toml); the graph's names leave it out


def project_modules() -> dict[str, Path]:
    """Dotted name -> file for every module of base/, models/, common/, training/, evaluation/ and inference.py."""
    modules = {"inference": REPO_ROOT / "inference.py"}
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules that ``name`` imports anywhere in its file (module level or inside
    functions); ``from package import module`` counts as importing that module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            target = target.removeprefix(NAMESPACE + ".")
            while target and target not in known:  # a symbol or submodule: its module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    known = set(modules)
    return {name: imported_modules(name, path, known) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def bare_imports(path: Path) -> list[str]:
    """The imports in ``path`` of one of the package's folders by its bare name (``models.x``
    rather than ``taehv_train.models.x``): each would load a second copy of the module, and
    none works once the package is installed and used from another folder."""
    bare = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        bare += [
            f"{path.name}:{node.lineno} {name}" for name in names if name.split(".")[0] in (*PACKAGES, "inference")
        ]
    return bare


def test_the_package_imports_itself_through_its_namespace(tmp_path):
    found = [line for path in project_modules().values() for line in bare_imports(path)]
    assert found == [], "imports without the taehv_train namespace: " + ", ".join(found)
    (tmp_path / "a.py").write_text("from models.taehv import TAEHV\nimport taehv_train.common.config\n")
    assert bare_imports(tmp_path / "a.py") == ["a.py:1 models.taehv"]


def test_the_cycle_finder_sees_function_level_imports(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import x\n")
    graph = {name: imported_modules(name, tmp_path / f"{name}.py", {"a", "b"}) for name in ("a", "b")}
    assert find_cycle(graph) == ["a", "b", "a"]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    """The package's import graph, parsed once for the checks that only read it."""
    return import_graph()


def test_no_import_cycles(graph):
    assert {"inference", "training.taehv_train", "training.loop.step", "models.taehv"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# The layers, bottom first: a module may import its own layer and the ones below, never one
# above (README, "Layout"). The command-line tools are the top; everything else is a room.
LAYERS = (
    ("base",),
    ("models",),
    ("common.metrics",),
    ("common",),
    ("training.configs", "training.data", "training.annotate", "training.ecosystem", "evaluation"),
    ("training.loop", "training.state"),
    (
        "training.preflight",
        "training.taehv_train",
        "training.build_latent_cache",
        "training.export",
        "training.make_annotations",
        "training.which_latents",
        "training.own_data",
        "training.demo_data",
        "training.launch",
        "training.launch_args",
        "training.launch_check",
        "training.launch_script",
        "inference",
    ),
)


def layer_of(module: str) -> int:
    found = [i for i, prefixes in enumerate(LAYERS) for p in prefixes if module == p or module.startswith(p + ".")]
    assert found, f"{module} is in no layer: add it to LAYERS (and to the README's layout table)"
    return found[0]


def test_imports_point_down_the_layers(graph):
    """No arrow from models/ into training/ or evaluation/, none from the data room into the
    loop, none from the rooms into the command-line tools."""
    upward = [
        f"{name} -> {target}"
        for name, imports in graph.items()
        if name != "training"
        for target in imports
        if target not in PACKAGES and layer_of(target) > layer_of(name)
    ]
    assert upward == [], "imports pointing up a layer: " + ", ".join(upward)


def test_the_layer_check_sees_an_upward_import():
    assert layer_of("base.atomic") < layer_of("models.weights") < layer_of("common.reference_vae")
    assert layer_of("common.reference_vae") < layer_of("training.loop.step")


def within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def crossings(graph: dict[str, set[str]], importers: tuple[str, ...], targets: tuple[str, ...]) -> list[str]:
    """Every import from a module of ``importers`` into one of ``targets``, as "a -> b"."""
    return sorted(
        f"{name} -> {target}"
        for name, imports in graph.items()
        if within(name, importers)
        for target in imports
        if within(target, targets)
    )


# Whatever the layers allow, these packages stay apart: training and evaluation are siblings
# on common/ (evaluation judges any weights, trained here or not); common/ serves both and
# depends on neither; models/ (the drop-in TAEHV) stands on base/ alone, and base/ on nothing.
def test_evaluation_and_inference_never_import_training(graph):
    found = crossings(graph, ("evaluation", "inference"), ("training",))
    assert found == [], "evaluation importing training: " + ", ".join(found)


def test_training_never_imports_evaluation(graph):
    found = crossings(graph, ("training",), ("evaluation", "inference"))
    assert found == [], "training importing evaluation: " + ", ".join(found)


def test_common_imports_neither_training_nor_evaluation(graph):
    found = crossings(graph, ("common",), ("training", "evaluation", "inference"))
    assert found == [], "common importing what stands on it: " + ", ".join(found)


def test_models_import_nothing_of_the_rest(graph):
    found = crossings(graph, ("models",), ("common", "training", "evaluation", "inference"))
    assert found == [], "models importing the rest of the package: " + ", ".join(found)


def test_base_imports_nothing_of_the_package(graph):
    found = crossings(graph, ("base",), ("models", "common", "training", "evaluation", "inference"))
    assert found == [], "base importing the rest of the package: " + ", ".join(found)


def test_the_crossing_check_sees_a_crossing():
    graph = {
        "evaluation.evaluator": {"common.clips", "training.data.loading"},
        "training_notes": {"evaluation"},
        "common.clips": set(),
    }
    assert crossings(graph, ("evaluation",), ("training",)) == ["evaluation.evaluator -> training.data.loading"]
    assert crossings(graph, ("training",), ("evaluation",)) == []  # training_notes is not in training


def test_nothing_imports_the_train_script(graph):
    importers = [name for name, imports in graph.items() if "training.taehv_train" in imports]
    assert importers == []


IMPORT_EACH = textwrap.dedent("""
    import importlib, os, random, sys
    import accelerate, cv2, diffusers, torch, torchmetrics  # third-party only: shared by the children
    modules = sys.argv[1:]
    orders = [[m] for m in modules] + [random.Random(seed).sample(modules, len(modules)) for seed in range(3)]
    failed = []
    for order in orders:
        pid = os.fork()
        if pid == 0:  # a child that has imported no project module yet
            try:
                for module in order:
                    importlib.import_module(module)
            except BaseException as err:
                print(f"{order}: {type(err).__name__}: {err}", flush=True)
                os._exit(1)
            os._exit(0)
        if os.waitpid(pid, 0)[1] != 0:
            failed.append(order)
    print(f"{len(orders) - len(failed)} of {len(orders)} import orders worked")
    sys.exit(1 if failed else 0)
""")


@pytest.mark.slow
def test_every_module_imports_alone_and_in_random_orders():
    modules = sorted(f"{NAMESPACE}.{name}" for name in project_modules())
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH, *modules], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert f"{len(modules) + 3} of {len(modules) + 3} import orders worked" in result.stdout


def test_starting_a_run_imports_no_library_it_may_not_need():
    """diffusers (with torch._dynamo), torchmetrics (with transformers) and DeepSpeed are
    imported where they are used, so a command that stops at its config or data check
    answers in the seconds torch takes to import, not in twice that."""
    heavy = ("diffusers", "torchmetrics", "transformers", "deepspeed", "torch._dynamo")
    check = (
        "import sys\n"
        "import taehv_train.training.taehv_train, taehv_train.inference, taehv_train.training.launch_check\n"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip() == "[]"
