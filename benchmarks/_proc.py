"""A process's memory as the benchmarks measure it, read from /proc (Linux): anonymous resident memory
(``RssAnon``, what a rank allocates itself, page cache left out) and the machine's available memory."""

from __future__ import annotations


def rss_anon(pid: int | str = "self") -> int:
    """``pid``'s RssAnon in bytes; 0 once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0


def mem_available() -> int:
    """The machine's MemAvailable in bytes."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0
