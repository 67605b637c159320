"""The engine: the backend protocol and its engines, the watchdog, the agreement, the collectives.

Bottom to top: `backend` (the protocol, `Group`), the engines (`torch_backend`,
`mpi_backend`), `watchdog` (the wrapper every operation passes through, its counters) and
`monitor` (its thread and reports, with `waitgraph` and `fingerprints`), `context` (what
`td.init` handed over), `groups`, `exchange` and `agreement` (agree once, cheaply), `checks`
(the per-call argument check), `collectives` and `tensors`. Nothing here imports
`tandem.runtime`, `diagnostics` or `parallel`.
"""
