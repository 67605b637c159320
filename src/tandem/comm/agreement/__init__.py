"""Where a collective is checked: ranks agree once, cheaply, on what they are about to do, and a
mismatch names every rank's version.

What is where:

- `agree`: One way for ranks to agree: compare once, cheaply; on a mismatch, name every rank's
  version.
- `call_sites`: Two lines of one file from which ranks reached the same collective: a skip,
  branches, or unknown.
- `checks`: The argument check: ranks that call a collective differently get one clear error.
- `exchange`: Raw exchanges under the collectives: every rank's length, every rank's picklable
  object.
- `fingerprints`: Collective fingerprints: which collective this is (its sequence number) and
  where it came from.
"""
