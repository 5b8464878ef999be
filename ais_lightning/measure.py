"""Measuring helpers of the benchmarks under ``tools/``: the peak resident memory of a block of code."""

from __future__ import annotations

import os
import threading


def rss_bytes() -> int:
    """This process's resident set size in bytes (``/proc/self/statm``, Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Context manager sampling RSS in a thread (every 2 ms); ``.peak_delta`` = max RSS - RSS at entry (bytes).

    RSS only grows when the allocator needs new pages, so memory reused from earlier work is not counted.
    """

    def __enter__(self) -> PeakRSS:
        self.base = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        self.peak_delta = self.peak - self.base
