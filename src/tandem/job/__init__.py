"""Who am I in the job: the `TANDEM_*` settings, read once, and one adapter per launcher.

What is where:

- `environments/`: How a process learns its place in the job: launcher adapters, and `td.init`'s
  arguments.
- `settings`: What this process was told: every `TANDEM_*` setting, parsed and checked here,
  read once.
"""
