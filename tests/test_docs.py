"""Every ```python block of README.md and docs/*.md runs, so that a documented recipe cannot break.

The blocks of a page run in order in one namespace, as a reader pastes them one after another. A
page that sets process-wide state (`kmo.configure_devices` must come before TensorFlow initialises
its devices) or runs on tf_keras has a fresh Python of its own, but for one that may come first
(the README's, which only asks for memory growth); the other pages share one, each in a namespace
and a folder of its own, one after another (a fresh TensorFlow costs about 4 CPU-s, and seven of
them were most of these pages' time). That Python has imported TensorFlow and the package, and
frozen what they made, before the first page: without that, each full garbage collection walked
them again (1.3 CPU-s of a run of these pages). Fragments use names a page takes from
its context (`x_train`, `inputs`, `model`): each page's `Setting` defines them before its first
block, on tiny synthetic data, and, where a page only defines a class (keras.io's GAN), trains it
after the last block, so that the recipe runs and not only its definition. Other fences (```text,
```bash) are not Python; the notebooks run in tests/test_notebooks.py.

A block that cannot run here says why on its first line, `# Not run in the tests: <why>` (GPUs,
worker processes); it is left out and reported as a skipped test. Every other block runs.

Each page runs on the Keras line its examples are written for, whatever line this session is on:
Keras 3 (`import keras`), and tf_keras for the pruning page, which imports tf_keras itself. So the
tests run on one pass only: the tf_keras pass, which CI runs beside the Keras 3 pass and which has
fewer tests (the Keras 3 pass runs the other tests that exercise no Keras code, `line_independent`).
On 2026-11-27, with these pages there, the Keras 3 pass took 1024 s and the tf_keras pass 912 s side
by side, these pages 168 s of the latter's two workers' time. The Keras 3 examples are not also run
as `import tf_keras as keras`: some are Keras 3 code on purpose (keras.io's `compute_loss`
signature, an upstream Keras 3 report), the package itself is tested on both lines by the rest of
the suite, and it would cost as much again in a CI run over its 15 minutes.
"""

import dataclasses
import pathlib
import re
import textwrap

import pytest
from conftest import LEGACY, run_python

pytestmark = pytest.mark.skipif(
    not LEGACY,
    reason="a page picks its Keras line in a process of its own: the tf_keras pass runs it",
)

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```(?P<language>\S*)[^\n]*\n(?P<code>.*?)^(?P=indent)```",
    re.DOTALL | re.MULTILINE,
)
NOT_RUN = "# Not run in the tests:"


@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # as the reader finds it: "docs/memory.md"
    line: int  # of the opening fence
    language: str
    code: str

    @property
    def not_run_because(self):
        first = self.code.partition("\n")[0].strip()
        return first.removeprefix(NOT_RUN).strip() if first.startswith(NOT_RUN) else None


def _fences(path):
    text = path.read_text(encoding="utf-8")
    page = path.relative_to(ROOT).as_posix()
    blocks = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        blocks.append(Block(page, line, match["language"], textwrap.dedent(match["code"])))
    return blocks


FENCES = {path.relative_to(ROOT).as_posix(): _fences(path) for path in PAGES}
PYTHON = {
    page: [block for block in blocks if block.language == "python"]
    for page, blocks in FENCES.items()
}


def _data(samples=256):
    """MNIST-shaped arrays under the names the pages use (NumPy itself is not left behind)."""
    return f"""
import numpy as _np

_rng = _np.random.default_rng(0)
x_train = x = _rng.normal(size=({samples}, 784)).astype("float32")
y_train = y = _rng.integers(0, 10, size={samples})
del _np, _rng
"""


_IMPORTS = """
import keras
import tensorflow as tf

import keras_memopt as kmo
"""
_MODEL = """
inputs = keras.Input((784,))
outputs = keras.layers.Dense(10)(keras.layers.Dense(512, activation="relu")(inputs))
"""
# What a fragment of the guide takes from the pages before it.
_FRAGMENTS = _data() + _IMPORTS + _MODEL
_SPARSE_CE = "keras.losses.SparseCategoricalCrossentropy(from_logits=True)"


@dataclasses.dataclass(frozen=True)
class Setting:
    """What runs before a page's first block and after its last, and on which Keras line."""

    before: str = _FRAGMENTS
    after: str = ""
    legacy: bool = False  # tf_keras (TF_USE_LEGACY_KERAS=1)
    own_process: bool = False  # it sets process-wide state: a fresh Python of its own
    # It sets process-wide state that the other pages may share, but before TensorFlow starts:
    # the first page of the shared Python.
    first: bool = False


SETTINGS = {
    "README.md": Setting(
        # configure_devices(memory_growth=True) first, before TensorFlow starts; the pages after
        # it run with memory growth, which changes nothing they show.
        first=True,
        # MemoryLogger(every_n_batches=2) reads, and so plots, nothing in epochs of one batch.
        before=_data(1024),
        after=f"""
        model = Classifier()
        model.compile(optimizer="adam", loss={_SPARSE_CE})
        model.fit(x_train, y_train, batch_size=256)
        import pathlib
        assert pathlib.Path("memory.csv").exists() and pathlib.Path("memory.png").exists()
        """,
    ),
    "docs/index.md": Setting(before=_data()),
    "docs/accumulation.md": Setting(
        before=_data(),
        after=f"""
        model = Classifier()
        model.compile(optimizer="adam", loss={_SPARSE_CE})
        model.fit(x_train, y_train, batch_size=256)
        """,
    ),
    "docs/custom-train-steps.md": Setting(
        after=f"""
        import warnings

        warnings.filterwarnings("error", message=".*runs the whole batch at once")

        regularised = keras.layers.Dense(1, kernel_regularizer="l2")(inputs)
        model = Regression(inputs, regularised, micro_batch_size=64)
        model.compile(optimizer="sgd")
        model.fit(x, y.astype("float32"), batch_size=256)

        model = Logged(inputs, outputs, micro_batch_size=64)
        model.compile(optimizer="adam", loss={_SPARSE_CE})
        assert "lr" in model.fit(x, y, batch_size=256).history

        latent_dim = 8
        generator = keras.Sequential(
            [keras.Input((latent_dim,)), keras.layers.Dense(784, activation="sigmoid")]
        )
        discriminator = keras.Sequential(
            [keras.Input((784,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
        )
        gan = GAN(generator, discriminator, latent_dim)
        gan.compile(keras.optimizers.Adam(1e-3), keras.optimizers.Adam(1e-3))
        assert sorted(gan.fit(x, batch_size=128, epochs=2).history) == ["d_loss", "g_loss"]
        """,
    ),
    # configure_devices first, before TensorFlow starts
    "docs/devices.md": Setting(before="", own_process=True),
    "docs/distributed.md": Setting(
        before=_data() + _IMPORTS + "dataset = tf.data.Dataset.from_tensor_slices((x, y))\n",
    ),
    "docs/memory.md": Setting(
        before=_FRAGMENTS + f"""
model = keras.Model(inputs, outputs)
model.compile(optimizer="adam", loss={_SPARSE_CE})
""",
    ),
    "docs/pruning.md": Setting(
        before=_data() + """
import tf_keras as _keras

inputs = _keras.Input((784,))
outputs = _keras.layers.Dense(10)(_keras.layers.Dense(512, activation="relu")(inputs))
del _keras
""",
        legacy=True,
    ),
    "docs/remat.md": Setting(
        before=_data() + _IMPORTS + """
# A stand-in for ResNet50 with its names where the page cuts: each of the
# page's remat="auto" traced ResNet50 for 9 s (tests/test_remat.py runs it).
x = inputs = keras.Input((64, 64, 3))
x = keras.layers.Conv2D(8, 3, strides=2, padding="same")(x)
for name in ("conv3_block4_out", "conv4_block6_out", "conv5_block3_out"):
    y = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(x)
    y = keras.layers.Add()([x, keras.layers.Conv2D(8, 3, padding="same")(y)])
    x = keras.layers.Activation("relu", name=name)(y)
outputs = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(x))
resnet = keras.Model(inputs, outputs, name="resnet50")


class TransformerBlock(keras.layers.Layer):
    # The reader's own block. A stand-in: with attention, Net's first step took 23 s, not 10; with
    # a LayerNormalization after the addition, 6.3 CPU-s, not 3.4. Dropout stays: Remat replays it.
    def __init__(self, width, heads, **kwargs):
        super().__init__(**kwargs)
        self.feed_forward = keras.layers.Dense(width, activation="gelu")
        self.dropout = keras.layers.Dropout(0.1)

    def call(self, x, training=None):
        return x + self.dropout(self.feed_forward(x), training=training)
""",
        after=f"""
        import numpy as np

        tokens = np.random.default_rng(0).normal(size=(64, 8, 256)).astype("float32")
        labels = np.random.default_rng(1).integers(0, 10, size=(64, 8))
        model = Net()
        model.compile(optimizer="adam", loss={_SPARSE_CE})
        model.fit(tokens, labels, batch_size=64)
        """,
    ),
    "docs/whole-batch-loss.md": Setting(before=""),  # its first block imports and makes its data
}

# The child: each block compiled as the lines it sits on in its page, so that a traceback names
# the page and the line there, and shows it. Each page in a namespace and a folder of its own;
# a page that fails stops there, the next one runs, and the failures are printed last.
_RUNNER = """
import os
import sys
import time
import traceback


def run_page(page, path, steps, folder):
    os.chdir(folder)  # blocks write files (memory.csv, pruned.keras)
    namespace = {"__name__": "__main__"}
    for where, code, line in steps:
        start = time.perf_counter()
        try:
            exec(compile("\\n" * line + code, path if line else f"<{where}>", "exec"), namespace)
        except BaseException:
            return f"{traceback.format_exc()}\\n{page}: {where} failed (traceback above)."
        print(f"{page}: {where} ran in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return None


def run_pages(pages):
    import gc

    import keras_memopt  # noqa: F401 - TensorFlow and this line's Keras, without using a device

    gc.collect()
    gc.freeze()
    failures = [failure for failure in (run_page(*page) for page in pages) if failure]
    for failure in failures:
        print(failure, file=sys.stderr)
    sys.exit(1 if failures else 0)
"""


def _steps(page):
    setting = SETTINGS.get(page, Setting())
    steps = [("the test's set-up before the page", setting.before, 0)]
    steps += [
        (f"the python block at line {block.line}", block.code, block.line)
        for block in PYTHON[page]
        if block.not_run_because is None
    ]
    steps.append(("the test's code after the page", textwrap.dedent(setting.after), 0))
    return steps


def test_every_fence_names_its_language():
    # A fence without one would hide a Python block from these tests.
    unnamed = [f"{b.page}:{b.line}" for blocks in FENCES.values() for b in blocks if not b.language]
    assert not unnamed, f"fences without a language: {unnamed}"
    assert sum(map(len, PYTHON.values())) >= 20  # the pages are found, and their blocks


def test_a_block_says_it_is_not_run_on_its_first_line():
    misplaced = [
        f"{block.page}:{block.line}"
        for blocks in PYTHON.values()
        for block in blocks
        if NOT_RUN in block.code and block.not_run_because is None
    ]
    assert not misplaced, f"'{NOT_RUN}' below a block's first line (it would run): {misplaced}"
    assert all(block.not_run_because for blocks in PYTHON.values() for block in blocks
               if block.not_run_because is not None), "a block not run without a reason"


def _run_pages(pages, folder, legacy=False):
    """Runs `pages` in order in one fresh Python, each in a subfolder of `folder`."""
    runs = []
    for index, page in enumerate(pages):
        (folder / str(index)).mkdir()
        runs.append((page, str(ROOT / page), _steps(page), str(folder / str(index))))
    run_python(
        f"{_RUNNER}\nrun_pages({runs!r})\n",
        env={"TF_USE_LEGACY_KERAS": "1" if legacy else None},  # None: unset
    )


# A page that sets process-wide state runs in a fresh Python of its own, or first in the shared
# one; the others (Keras 3, nothing process-wide) share it, each in its own namespace: a fresh
# TensorFlow costs about 4 CPU-s.
RUN = [page for page, blocks in PYTHON.items() if blocks]
ALONE = [page for page in RUN
         if SETTINGS.get(page, Setting()).own_process or SETTINGS.get(page, Setting()).legacy]
SHARED = sorted((page for page in RUN if page not in ALONE),
                key=lambda page: not SETTINGS.get(page, Setting()).first)


@pytest.mark.slow
@pytest.mark.parametrize("page", ALONE)
def test_page_runs(page, tmp_path):
    _run_pages([page], tmp_path, legacy=SETTINGS.get(page, Setting()).legacy)


@pytest.mark.slow
def test_pages_run_in_one_process(tmp_path):
    assert len(SHARED) >= 5, SHARED  # the pages are found
    assert [page for page in SHARED if SETTINGS.get(page, Setting()).first] == SHARED[:1]
    _run_pages(SHARED, tmp_path)


@pytest.mark.parametrize(
    "block",
    [block for blocks in PYTHON.values() for block in blocks if block.not_run_because],
    ids=lambda block: f"{block.page}:{block.line}",
)
def test_block_not_run(block):
    pytest.skip(f"{block.page}, the python block at line {block.line}: {block.not_run_because}")
