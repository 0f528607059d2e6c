"""The first `fit` of a process: its CPU time, plain Keras against AccumulatingModel.

A process's first `fit` traces the step functions; on small models that is
most of its time. Each measurement is a fresh process (`--repeats` of each):
a model built, compiled with Adam and trained for one epoch of 4 batches of
64 samples (micro-batches of 16 for the `AccumulatingModel`), the process's
CPU time (`time.process_time`) around that `fit` alone. Models: `mlp`
(Dense 256-256-10 on 32 features) and `tagger` (Embedding(500, 32,
mask_zero) into a bidirectional LSTM(32) over 24 tokens and a per-token head).

Run: python benchmarks/first_step.py [--checkout COPY], and with
TF_USE_LEGACY_KERAS=1 for tf_keras; COPY a checkout of another commit to
compare (its keras_memopt is imported; these benchmarks are this one's).
"""

import argparse
import statistics

import _common

MODELS = ("mlp", "tagger")
KINDS = ("plain", "accumulating")
BATCH, STEPS = 64, 4


def worker(task):
    import time

    import numpy as np

    from keras_memopt import AccumulatingModel
    from keras_memopt._keras import keras

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    if task["model"] == "mlp":
        inputs, outputs = _common.mlp(32, depth=2, width=256)
        x, y = rng.random((BATCH * STEPS, 32), np.float32), rng.integers(0, 10, BATCH * STEPS)
    else:
        inputs, outputs = _common.tagger(500, 32, 24, units=32, tags=5)
        x = rng.integers(0, 500, (BATCH * STEPS, 24)).astype("int32")
        y = rng.integers(0, 5, (BATCH * STEPS, 24))
    if task["kind"] == "plain":
        model = keras.Model(inputs, outputs)
    else:
        model = AccumulatingModel(inputs, outputs, micro_batch_size=16)
    model.compile(keras.optimizers.Adam(1e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    start = time.process_time()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    return dict(seconds=time.process_time() - start, package=_common.package_file())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per setting")
    parser.add_argument("--checkout", default=_common.REPOSITORY,
                        help="the checkout whose keras_memopt the workers import")
    args = _common.parse_or_work(parser, worker, argv)
    if args is None:
        return
    tasks = [dict(model=m, kind=k) for m in MODELS for k in KINDS for _ in range(args.repeats)]
    answers = _common.run_workers(__file__, tasks, args.jobs, args.checkout)
    print(f"keras_memopt: {answers[0]['package']}")
    print("| model | plain Keras: CPU s (median) | AccumulatingModel: CPU s (median) | ratio |")
    print("|---|---:|---:|---:|")
    for model in MODELS:
        medians = {
            kind: statistics.median(
                a["seconds"] for t, a in zip(tasks, answers, strict=True)
                if t["model"] == model and t["kind"] == kind
            )
            for kind in KINDS
        }
        print(f"| {model} | {medians['plain']:.2f} | {medians['accumulating']:.2f} "
              f"| {medians['accumulating'] / medians['plain']:.2f} |")


if __name__ == "__main__":
    main()
