"""`keras-memopt demo`: plain Keras runs out of memory; `AccumulatingModel` trains.

Under a CPU memory limit, the same MLP at the same batch (plain: a real `ResourceExhaustedError`);
both peaks and the loss printed. Each run is a fresh child process (allocator settings read once).

Example:

```
keras-memopt demo
python -m keras_memopt.demo --batch-size 4096 --micro-batch-size 256
```
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import time

from keras_memopt import _subprocess
from keras_memopt._validation import positive_int_argument

__all__ = ["DEFAULTS", "build_parser", "main", "train"]

DEFAULTS = dict(
    batch_size=8192,
    micro_batch_size=512,
    memory_limit_mb=200,
    epochs=2,
    steps_per_epoch=2,
    depth=12,
    width=512,
    features=256,
    classes=10,
)

# Generous enough for every run the demo makes without a limit.
_UNLIMITED_MB = 16384
# Per run; the default demo's runs take well under a minute each on 2 cores.
_RUN_TIMEOUT_S = 1800


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Adds the demo's options to `parser` (a new one if None) and returns it."""
    if parser is None:
        parser = argparse.ArgumentParser(
            prog="keras-memopt demo",
            description=(
                "Train an MLP at a batch that does not fit in a memory-limited "
                "TensorFlow CPU device: plain keras.Model runs out of memory, "
                "AccumulatingModel trains at the same effective batch."
            ),
        )
    for name, help_text in [
        ("batch_size", "effective batch (samples per optimizer update)"),
        ("micro_batch_size", "samples per micro-batch for AccumulatingModel"),
        ("memory_limit_mb", "memory limit of TensorFlow's CPU allocator, in MiB"),
        ("epochs", "training epochs"),
        ("steps_per_epoch", "batches (optimizer updates) per epoch"),
        ("depth", "hidden Dense layers"),
        ("width", "units per hidden layer"),
    ]:
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=positive_int_argument,
            default=DEFAULTS[name],
            help=f"{help_text} (default: {DEFAULTS[name]})",
        )
    parser.add_argument(
        "--jit-compile",
        action="store_true",
        help="compile with XLA (jit_compile=True) in both runs",
    )
    return parser


# -- the child: one training run in a fresh TensorFlow -------------------------------


def train(settings):
    """One training run in this (fresh) process; returns what it did as a dict. `settings`: `run`
    (`"plain"`, `"accumulating"` or `"plain-unlimited"`) and the demo's options by name."""
    import numpy as np
    import tensorflow as tf

    from keras_memopt import AccumulatingModel
    from keras_memopt._keras import keras

    run = settings["run"]
    args = argparse.Namespace(**settings)
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    samples = args.batch_size * args.steps_per_epoch
    x = rng.standard_normal((samples, DEFAULTS["features"])).astype("float32")
    teacher = rng.standard_normal((DEFAULTS["features"], DEFAULTS["classes"]))
    y = np.argmax(x @ teacher, axis=1).astype("int32")

    inputs = keras.Input((DEFAULTS["features"],))
    hidden = inputs
    for _ in range(args.depth):
        hidden = keras.layers.Dense(args.width, activation="relu")(hidden)
    outputs = keras.layers.Dense(DEFAULTS["classes"])(hidden)
    model = keras.Model(inputs, outputs, name="mlp")
    if run == "accumulating":
        model = AccumulatingModel.from_model(model, micro_batch_size=args.micro_batch_size)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=bool(args.jit_compile),
    )
    result = dict(run=run, parameters=int(model.count_params()))
    start = time.perf_counter()
    try:
        history = model.fit(
            x,
            y,
            batch_size=args.batch_size,
            epochs=1 if run == "plain-unlimited" else args.epochs,
            shuffle=False,
            verbose=0,
        )
    except tf.errors.ResourceExhaustedError as error:
        lines = [line.strip() for line in error.message.splitlines() if line.strip()]
        message = next((line for line in lines if "OOM" in line), lines[0] if lines else "")
        result.update(status="oom", error=f"{type(error).__name__}: {message}")
    else:
        result.update(status="trained", loss=[float(v) for v in history.history["loss"]])
    result["seconds"] = time.perf_counter() - start
    result["peak_mib"] = tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2**20
    return result


# -- the parent: starts the children, never imports TensorFlow ---------------------


def _settings(args):
    """The options a run needs, by name (what `train` receives)."""
    names = [name for name in DEFAULTS if name not in ("features", "classes")]
    return {name: getattr(args, name) for name in names + ["jit_compile"]}


def _run_child(run, args, memory_limit_mb):
    try:
        return _subprocess.call(
            "keras_memopt.demo:train",
            dict(_settings(args), run=run),
            # The demo limits the CPU's memory: GPUs stay out of it.
            env={**_subprocess.tensorflow_env(cpu_memory_limit_mb=memory_limit_mb),
                 "CUDA_VISIBLE_DEVICES": "-1"},
            timeout=_RUN_TIMEOUT_S,
            name=f"The {run} run",
        )
    except _subprocess.ChildFailed as error:
        return dict(run=run, status="crashed", error=str(error))


def _describe(result, limit=None):
    bound = "no limit" if limit is None else f"limit {limit} MiB"
    if result["status"] == "oom":
        # TensorFlow's OOM line names the tensor, the device and the allocator.
        error = textwrap.shorten(result["error"], width=400, placeholder=" ...")
        return (
            f"   OUT OF MEMORY after {result['seconds']:.0f} s: {error}\n"
            f"   allocator peak before it failed: {result['peak_mib']:.0f} MiB "
            f"(limit {limit} MiB)"
        )
    if result["status"] == "trained":
        losses = ", ".join(f"{v:.4f}" for v in result["loss"])
        return (
            f"   trained in {result['seconds']:.0f} s, loss per epoch: {losses}\n"
            f"   allocator peak: {result['peak_mib']:.0f} MiB ({bound})"
        )
    return f"   FAILED: {result['error']}"


def _demo(args):
    if args.micro_batch_size > args.batch_size:
        print(
            "keras-memopt demo: --micro-batch-size must not exceed --batch-size. "
            f"Received: micro_batch_size={args.micro_batch_size}, "
            f"batch_size={args.batch_size}",
            file=sys.stderr,
        )
        return 2
    limit = args.memory_limit_mb
    steps = -(-args.batch_size // args.micro_batch_size)
    print(
        f"keras-memopt demo: an MLP ({args.depth} x Dense({args.width})) on synthetic data, "
        f"effective batch {args.batch_size},\nTensorFlow's CPU allocator limited to "
        f"{limit} MiB (TF_CPU_BFC_MEM_LIMIT_IN_MB), "
        f"jit_compile={bool(args.jit_compile)}.\n",
        flush=True,
    )
    print(f"1. plain keras.Model, batch {args.batch_size}, under the {limit} MiB limit", flush=True)
    plain = _run_child("plain", args, limit)
    print(_describe(plain, limit), flush=True)

    print(
        f"\n2. AccumulatingModel.from_model(model, micro_batch_size={args.micro_batch_size}), "
        f"batch {args.batch_size}\n   ({steps} micro-batch{'' if steps == 1 else 'es'}, "
        "one optimizer update per batch), "
        f"under the same {limit} MiB limit",
        flush=True,
    )
    accumulating = _run_child("accumulating", args, limit)
    print(_describe(accumulating, limit), flush=True)

    print("\n3. for reference, plain keras.Model without the limit (one epoch)", flush=True)
    unlimited = _run_child("plain-unlimited", args, _UNLIMITED_MB)
    print(_describe(unlimited), flush=True)

    print("\nSummary (TensorFlow allocator peaks):")
    if unlimited["status"] == "trained":
        print(f"   plain keras.Model needs   {unlimited['peak_mib']:6.0f} MiB")
    print(f"   limit                     {limit:6d} MiB")
    if accumulating["status"] == "trained":
        print(
            f"   AccumulatingModel used    {accumulating['peak_mib']:6.0f} MiB, "
            f"final loss {accumulating['loss'][-1]:.4f}"
        )
    if plain["status"] == "oom" and accumulating["status"] == "trained":
        print(
            f"Plain Keras ran out of memory at batch {args.batch_size}; AccumulatingModel "
            "trained the same model at the same effective batch under the same limit."
        )
    elif plain["status"] == "trained":
        print(
            f"Plain Keras did not run out of memory under {limit} MiB: choose a smaller "
            "--memory-limit-mb or a larger --batch-size to see the difference."
        )
    return 0 if accumulating["status"] == "trained" else 1


def main(argv: list[str] | None = None) -> int:
    """Runs the demo on `argv` (after `demo`); returns 0 when `AccumulatingModel` trained, 1
    when it did not, 2 for bad arguments, 130 when interrupted."""
    args = build_parser().parse_args(argv)
    try:
        return _demo(args)
    except KeyboardInterrupt:
        print("\nkeras-memopt demo: interrupted; the run in progress was stopped.",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
