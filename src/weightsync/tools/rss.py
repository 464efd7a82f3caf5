"""This process's resident memory as the kernel counts it (Linux ``/proc/self``), for benchmarks.

    before = status_bytes("VmRSS")
    reset_peak_rss()                       # VmHWM := VmRSS
    ...
    peak = status_bytes("VmHWM") - before  # what the block added at its peak
"""

from __future__ import annotations


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``, ``RssShmem``...) in bytes; 0 if absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> bool:
    """Reset VmHWM (Linux ``clear_refs`` 5); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
