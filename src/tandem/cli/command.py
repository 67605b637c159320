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
import signal
import sys
from collections.abc import Callable, Sequence


def _run(args: argparse.Namespace) -> int:
    from tandem.launch import LaunchError, StartError, config_from_args, launch

    try:
        return launch(config_from_args(args))
    except StartError as error:  # the command line was fine; the system refused the program
        print(f"tandem run: error: {error}", file=sys.stderr)
        return error.code
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


def _scale(args: argparse.Namespace) -> int:
    from tandem.bench import scaling
    from tandem.launch import LaunchError

    try:
        config = scaling.ScaleConfig(
            nps=scaling.parse_sizes(args.np) if args.np else scaling.default_sizes(),
            program=args.program, args=tuple(args.args),
            module=args.module, mode=args.mode, steps=args.steps, warmup=args.warmup,
            out=args.out, backend=args.backend, threads_per_rank=args.threads_per_rank,
            timeout=args.timeout,
        )
        scaling.run(config)
    except (ValueError, LaunchError, scaling.ScaleError) as error:
        print(f"tandem scale: error: {error}", file=sys.stderr)
        return 2 if isinstance(error, ValueError) else 1
    return 0


def add_scale_parser(subparsers: argparse._SubParsersAction) -> None:
    """`tandem scale`: run a script at several world sizes; table, JSON and PNG."""
    from tandem.bench import scaling

    parser = subparsers.add_parser(
        "scale",
        help="scaling analysis: tandem scale --np 1,2,4 train.py",
        description=scaling.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("-np", "--np", default=None, metavar="N,N,...",
                        help="world sizes to measure (default: 1, 2, 4, ... up to the cores)")
    parser.add_argument("--mode", choices=scaling.MODES, default="strong",
                        help="strong: fixed global batch (default); weak: fixed per-rank batch")
    parser.add_argument("--steps", type=int, default=20, help="measured steps per size (20)")
    parser.add_argument("--warmup", type=int, default=3, help="steps not measured first (3)")
    parser.add_argument("--out", default="results/scale",
                        help="directory for scaling.json, scaling.png and the raw records")
    parser.add_argument("--backend", default=None, help="communication backend of the jobs")
    parser.add_argument("--threads-per-rank", type=int, default=None, metavar="T",
                        help="threads per rank at every size (default: cores // largest N)")
    parser.add_argument("--timeout", type=float, default=None, metavar="S",
                        help="seconds a collective may wait before failing")
    parser.add_argument("-m", "--module", action="store_true",
                        help="run the program as a module, like `python -m module`")
    parser.add_argument("program", metavar="script.py|module", help="what each rank runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    parser.set_defaults(handler=_scale)


def _bench_allreduce(args: argparse.Namespace) -> int:
    from tandem.bench import allreduce, plots
    from tandem.bench.results import write_json

    if args.sizes:
        sizes = args.sizes
    elif args.min_size > args.max_size:
        print(f"tandem bench allreduce: error: --min-size {args.min_size} is larger than "
              f"--max-size {args.max_size} (bytes): swap them", file=sys.stderr)
        return 2
    else:
        sizes = [s for s in allreduce.DEFAULT_SIZES if args.min_size <= s <= args.max_size]
    backends = [name.strip().lower() for name in args.backends.split(",") if name.strip()]
    try:
        results = allreduce.run(np=args.np, sizes=sizes or [args.min_size], budget_s=args.budget,
                                backends=backends, device=args.device)
    except (ValueError, RuntimeError) as error:
        print(f"tandem bench allreduce: error: {error}", file=sys.stderr)
        return 2 if isinstance(error, ValueError) else 1
    print(allreduce.format_report(results))
    out = write_json(results, args.out)
    png = plots.plot_bandwidth(results, str(out.with_suffix(".png")), allreduce.LABELS)
    print(f"\nwrote {out} and {png}")
    return 0


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    """`tandem bench allreduce`: bus bandwidth per message size and backend; JSON and PNG."""
    parser = subparsers.add_parser(
        "bench", help="micro-benchmarks: tandem bench allreduce -np 2",
        description="Micro-benchmarks of this machine's communication.", allow_abbrev=False,
    )
    benches = parser.add_subparsers(title="benchmarks", metavar="BENCH")
    from tandem.bench import allreduce

    bench = benches.add_parser(
        "allreduce", help="all-reduce time and bus bandwidth per message size, per backend",
        description=allreduce.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    allreduce.add_arguments(bench)
    bench.add_argument("--backend", dest="backends", help="the same as --backends")
    bench.add_argument("--sizes", default=None, metavar="4K,1M,...",
                       type=lambda text: sorted({allreduce.parse_size(t) for t in text.split(",") if t}),
                       help="message sizes to measure (default: --min-size to --max-size, x4)")
    bench.set_defaults(handler=_bench_allreduce, out="results/allreduce.json")
    parser.set_defaults(handler=lambda args: parser.print_help(sys.stderr) or 2)


def _doctor(args: argparse.Namespace) -> int:
    from tandem.cli import doctor

    hosts = tuple(name.strip() for name in (args.hosts or "").split(",") if name.strip())
    return doctor.main(clean_first=args.clean, hosts=hosts)


def add_doctor_parser(subparsers: argparse._SubParsersAction) -> None:
    """`tandem doctor`: backends, MPI, GPUs, cores, network, ports and versions."""
    parser = subparsers.add_parser(
        "doctor",
        help="what this machine offers: backends, MPI, GPUs, cores, network, versions",
        description="Print one line per check (with the fix when something is missing); "
        "always exits 0.",
    )
    parser.add_argument("--clean", action="store_true",
                        help="first remove the shared-memory segments in /dev/shm that killed "
                        "MPI jobs left behind (only those no running process uses)")
    parser.add_argument("--hosts", metavar="H1,H2,...",
                        help="also say how this machine reaches each host: its address, and "
                        "the interface and local address the route leaves from")
    parser.set_defaults(handler=_doctor)


def _memory(args: argparse.Namespace) -> int:
    from tandem.cli import memory_report

    try:
        print(memory_report.report(args.model, args.np, args.layout, args.optimizer, args.units,
                                   args.param_dtype, args.reduce_dtype, args.offload, args.balance))
    except ValueError as error:  # ModelSpecError too
        print(f"tandem memory: error: {error}", file=sys.stderr)
        return 2
    return 0


def add_memory_parser(subparsers: argparse._SubParsersAction) -> None:
    """`tandem memory`: bytes per rank of a model under each layout, from its shapes."""
    from tandem.cli import memory_report

    parser = subparsers.add_parser(
        "memory",
        help="bytes per rank of a model under each layout: tandem memory train.py:Net -np 8",
        description=memory_report.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("model", metavar="MODEL",
                        help="module:attribute or path/to/file.py:attribute (a class, or a "
                        "function taking no arguments, that builds the model)")
    parser.add_argument("-np", "--np", type=int, required=True, metavar="N",
                        help="ranks the model is split over")
    parser.add_argument("--layout", default=None,
                        help="one of ddp, zero, fully_shard, pipeline, tp (default: a table "
                        "of every layout the model allows)")
    parser.add_argument("--optimizer", default="adam",
                        help="adam (default), adamw, sgd or sgd-momentum")
    parser.add_argument("--units", default=None, metavar="NAME",
                        help="fully_shard: each child of the submodule NAME is one unit "
                        "(e.g. blocks; '.' for the model's own children)")
    parser.add_argument("--param-dtype", choices=memory_report.DTYPES, default=None,
                        help="fully_shard: the dtype units are gathered in")
    parser.add_argument("--reduce-dtype", choices=memory_report.DTYPES, default=None,
                        help="fully_shard: the dtype gradients are reduce-scattered in")
    parser.add_argument("--offload", choices=("cpu",), default=None,
                        help="fully_shard: shards and optimizer state kept on the host")
    parser.add_argument("--balance", default=None, metavar="params|N,N,...",
                        help="pipeline: 'params' or layer counts per stage (default: even)")
    parser.set_defaults(handler=_memory)


SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    add_run_parser,
    add_scale_parser,
    add_bench_parser,
    add_doctor_parser,
    add_memory_parser,
)


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
        args, extra = parser.parse_known_args(argv)
        if extra:  # in the usage of the command they were given to (`tandem run`'s)
            getattr(args, "parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
        if not hasattr(args, "handler"):
            parser.print_help(sys.stderr)
            return 2
        return args.handler(args)
    except SystemExit as exit_:  # argparse reports usage errors and --help this way
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except KeyboardInterrupt:  # Ctrl-C before a command set its own handler: one line
        print("tandem: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
