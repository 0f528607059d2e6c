"""The `keras-memopt` command line."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    """Runs a `keras-memopt` subcommand; returns its exit status.

    Args:
        argv: list of str, the command-line arguments. Defaults to
            `sys.argv[1:]`.
    """
    parser = argparse.ArgumentParser(
        prog="keras-memopt",
        description="Train Keras models that do not fit in accelerator memory.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    # Each subcommand parses its own options (and its own --help).
    commands.add_parser(
        "demo",
        add_help=False,
        help="plain Keras runs out of memory under a limit; AccumulatingModel trains",
    )
    plan = commands.add_parser(
        "plan",
        help="recommend a micro-batch size for a saved model, a batch size and a budget",
        description="Estimate the peak memory of training MODEL in micro-batches and "
        "recommend the micro-batch size that fits a memory budget.",
    )
    plan.add_argument("model", help="a saved model file (.keras), loaded in safe mode")
    plan.add_argument("--batch-size", type=int, required=True, help="the effective batch size")
    plan.add_argument("--budget", required=True, help="memory available, e.g. 8GiB or 512MB")
    plan.add_argument("--optimizer", default=None,
                      help="optimizer to plan for (default: the model's, else adam)")
    plan.add_argument("--margin", type=float, default=0.1,
                      help="share of the budget kept free (default: 0.1)")
    plan.add_argument("--profile", action="store_true",
                      help="measure real train steps near the recommended micro-batch")
    plan.add_argument("--unsafe", action="store_true",
                      help="load with safe_mode=False (runs Lambda code: only for files you trust)")
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from keras_memopt import demo

        return demo.main(rest)
    if args.command == "plan":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return _plan(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


def _plan(args) -> int:
    import sys

    from keras_memopt.memory import format_bytes, parse_bytes

    try:
        budget = parse_bytes(args.budget, "budget")  # before the slow model load
        from keras_memopt._keras import keras
        from keras_memopt.planning import MemoryPlanner

        model = keras.models.load_model(args.model, compile=True, safe_mode=not args.unsafe)
        planner = MemoryPlanner(model, optimizer=args.optimizer)
        result = planner.plan(
            args.batch_size, budget, margin=args.margin, profile=args.profile
        )
    except (ValueError, TypeError, OSError, RuntimeError) as error:
        print(f"keras-memopt plan: error: {error}", file=sys.stderr)
        return 2
    print(f"model: {args.model} ({model.count_params():,} parameters), "
          f"optimizer: {type(planner.optimizer).__name__}, batch size: {args.batch_size}, "
          f"budget: {format_bytes(budget)}")
    print()
    print(result.table())
    return 0 if result.fits else 1


if __name__ == "__main__":
    raise SystemExit(main())
