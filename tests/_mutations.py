"""Mutation testing of CI's fuzz sample: does it catch plausible bugs of the split?

Each mutation is one plausible bug, written as text substitutions in `keras_memopt/`.
For each, the script exports the package and the tests of a commit into a temporary
directory (`git archive`; the files of this checkout are never edited), puts the tests of
the fuzzer from this working tree over them (or those of `--tests-rev`, to measure an older
sample), applies the substitutions there, and runs CI's drawn fuzz sample in that copy:

    python -m pytest -n 0 -p no:cacheprovider -q -x tests/test_fuzz.py -k drawn

A mutation is *killed* when a case fails (the first failing case is shown, and whether it
failed by comparison or by raising) and *survives* when every case passes. A mutation whose
text is not found (the package moved on) is reported as such and not run.

    python tests/_mutations.py                          # every mutation, this line's sample
    TF_USE_LEGACY_KERAS=1 python tests/_mutations.py    # tf_keras's sample
    python tests/_mutations.py --tests-rev 618cbd8      # the sample (and draws) of a commit
    python tests/_mutations.py --only sum_rows --all    # every case, not only the first kill
    python tests/_mutations.py --list                   # the mutations, and whether they apply

Run it under `nice`: each mutation runs the whole sample when it survives (minutes).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The fuzzer's own files, taken from this working tree (or `--tests-rev`).
FUZZ_FILES = ("_fuzz.py", "_fuzz_cases.py", "_fuzz_models.py", "_fuzz_training.py",
              "_fuzz_sample.py", "test_fuzz.py")
STEP = "keras_memopt/_step/"


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    bug: str
    edits: tuple  # (path, old text, new text): every occurrence of the old text replaced


MUTATIONS = (
    Mutation(
        "equal_fractions",
        "every micro-batch weighs 1/(number of micro-batches), the last smaller one too",
        ((STEP + "losses.py",
          "        fraction = _loop.fraction_of(_loop.batch_size_of((x, y, sample_weight)),"
          " batch_size)\n",
          "        size = model._run.setting.size_tensor(batch_size)\n"
          "        fraction = _loop.fraction_of(1, (batch_size + size - 1) // size)\n"),),
    ),
    Mutation(
        "penalty_per_micro_batch",
        "each micro-batch adds a whole regulariser (or mean add_loss) term, not its fraction",
        ((STEP + "losses.py",
          "return term * tf.cast(sum_fraction if kind == SUM else mean_fraction, term.dtype)",
          "return term * tf.cast(sum_fraction, term.dtype)"),),
    ),
    Mutation(
        "sample_weight_without_fraction",
        "a micro-batch's sample weights are passed on without its fraction of the batch",
        ((STEP + "losses.py",
          "    return tf.cast(sample_weight, dtype) * tf.cast(fraction, dtype)\n",
          "    return tf.cast(sample_weight, dtype)\n"),),
    ),
    Mutation(
        "metrics_skip_one_sample",
        "the compiled metrics are not updated with a micro-batch of one sample",
        ((STEP + "steps.py",
          "_keras.update_metrics(self, micro_x, micro_y, y_pred, micro_weight)",
          "tf.cond(_loop.batch_size_of(micro_x) > 1, lambda: [_keras.update_metrics("
          "self, micro_x, micro_y, y_pred, micro_weight), tf.constant(True)][1], "
          "lambda: tf.constant(False))"),),
    ),
    Mutation(
        "clip_per_micro_batch",
        "the optimizer's clipping applied to each micro-batch's gradient (and again after)",
        ((STEP + "steps.py",
          "            gradients = tape.gradient(scaled, variables)\n",
          "            gradients = self.optimizer._clip_gradients("
          "tape.gradient(scaled, variables))\n"),),
    ),
    Mutation(
        "no_sum_rows_in_chained_update",
        "the chained update hands the all-reduced sparse gradient on with repeated rows",
        ((STEP + "update.py",
          "        if isinstance(gradient, tf.IndexedSlices):\n"
          "            gradient = _loop.sum_rows(gradient)\n",
          ""),),
    ),
    Mutation(
        "own_token_count",
        "a masked output's micro-batch loss weighed by its samples' fraction, not its tokens'",
        ((STEP + "losses.py",
          "            counted = _masked_fraction(mask, valid, index)\n",
          "            counted = fraction\n"),),
    ),
    Mutation(
        "float32_penalty_fraction",
        "a regulariser's fraction cast to float32 (in a float64 model)",
        ((STEP + "losses.py",
          "return term * tf.cast(sum_fraction if kind == SUM else mean_fraction, term.dtype)",
          "return term * tf.cast(tf.cast(sum_fraction if kind == SUM else mean_fraction,"
          " tf.float32), term.dtype)"),),
    ),
)


def _git(*args, **kwargs):
    return subprocess.run(["git", "-C", REPO, *args], check=True, capture_output=True, **kwargs)


def export(directory, package_rev, tests_rev):
    """The package and tests of `package_rev` in `directory`, with the fuzzer's files
    of `tests_rev` (None: this working tree's)."""
    paths = ["keras_memopt", "tests", "setup.cfg", "pyproject.toml"]
    archive = _git("archive", package_rev, *paths).stdout
    subprocess.run(["tar", "-x", "-C", directory], input=archive, check=True)
    for name in FUZZ_FILES:
        target = os.path.join(directory, "tests", name)
        if tests_rev is None:
            source = os.path.join(REPO, "tests", name)
            if os.path.exists(source):
                shutil.copyfile(source, target)
        else:
            found = subprocess.run(["git", "-C", REPO, "show", f"{tests_rev}:tests/{name}"],
                                   capture_output=True)
            if found.returncode == 0:
                with open(target, "wb") as file:
                    file.write(found.stdout)


def apply(directory, mutation) -> str | None:
    """Applies `mutation` in `directory`; what was not found, or None."""
    for path, old, new in mutation.edits:
        full = os.path.join(directory, path)
        text = open(full).read() if os.path.exists(full) else ""
        if old not in text:
            return f"text not found in {path}: {old.strip()[:70]!r}"
        with open(full, "w") as file:
            file.write(text.replace(old, new))
    return None


def run_sample(directory, stop_at_first, timeout, keyword):
    """Runs the drawn sample in `directory`: `(status, detail, seconds)`."""
    command = [sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", "-q",
               "tests/test_fuzz.py", "-k", keyword]
    if stop_at_first:
        command.append("-x")
    env = dict(os.environ, PYTHONPATH=directory + os.pathsep + os.environ.get("PYTHONPATH", ""),
               COLUMNS="1000")  # pytest's summary lines whole, not cut at 80 columns
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", f"past {timeout} s", time.perf_counter() - started
    seconds = time.perf_counter() - started
    output = done.stdout + done.stderr
    failed = re.findall(r"^FAILED (\S+)(?: - (.*))?$", output, re.MULTILINE)
    if done.returncode == 0:
        return "survived", _counts(output), seconds
    if failed:
        details = []
        for test, message in failed:
            seed = re.search(r"\[(\w+)\]", test)
            message = (message or "").strip()
            kind = "mismatch" if message.startswith("AssertionError: FAIL") else "raised"
            kind = "raised" if "| raised" in message else kind
            kind = "plain Keras raised" if message.startswith("AssertionError: INVALID") else kind
            worst = re.search(r"\| (.*)$", message)
            details.append(f"seed {seed.group(1) if seed else test} ({kind}: "
                           f"{(worst.group(1) if worst else message)[:110]})")
        return "killed", "; ".join(details), seconds
    return "error", output.strip().splitlines()[-1][:200] if output.strip() else "", seconds


def _counts(output):
    lines = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    return lines[-1].strip("= ") if lines else ""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", metavar="NAME",
                        help="run these mutations only (repeatable)")
    parser.add_argument("--package-rev", default="HEAD",
                        help="the commit whose package is mutated (default: HEAD)")
    parser.add_argument("--tests-rev", help="take the fuzzer's files from this commit "
                        "(default: this working tree's)")
    parser.add_argument("--baseline", action="store_true",
                        help="run the sample without a mutation first (it must pass)")
    parser.add_argument("--all", action="store_true",
                        help="run every case of the sample, not only up to the first kill")
    parser.add_argument("--keyword", default="drawn", help="pytest's -k (default: drawn)")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per mutation")
    parser.add_argument("--list", action="store_true",
                        help="list the mutations and whether their text is found; run nothing")
    args = parser.parse_args(argv)
    package_rev = _git("rev-parse", args.package_rev, text=True).stdout.strip()
    mutations = [m for m in MUTATIONS if not args.only or m.name in args.only]
    line = "tf_keras" if os.environ.get("TF_USE_LEGACY_KERAS", "") in ("1", "true") else "Keras 3"
    tests = args.tests_rev or "this working tree"
    print(f"# {line}; package {package_rev[:10]}; fuzz tests of {tests}", flush=True)
    runs = [None, *mutations] if args.baseline else mutations
    results = []
    for mutation in runs:
        name = "baseline" if mutation is None else mutation.name
        with tempfile.TemporaryDirectory(prefix=f"mut_{name}_") as directory:
            export(directory, package_rev, args.tests_rev)
            missing = None if mutation is None else apply(directory, mutation)
            if args.list:
                print(f"{name:32s} {'NOT FOUND: ' + missing if missing else 'applies'}")
                continue
            if missing:
                status, detail, seconds = "not applied", missing, 0.0
            else:
                status, detail, seconds = run_sample(
                    directory, not args.all, args.timeout, args.keyword)
        results.append((name, status, detail, seconds))
        print(f"{name:32s} {status:11s} {seconds:6.0f}s  {detail}", flush=True)
    if results:
        killed = [r[0] for r in results if r[1] == "killed" and r[0] != "baseline"]
        survived = [r[0] for r in results if r[1] == "survived" and r[0] != "baseline"]
        print(f"# killed {len(killed)}: {', '.join(killed) or '-'}")
        print(f"# survived {len(survived)}: {', '.join(survived) or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
