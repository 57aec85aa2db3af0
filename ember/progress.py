"""Progress of a long copy or download: a bar on a terminal, a line every few seconds in a log."""
from __future__ import annotations

import sys
import time
from typing import TextIO


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def _clock(seconds: float) -> str:
    s = int(seconds + 0.5)
    return f"{s // 60}:{s % 60:02d}"


class Progress:
    """Counts bytes of `total`; `update(n)` after each chunk, `done()` at the end. On a terminal it
    redraws one line at most ten times a second; elsewhere it writes a line every `every_s`."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None, every_s: float = 5.0):
        self.label, self.total, self.stream = label, max(total, 1), stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = 0.1 if self.tty else every_s
        self.done_bytes = 0
        self.start = self.shown = time.monotonic()

    def update(self, n: int) -> None:
        self.done_bytes += n
        now = time.monotonic()
        if now - self.shown >= self.interval:
            self.shown = now
            self._write(self._status(now), final=False)

    def done(self) -> None:
        elapsed = max(time.monotonic() - self.start, 1e-6)
        self._write(f"{self.label}: {_mb(self.done_bytes)} in {elapsed:.1f} s "
                    f"({self.done_bytes / elapsed / 1e6:,.0f} MB/s)", final=True)

    def _status(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-6)
        speed = self.done_bytes / elapsed
        left = (self.total - self.done_bytes) / speed if speed > 0 else 0.0
        share = min(self.done_bytes / self.total, 1.0)
        bar = "#" * int(share * 24)
        return (f"{self.label}: [{bar:<24}] {share * 100:5.1f}% {_mb(self.done_bytes)} of {_mb(self.total)}, "
                f"{speed / 1e6:,.0f} MB/s, {_clock(left)} left")

    def _write(self, line: str, final: bool) -> None:
        if self.tty:
            self.stream.write("\r\033[K" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
