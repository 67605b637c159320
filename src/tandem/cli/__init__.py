"""The command line: `tandem run | scale | bench | doctor | memory`, a thin front end over launch/,
bench/ and the reports (no torch on `--help`).

What is where:

- `command`: The `tandem` command: a thin argparse front end; each subcommand calls into its own
  module.
- `doctor`: `tandem doctor`: what this machine offers a distributed job, one line each, with the
  fix.
- `memory_report`: `tandem memory`: bytes per rank of a model under each layout, estimated
  without running it.
"""

# `tandem.cli` was one module before issue 39's restructuring; what users imported from it keeps
# working, loaded on first use (nothing is imported with the package).
_MOVED = "tandem.cli.command"
_NAMES = (
    'SUBCOMMANDS',
    'add_bench_parser',
    'add_doctor_parser',
    'add_memory_parser',
    'add_run_parser',
    'add_scale_parser',
    'build_parser',
    'main',
)


def __getattr__(name: str):
    if name in _NAMES:
        import importlib

        return getattr(importlib.import_module(_MOVED), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
