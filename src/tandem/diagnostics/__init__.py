"""Diagnostics: optional reports that turn a silent distributed failure into a named one.

`replicas.check_replicas` verifies that data-parallel replicas hold identical parameters;
`timeline` writes a Chrome/Perfetto trace and `steps` the per-step report. The watchdog that
every operation passes through, and debug mode's collective fingerprints, are part of the
engine: see `tandem.comm.watchdog.watched` and `tandem.comm.watchdog.monitor`.
"""
