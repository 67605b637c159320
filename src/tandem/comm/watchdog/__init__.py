"""The watchdog: every operation passes through it, no wait lasts for ever, and a desync or a lost
peer is named, not hung.

What is where:

- `board`: The rendezvous store as the watchdog's notice board.
- `monitor`: The watchdog's monitor: no wait lasts for ever, and a desync is named, not hung.
- `waitgraph`: What the watchdog concludes from the ranks' answers: who arrived, who deadlocked,
  and the report.
- `watched`: The watchdog every operation passes through: the wrapper, its counters and its
  errors.
"""
