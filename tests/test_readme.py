"""Every code block of the README runs, and its set-up commands are the project's.

The ```python blocks run in order in one namespace, as a reader would paste
them one after another, on tiny synthetic data that a prelude defines (`x_train`, `y_train`).
Blocks in any other fence (```bash, ```text) are not Python and are not run.
On tf_keras (`TF_USE_LEGACY_KERAS=1`) `import keras` reads `import tf_keras as
keras`, which is what a tf_keras user writes.
"""

import pathlib
import re

import numpy as np
import pytest
from conftest import LEGACY

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
BLOCKS = [(language, code) for language, code in FENCE.findall(README)]
PYTHON = [code for language, code in BLOCKS if language == "python"]

SETUP = [
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && keras-memopt demo",
    'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[dev]" && python -m pytest',
]


def _prelude():
    rng = np.random.RandomState(0)
    return {
        "x_train": rng.normal(size=(1024, 784)).astype("float32"),
        "y_train": rng.randint(0, 10, size=1024),
    }


def test_every_block_has_a_language():
    assert BLOCKS, "no code blocks found"
    assert all(language for language, _ in BLOCKS), "a fence without a language"
    assert len(PYTHON) >= 4


def test_the_readme_starts_with_the_two_set_up_commands():
    language, code = BLOCKS[0]
    assert README.index("```") < README.index("\n## ")
    assert language == "bash"
    assert code.splitlines() == SETUP


def test_ci_runs_the_readmes_test_command():
    command = SETUP[1].rsplit("&& ", 1)[1]
    script = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    lines = [line.strip() for line in script.splitlines()]
    # The command as it is, followed by nothing but redirections, `&` or `||`.
    for line in (command, f"TF_USE_LEGACY_KERAS=1 {command}"):
        run = re.compile(rf"^{re.escape(line)}(\s+(\d?>|&|\|\|)|$)")
        assert any(run.match(text) for text in lines), line
    assert 'pip install -q -e ".[dev]"' in script


@pytest.mark.slow
def test_python_blocks_run_in_order(tmp_path, monkeypatch):
    # One test, one namespace: a block uses what the blocks before it defined.
    monkeypatch.chdir(tmp_path)  # blocks write files (memory.csv, memory.png)
    namespace = {"__name__": "readme", **_prelude()}
    for index, code in enumerate(PYTHON, start=1):
        if LEGACY:
            code = re.sub(r"^import keras$", "import tf_keras as keras", code, flags=re.MULTILINE)
        exec(compile(code, f"README.md, python block {index}", "exec"), namespace)
    assert (tmp_path / "memory.csv").exists() and (tmp_path / "memory.png").exists()
