"""The test's kill: with `HVD_EXAMPLE_DIE=W:N`, worker W (TANDEM_ELASTIC_WORKER) exits with
code 9 at the N-th call of a countdown (a model's forward, a training image read)."""

import os


class Countdown:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        die = os.environ.get("HVD_EXAMPLE_DIE")
        if die:
            worker, at = map(int, die.split(":"))
            if int(os.environ.get("TANDEM_ELASTIC_WORKER", "-1")) == worker and self.calls == at:
                os._exit(9)
