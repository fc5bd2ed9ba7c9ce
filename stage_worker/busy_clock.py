"""The pipeline bubble of one stage: how long it held live sequences while it computed nothing.

Owns `BusyClock`, fed from the compute thread (busy or not, active or not) and read at each
metrics scrape. Knows nothing of steps, spans or the metrics library.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class BusyClock:
    """How long the stage held live sequences, and how much of that its compute thread sat idle.

    A stage is *active* while its KV cache holds any sequence (requests are in progress through
    it) and *busy* while a step computes. Idle time while active is the pipeline bubble: requests
    wait, and this stage has nothing to run. Updated from the compute thread, read at scrapes.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._at = clock()
        self._busy = False
        self._active = False
        self.active_seconds = 0.0
        self.bubble_seconds = 0.0  # idle while active
        self._seen = (0.0, 0.0)  # (active, bubble) at the last `fraction()`

    def set(self, *, busy: bool, active: bool) -> None:
        with self._lock:
            self._advance()
            self._busy, self._active = busy, active

    def set_active(self, active: bool) -> None:
        with self._lock:
            self._advance()
            self._active = active

    def _advance(self) -> None:
        now = self._clock()
        if self._active:
            self.active_seconds += now - self._at
            if not self._busy:
                self.bubble_seconds += now - self._at
        self._at = now

    def totals(self) -> tuple[float, float]:
        """(active, bubble) seconds since start."""
        with self._lock:
            self._advance()
            return self.active_seconds, self.bubble_seconds

    def fraction(self) -> float:
        """Bubble share of the active time since the previous call (0 when it was never active)."""
        with self._lock:
            self._advance()
            (seen_active, seen_bubble), self._seen = self._seen, (self.active_seconds, self.bubble_seconds)
            active, bubble = self.active_seconds - seen_active, self.bubble_seconds - seen_bubble
        return bubble / active if active > 0 else 0.0
