"""Measurements: the scaling analysis (`tandem scale`), the all-reduce benchmark and their plots.

Nothing here is imported by the library; the `tandem` command imports these modules lazily.
"""
