"""A child process's output read line by line in a thread, so a test waits for a line with a
deadline instead of sleeping."""

from __future__ import annotations

import queue
import threading
import time

JOB_S = 90  # the default deadline: a job on two shared cores


class Lines:
    """A job's output stream, read in a thread, so a test can wait for a line with a deadline."""

    def __init__(self, stream) -> None:
        self.seen: list[str] = []
        self._lines: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self._lines.put(line)
        self._lines.put(None)

    def wait_for(self, text: str | None, timeout: float = JOB_S) -> bool:
        """True once a line holding `text` came (`None`: once the stream ended)."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                return False
            if line is None:
                return text is None
            self.seen.append(line)
            if text is not None and text in line:
                return True
        return False

    def text(self) -> str:
        return "".join(self.seen)
