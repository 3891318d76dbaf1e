"""One log line per process and cause: ``FirstTime()(key)`` is True the first time that instance sees
``key`` (thread-safe; each plugin keeps its own instance, so keys never collide across plugins)."""

from __future__ import annotations

import threading


class FirstTime:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: set = set()

    def __call__(self, key) -> bool:
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
            return True

    def clear(self) -> None:
        """Forget every key (tests start each case with nothing logged)."""
        with self._lock:
            self._seen.clear()
