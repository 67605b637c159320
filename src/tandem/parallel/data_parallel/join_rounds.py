"""The reducer's half of `td.join()`: rounds answered by ranks that ran out of data.

`Reducer` inherits this: inside `td.join()` active ranks report with every round that they
contributed, and a rank out of data answers each of their rounds with zeros (`shadow_round`)
until no rank contributes (see join.py for the protocol). Kept apart so that the reducer's
file holds the ordinary round only; it uses the reducer's own state.
"""

from __future__ import annotations

import itertools


class JoinRounds:
    """Mixed into `Reducer`; the attributes it uses are the reducer's."""

    def enter_join(self) -> None:
        """Active ranks now report, with every round, that they contributed (see join.py)."""
        if self.has_pending():
            raise RuntimeError(f"{self._owner}: td.join() entered with reductions pending; call step() first")
        self._join_mode = True
        self._scale = 1.0  # the divisor (the number of contributing ranks) is known only later

    @property
    def joining(self) -> bool:
        """Inside `td.join()`: ranks out of data answer the reductions with zeros."""
        return self._join_mode

    def exit_join(self) -> None:
        self._join_mode = False
        if self.step_check is not None:
            self.step_check.rebase()
        self._scale = self._mean_scale

    def shadow_round(self) -> bool:
        """On a rank out of data: answer one round of the others' reductions with zeros.

        Every bucket is launched (zeros, "contributed" flag 0) and waited for in order, exactly
        as an active rank does, so any hook sees the same sequence of collectives. Returns
        False, on every rank at once, when no rank contributed: all have joined.
        """
        if self.step_check is not None and not self._join_mode:
            self.step_check.answer()  # the active ranks open each round with it (td.join())
        for bucket in self.buckets:
            bucket.buffer.zero_()
            bucket.contributing = False
            try:
                self._works[bucket.index] = self._hook(bucket)
            finally:
                bucket.contributing = True
        for b in range(len(self.buckets)):
            self._wait(self._works[b], b)
        self._works[:] = itertools.repeat(None, len(self._works))
        return self._contributors.item() != 0

