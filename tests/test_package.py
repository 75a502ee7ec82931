"""Packaging promises: a cheap `import prefect_jax`, an engine free of
prefect, the entry points, blocks."""

import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import prefect_jax


def _modules_after(statement):
    code = f"import sys; {statement}; print(' '.join(sorted(m.split('.')[0] for m in sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    return set(out.split())


def test_import_prefect_jax_imports_no_jax():
    loaded = _modules_after("import prefect_jax")
    assert not loaded & {"jax", "orbax", "mlflow", "flax", "prefect"}


def test_the_engine_never_imports_prefect():
    loaded = _modules_after("import prefect_jax.training.trainer, prefect_jax.examples.digits")
    assert "jax" in loaded and "prefect" not in loaded


def test_entry_points():
    collections = {e.name: e.value for e in entry_points(group="prefect.collections")}
    assert collections["prefect_jax"] == "prefect_jax"
    scripts = {e.name: e.value for e in entry_points(group="console_scripts")}
    assert scripts["prefect-jax"] == "prefect_jax.cli:entry"


def test_the_console_script_keeps_exit_codes_and_output_through_its_quick_exit(tmp_path):
    """`entry` ends the process with os._exit after main: codes, stdout and stderr must survive
    it."""
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(sys.executable), "prefect-jax")
    missing = subprocess.run(
        [script, "status", "--job", "nope", "--storage", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2 and "no job 'nope'" in missing.stderr, missing
    usage = subprocess.run(
        [script, "run"], capture_output=True, text=True
    )  # argparse's SystemExit(2)
    assert usage.returncode == 2 and "--program" in usage.stderr, usage
    helped = subprocess.run([script, "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and "status" in helped.stdout, helped


@pytest.mark.usefixtures("prefect_server")
def test_blocks_save_and_load(tmp_path):
    from prefect_jax.blocks import CheckpointStorage, MlflowTracking

    CheckpointStorage(url=str(tmp_path / "ckpts")).save("test-storage", overwrite=True)
    MlflowTracking(tracking_uri="sqlite:///x.db", experiment="e").save(
        "test-mlflow", overwrite=True
    )
    storage = CheckpointStorage.load("test-storage")
    assert storage.job_storage("j").checkpoint_dir == f"{tmp_path}/ckpts/j/checkpoints"
    assert MlflowTracking.load("test-mlflow").experiment == "e"
    with pytest.raises(ValueError, match="not a valid name"):
        storage.job_storage("../x")


def _engine_imports() -> dict[str, set[str]]:
    """{module: the engine modules it imports}, for every module under prefect_jax/training,
    from its import statements, function-local ones included (type-checking ones not)."""
    import ast
    import pathlib

    import prefect_jax.training

    package = "prefect_jax.training"
    folder = pathlib.Path(prefect_jax.training.__file__).parent
    modules = {path.stem: path for path in folder.glob("*.py") if path.stem != "__init__"}

    def runtime_nodes(tree):
        """Every node but those under `if TYPE_CHECKING:` (annotations only: no import at run
        time)."""
        stack = [tree]
        while stack:
            node = stack.pop()
            yield node
            for child in ast.iter_child_nodes(node):
                type_only = (
                    isinstance(child, ast.If) and getattr(child.test, "id", "") == "TYPE_CHECKING"
                )
                if not type_only:
                    stack.append(child)

    graph = {}
    for name, path in modules.items():
        found = set()
        for node in runtime_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
                found |= {n.split(".")[2] for n in names if n.startswith(package + ".")}
            elif isinstance(node, ast.ImportFrom) and node.module == package:
                found |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(package + "."):
                found.add(node.module.split(".")[2])
        graph[name] = (found & set(modules)) - {name}
    return graph


def test_no_engine_module_imports_one_that_imports_it_back():
    """No import circle under prefect_jax/training, direct or through others, lazy or not: a
    module that only shares a name with another imports it from `names`."""
    graph = _engine_imports()
    circles = []
    for start in sorted(graph):  # depth-first from each module, back to itself
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for dep in sorted(graph[node]):
                if dep == start:
                    circles.append(" -> ".join([*path, start]))
                elif dep not in path and dep > start:  # each circle once, from its smallest module
                    stack.append((dep, [*path, dep]))
    assert not circles, "import circles under prefect_jax/training:\n" + "\n".join(circles)


def test_every_name_the_engine_package_exports_is_defined_where_it_says():
    """`prefect_jax.training`'s lazy exports resolve (a split that moved a name must move its
    entry too)."""
    import importlib

    import prefect_jax.training as training

    for name, module in training._EXPORTS.items():
        assert hasattr(importlib.import_module(f"prefect_jax.training.{module}"), name), (
            f"prefect_jax.training.{name} points at {module}, which has no {name}"
        )


def test_every_spec_the_program_docs_name_imports_from_the_engine_package():
    """docs/program.md's specs, exporters and hooks come from ``prefect_jax.training``, as its
    examples import them (TensorFlow's and JAX's names it cites aside)."""
    import prefect_jax.training as training

    text = (PACKAGE_DIR.parent / "docs" / "program.md").read_text()
    named = set(re.findall(r"`([A-Z]\w*(?:Spec|Exporter|Hook|HookView|Stopping))\b", text))
    tensorflow_s = {
        "SessionRunHook",
        "CheckpointInputPipelineHook",
        "StopAtStepHook",
        "NanTensorHook",
    }
    named -= {"PartitionSpec", *tensorflow_s}
    assert {"TrainSpec", "RetrySpec", "TrainHook", "TrainHookView"} <= named
    assert not [n for n in sorted(named) if not hasattr(training, n)]


PACKAGE_DIR = Path(prefect_jax.__file__).parent


def _package_modules() -> list[Path]:
    return sorted(PACKAGE_DIR.rglob("*.py"))


def _design_map_sections() -> dict[str, str]:
    """docs/design.md's map (its code block that starts at ``prefect_jax/``), cut into the
    sections of the package's top-level folders: ``{"training": "<its lines>", ...}``, and the
    lines above the first folder under ``""``."""
    design = (PACKAGE_DIR.parent / "docs" / "design.md").read_text()
    block = design.split("```\nprefect_jax/\n", 1)[1].split("```", 1)[0]
    sections: dict[str, str] = {"": ""}
    folder = ""
    for line in block.splitlines():
        header = re.match(r"  (\w+)/\s", line)  # a top-level folder's line, two spaces in
        if header:
            folder = header.group(1)
        elif re.match(r"(\S|  \S)", line):  # back at the package's own level, or outside it
            folder = ""
        sections[folder] = sections.get(folder, "") + line + "\n"
    return sections


def test_the_design_map_names_every_module_of_the_package_in_its_folder():
    """docs/design.md's map is how a newcomer finds a module's room: a module added or moved
    without its line in its folder's part of the map is found here (by file name, within that
    part: ``tasks/train.py`` and ``flows/roles/train.py`` are two names)."""
    sections = _design_map_sections()
    unnamed = []
    for path in _package_modules():
        parts = path.relative_to(PACKAGE_DIR).parts
        if path.name == "__init__.py" and len(parts) > 1:
            continue  # a folder is named by its own line
        section = sections.get(parts[0] if len(parts) > 1 else "", "")
        if not re.search(rf"(?<![\w/]){re.escape(path.name)}\b", section):
            unnamed.append("/".join(parts))
    assert set(sections) >= {"cli", "flows", "tasks", "training", "examples"}, sorted(sections)
    assert not unnamed, (
        f"modules that docs/design.md's map does not name in their folder: {unnamed}"
    )


def test_no_module_of_the_package_passes_400_lines():
    """The house rule: one concern per module, a few hundred lines at most. A module that grows
    past it is split by concern (see docs/design.md's map), not trimmed of its comments."""
    long = {
        str(p.relative_to(PACKAGE_DIR)): n
        for p in _package_modules()
        if (n := len(p.read_text().splitlines())) > 400
    }
    assert not long, f"modules over 400 lines: {long}"
