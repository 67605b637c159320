"""Where a rank is launched: this machine's rank processes, their output and their supervisor.

What is where:

- `failure`: What went wrong in a job, in words: the first failure of an attempt and its summary.
- `joined`: Whether any rank joined the job, so that `tandem run` can say when none did.
- `output`: Rank output: every line a rank prints reaches our stdout/stderr as `[rank] line`.
- `policies`: What a failure does, by job: the policies of the one watch (fixed, elastic in
  rounds, an elastic MPI world that shrinks in place, another node's agent).
- `pool`: One local worker pool: the ranks of one job on this machine, each running the work it
  is sent (`td.spawn`, `tandem.testing`'s shared worlds).
- `processes`: Local rank processes: start them, signal their process groups, stop them within a
  deadline.
- `ranks`: This machine's ranks (a fixed attempt, or an elastic round's workers): what each runs,
  what it gets, and their exits as events.
- `supervisor`: The rank supervisor: one watch over a job's ranks, fed by typed events; the
  job's policy decides what a failure does.
"""
