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
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from keras_memopt import demo

        return demo.main(rest)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
