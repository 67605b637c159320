"""Diagnostics: tools that turn a silent distributed failure into an error that says what went wrong.

`replicas.check_replicas` verifies that data-parallel replicas hold identical parameters; the
watchdog, collective fingerprints and the timeline live in their own modules here.
"""
