"""The package's layers: no import cycle between its modules, none between its folders.

Read from the source (no import runs), so that a module that imports the wrong
way is caught even where it works at run time (a function-level import).
"""

import ast
import pathlib

import pytest

pytestmark = pytest.mark.line_independent

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "keras_memopt"

# Lowest first: each folder imports from the folders before it, never after.
LAYERS = ["_keras", "_step", "_remat", "_oom"]


def _module_name(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports():
    """`{module: {the package's modules it imports}}`, function-level imports included."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([package.rsplit(".", node.level - 1)[0], base]).strip(".")
                if base.startswith("keras_memopt"):
                    targets.add(base)
                    targets.update(f"{base}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.startswith("keras_memopt"))
        found[module] = targets
    modules = set(found)

    def imported(module, target):  # a module of the package, not the module's own package
        return target in modules and target != module and not module.startswith(target + ".")

    return {m: {t for t in targets if imported(m, t)} for m, targets in found.items()}


def _place(module):
    """The folder (or root module) a module belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


class TestLayers:
    def test_no_module_imports_itself_through_others(self):
        graph = _imports()
        cycles = []

        def visit(module, path):
            for target in sorted(graph[module]):
                if target in path:
                    cycles.append(path[path.index(target):] + [target])
                elif target not in done:
                    visit(target, path + [target])
            done.add(module)

        done = set()
        for module in sorted(graph):
            if module not in done:
                visit(module, [module])
        assert cycles == []

    def test_no_two_folders_import_each_other(self):
        graph = _imports()
        arrows = {(_place(m), _place(t)) for m, targets in graph.items() for t in targets}
        arrows = {(a, b) for a, b in arrows if a and b and a != b}
        assert sorted((a, b) for a, b in arrows if (b, a) in arrows) == []

    def test_each_folder_imports_only_the_layers_below_it(self):
        graph = _imports()
        upward = sorted(
            (module, target)
            for module, targets in graph.items()
            for target in targets
            if _place(module) in LAYERS
            and _place(target) in LAYERS
            and LAYERS.index(_place(target)) > LAYERS.index(_place(module))
        )
        assert upward == []

    def test_the_step_knows_nothing_of_the_supervisor(self):
        graph = _imports()
        step = {m: t for m, t in graph.items() if _place(m) == "_step"}
        assert sorted((m, t) for m, targets in step.items() for t in targets
                      if _place(t) == "supervise") == []

    def test_the_reader_sees_the_imports(self):
        # The checks above hold vacuously on an empty graph: the reader sees real imports.
        graph = _imports()
        assert "keras_memopt._step.scopes" in graph["keras_memopt._oom.errors"]
        assert "keras_memopt._keras" in graph["keras_memopt._step.steps"]
