"""The `tandem` command: a thin argparse front end; each subcommand calls into its own module.

Adding a subcommand is one function and one line::

    def add_doctor_parser(subparsers) -> None:
        parser = subparsers.add_parser("doctor", help="...", description=...)
        parser.add_argument(...)
        parser.set_defaults(handler=_doctor)    # handler(args) -> exit code

    SUBCOMMANDS = (add_run_parser, add_doctor_parser)

Handlers import their module lazily, so `tandem --help` stays quick. The library never
imports this module.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence


def _run(args: argparse.Namespace) -> int:
    from tandem.launch import LaunchError, config_from_args, launch

    try:
        return launch(config_from_args(args))
    except LaunchError as error:
        args.parser.print_usage(sys.stderr)
        print(f"tandem run: error: {error}", file=sys.stderr)
        return 2


def add_run_parser(subparsers: argparse._SubParsersAction) -> None:
    """`tandem run`: start N local processes (see `tandem.launch` for the user guide)."""
    from tandem import launch
    from tandem.launch import add_run_arguments

    parser = subparsers.add_parser(
        "run",
        help="start a job of N processes: tandem run -np 4 train.py",
        description=launch.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add_run_arguments(parser)
    parser.set_defaults(handler=_run, parser=parser)


SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (add_run_parser,)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tandem")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description="Distributed training for PyTorch.", allow_abbrev=False
    )
    parser.add_argument("--version", action="version", version=f"tandem {_version()}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for add_parser in SUBCOMMANDS:
        add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `tandem` command with `argv` (default: `sys.argv[1:]`); return its exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if not hasattr(args, "handler"):
            parser.print_help(sys.stderr)
            return 2
        return args.handler(args)
    except SystemExit as exit_:  # argparse reports usage errors and --help this way
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 1)


if __name__ == "__main__":
    sys.exit(main())
