"""The README's code blocks are what the project runs: its set-up commands are CI's.

Its ```python blocks run in tests/test_docs.py, with those of the user guide (which also checks
that every fence names its language).
"""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
BLOCKS = [(language, code) for language, code in FENCE.findall(README)]

SETUP = [
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && keras-memopt demo",
    'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[dev]" && python -m pytest',
]


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

