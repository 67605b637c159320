"""Measurement code: what the `tandem` command runs, and what several benchmarks share.

The rule for benchmark code: reusable measurement lives here, in `tandem.bench` (the scaling
analysis behind `tandem scale`, the all-reduce benchmark behind `tandem bench allreduce`, the
reference models, the plots, writing results); `benchmarks/` at the repository root holds only
scripts, one question each, that print a table and write JSON, importing what they share from
here. Nothing here is imported by the library; the `tandem` command imports these modules lazily.
"""
