"""Every tutorial notebook runs from top to bottom (its cells assert what they show).

The notebooks are stored with their outputs, which the documentation shows as
they are (it does not run them), so they are also checked to be stored run:
every code cell executed, in order, without an error.
"""

import pathlib
import re

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

pytestmark = pytest.mark.line_independent

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
ALLOCATOR_VARIABLES = (
    "TF_ENABLE_ONEDNN_OPTS",
    "TF_CPU_ALLOCATOR_USE_BFC",
    "TF_CPU_BFC_MEM_LIMIT_IN_MB",
)


def _code_cells(path):
    return [cell for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code"]


def test_the_tutorials_are_there():
    names = {path.stem for path in NOTEBOOKS}
    assert {"quickstart", "accumulation", "remat", "planning", "pruning"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_run(path):
    cells = _code_cells(path)
    assert [cell.execution_count for cell in cells] == list(range(1, len(cells) + 1))
    for cell in cells:
        assert not [o for o in cell.outputs if o.output_type == "error"], cell.source[:80]


def test_quickstart_sets_its_memory_limit_before_tensorflow_starts():
    # TensorFlow reads the allocator variables once, when it starts; this
    # session's own limit (conftest.py) must be overridden, not kept.
    first = _code_cells(NOTEBOOKS[0].parent / "quickstart.ipynb")[0].source
    tensorflow = min(first.index(f"import {name}") for name in ("tensorflow", "keras_memopt"))
    for name in ALLOCATOR_VARIABLES:
        match = re.search(rf'os\.environ\["{name}"\] = "[^"]+"', first)
        assert match and match.start() < tensorflow, name


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
    notebook = nbformat.read(path, as_version=4)
    # The kernel inherits this session's environment (allocator settings, and
    # TF_USE_LEGACY_KERAS when the suite runs on tf_keras).
    nbclient.NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": path.parent}}
    ).execute()
