"""The `keras-memopt` command line. Light to import: arguments are parsed before TensorFlow loads
(see `keras_memopt/__init__.py`), so `--help` and argument errors return at once."""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from keras_memopt._validation import positive_int_argument

__all__ = ["build_parser", "main"]

# `plan`'s default margins: the planner's (tests/test_cli.py checks they are the same).
_MARGINS_HELP = (
    "share of the budget kept free (default: 0.1 after measuring; with "
    "--no-profile 0.8, since a CNN's true peak was up to 4.7 times its "
    "shapes-only estimate)"
)


def build_parser() -> argparse.ArgumentParser:
    """The `keras-memopt` parser, with its `demo`, `run` and `plan` subcommands."""
    parser = argparse.ArgumentParser(
        prog="keras-memopt",
        description="Train Keras models that do not fit in accelerator memory.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    # The demo parses its own options (and its own --help).
    commands.add_parser(
        "demo",
        add_help=False,
        help="plain Keras runs out of memory under a limit; AccumulatingModel trains",
    )
    run = commands.add_parser(
        "run",
        help="run a training command; restart it with a smaller micro-batch if it crashes",
        description="Run COMMAND (a training script). If the process dies of a signal "
        "(a segmentation fault inside TensorFlow under memory pressure, say), run it again "
        "with every AccumulatingModel's micro-batch at most FACTOR times the size it was "
        "using, and with TensorFlow's oneDNN CPU kernels off (TF_ENABLE_ONEDNN_OPTS=0, "
        "unless set), whose kernels crash when their output cannot be allocated; the "
        "script resumes from its keras_memopt.callbacks.BackupAndRestore backup.",
        usage="keras-memopt run [options] -- COMMAND [ARGS...]",
    )
    run.add_argument("--factor", type=float, default=0.5,
                     help="the new cap is this times the micro-batch in use (default: 0.5)")
    run.add_argument("--min-micro-batch-size", type=positive_int_argument, default=1,
                     help="a crash at this micro-batch size is not restarted, unless oneDNN was on "
                     "(default: 1)")
    run.add_argument("--max-restarts", type=int, default=5,
                     help="restarts at the most (default: 5)")
    run.add_argument("training_command", nargs=argparse.REMAINDER, metavar="COMMAND",
                     help="the training command, after --")
    plan = commands.add_parser(
        "plan",
        help="recommend a micro-batch size for a saved model, a batch size and a budget",
        description="Measure the peak memory of training MODEL in micro-batches near the "
        "size it recommends (each size in a fresh process, a few seconds each) and "
        "recommend the micro-batch size that fits a memory budget. Ctrl-C stops it.",
    )
    plan.add_argument("model", help="a saved model file (.keras), loaded in safe mode")
    plan.add_argument("--batch-size", type=positive_int_argument, required=True,
                      help="the effective batch size")
    plan.add_argument("--budget", required=True, help="memory available, e.g. 8GiB or 512MB")
    plan.add_argument("--optimizer", default=None,
                      help="optimizer to plan for (default: the model's, else adam)")
    plan.add_argument("--margin", type=float, default=None, help=_MARGINS_HELP)
    plan.add_argument(
        "--profile", action=argparse.BooleanOptionalAction, default=True,
        help="measure real train steps (default); --no-profile estimates from shapes "
        "alone, at once, with a wider margin",
    )
    plan.add_argument("--unsafe", action="store_true",
                      help="load with safe_mode=False (runs Lambda code: only for files you trust)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs a `keras-memopt` subcommand on `argv` (default `sys.argv[1:]`); returns 0 on
    success, 1 when the plan does not fit (or the demo did not train), 2 for errors, 130 when
    interrupted; `run`, the command's status, or 127 (not found) and 126 as a shell does."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from keras_memopt import demo

        return demo.main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "run":
        return _run(parser, args)
    return _plan(args)


def _run(parser, args) -> int:
    from keras_memopt import supervise

    command = args.training_command
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        parser.error("run: give the training command after --, e.g. "
                     "keras-memopt run -- python train.py")
    try:
        return supervise.supervise(
            command,
            factor=args.factor,
            min_micro_batch_size=args.min_micro_batch_size,
            max_restarts=args.max_restarts,
        )
    except ValueError as error:
        print(f"keras-memopt run: error: {error}", file=sys.stderr)
        return 2
    except FileNotFoundError:
        # The shell's statuses: 127 for a command not found, 126 for one that cannot be run.
        print(f"keras-memopt run: error: command not found: {command[0]}", file=sys.stderr)
        return 127
    except OSError as error:
        print(f"keras-memopt run: error: cannot run {command[0]}: {error.strerror}",
              file=sys.stderr)
        return 126


def _plan(args) -> int:
    from keras_memopt.memory import parse_bytes

    try:
        budget = parse_bytes(args.budget, "budget")  # before TensorFlow loads
        if args.margin is not None and not 0 <= args.margin < 1:
            raise ValueError(f"`margin` must be in [0, 1). Received: margin={args.margin!r}")
    except ValueError as error:
        print(f"keras-memopt plan: error: {error}", file=sys.stderr)
        return 2
    _prepare_tensorflow()
    try:
        return _run_plan(args, budget)
    except KeyboardInterrupt:
        print("\nkeras-memopt plan: interrupted; the measurement in progress was stopped.",
              file=sys.stderr)
        return 130
    except (ValueError, TypeError, OSError, RuntimeError) as error:
        print(f"keras-memopt plan: error: {error}", file=sys.stderr)
        return 2


def _prepare_tensorflow():
    """Quiet TensorFlow's C++ log, and give its CPU allocator figures, unless set already.
    Measurements run in fresh processes that set up their own allocator; this process needs the
    figures only to measure a model those cannot rebuild."""
    if "tensorflow" in sys.modules:
        return  # too late: TensorFlow reads these when it starts
    from keras_memopt._subprocess import tensorflow_env

    for name, value in tensorflow_env(quiet=False).items():
        os.environ.setdefault(name, value)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _run_plan(args, budget) -> int:
    # keras_memopt.models registers AccumulatingModel and Remat with Keras, for load_model.
    import keras_memopt.models  # noqa: F401
    from keras_memopt._keras import keras
    from keras_memopt.memory import format_bytes
    from keras_memopt.planning import MemoryPlanner
    from keras_memopt.planning.planner import MEASURED_MARGIN, SHAPES_ONLY_MARGIN

    with warnings.catch_warnings():
        # The optimizer's variables are not needed, only its configuration.
        warnings.filterwarnings("ignore", message="Skipping variable loading for optimizer")
        model = keras.models.load_model(args.model, compile=True, safe_mode=not args.unsafe)
    planner = MemoryPlanner(model, optimizer=args.optimizer)
    margin = args.margin
    if margin is None:
        margin = MEASURED_MARGIN if args.profile else SHAPES_ONLY_MARGIN
    print(f"model: {args.model} ({model.count_params():,} parameters), "
          f"optimizer: {type(planner.optimizer).__name__}, batch size: {args.batch_size}, "
          f"budget: {format_bytes(budget)}, margin: {margin:.0%}", flush=True)
    if args.profile:
        print("measuring real train steps near the recommendation "
              "(each in a fresh process; Ctrl-C stops):", flush=True)
    result = planner.plan(
        args.batch_size, budget, margin=margin, profile=args.profile, verbose=int(args.profile)
    )
    print()
    print(result.table())
    return 0 if result.fits else 1


if __name__ == "__main__":
    raise SystemExit(main())
