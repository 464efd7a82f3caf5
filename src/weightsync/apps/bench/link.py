"""A network-rate link on one machine: loopback shaped with ``tc`` for the length of a bench case.

Over loopback, gloo's "network" is the kernel copying memory: about 4 GB/s on the 2-core bench
machine, bound by the memory bus that a delta's comparisons use too. The clusters delta sync is
for move weights between nodes over real links (10-25 Gbit/s Ethernet for TCP gloo; RDMA NICs
at 100-400 Gbit/s feed GPUs whose memory compares at TB/s). To measure delta and full syncs in
the regime where the wire, not the memory bus, is the bottleneck, ``weightsync bench --delta
--link-gbit 10`` puts a token-bucket filter (``tc qdisc ... tbf``) on ``lo`` for the case and
removes it afterwards. It needs root (CAP_NET_ADMIN) and ``tc``; it refuses to replace a root
qdisc someone else set, and it never leaves its own behind.

On a shared machine, run the bench in a network namespace of its own, so that the shaping
slows its loopback only and not every other process's (the bench's ranks and meta server all
live in it; ``/dev/shm`` is not part of a network namespace)::

    unshare -n sh -c 'ip link set lo up && weightsync bench --delta --link-gbit lo,10'

The commands are built by pure functions (tested without root); only :func:`shaped_loopback`
runs them.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator

DEVICE = "lo"
#: loopback's MTU is 64 KiB; a bucket must hold a few packets or tbf drops everything
_MIN_BURST_BYTES = 4 * 65536


class LinkShapingError(RuntimeError):
    """Loopback cannot be shaped here (no ``tc``, no permission, or a qdisc already in place)."""


def tbf_arguments(gbit: float, device: str = DEVICE) -> list[str]:
    """``tc`` arguments that cap ``device`` at ``gbit`` Gbit/s: a bucket of 1 ms of traffic (at
    least four 64 KiB packets) and 100 ms of queue, so that senders are paced, not dropped."""
    if not gbit > 0:
        raise ValueError(f"link rate must be positive, got {gbit} Gbit/s")
    burst = max(_MIN_BURST_BYTES, int(gbit * 1e9 / 8 / 1000))
    return ["qdisc", "add", "dev", device, "root", "tbf", "rate", f"{gbit:g}gbit", "burst", str(burst),
            "latency", "100ms"]


def root_qdisc_is_default(show_output: str) -> bool:
    """Whether ``tc qdisc show dev lo`` lists only the kernel's default for loopback (``noqueue``)
    or nothing: anything else is someone's shaping, which the bench must not replace."""
    roots = [line.split() for line in show_output.splitlines()]
    return all(words[1] == "noqueue" for words in roots if len(words) > 2 and words[0] == "qdisc" and "root" in words)


def _tc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["tc", *args], capture_output=True, text=True, timeout=30, check=False)


@contextlib.contextmanager
def shaped_loopback(gbit: float | None) -> Iterator[str]:
    """Cap loopback at ``gbit`` Gbit/s for the block (``None``: leave it alone); yields a label
    for reports ("loopback" or "loopback shaped to 10 Gbit/s")."""
    if gbit is None:
        yield "loopback"
        return
    arguments = tbf_arguments(gbit)
    if shutil.which("tc") is None:
        raise LinkShapingError("--link-gbit needs the `tc` command (iproute2), which is not installed")
    shown = _tc("qdisc", "show", "dev", DEVICE)
    if shown.returncode != 0:
        raise LinkShapingError(f"`tc qdisc show dev {DEVICE}` failed: {shown.stderr.strip()}")
    if not root_qdisc_is_default(shown.stdout):
        raise LinkShapingError(f"{DEVICE} already has a root qdisc ({shown.stdout.strip()}); "
                               f"remove it first (`tc qdisc del dev {DEVICE} root`) or run without --link-gbit")
    added = _tc(*arguments)
    if added.returncode != 0:
        raise LinkShapingError(f"`tc {' '.join(arguments)}` failed ({added.stderr.strip()}); "
                               "shaping loopback needs root or CAP_NET_ADMIN")
    try:
        yield f"loopback shaped to {gbit:g} Gbit/s"
    finally:
        _tc("qdisc", "del", "dev", DEVICE, "root")


__all__ = ["LinkShapingError", "root_qdisc_is_default", "shaped_loopback", "tbf_arguments"]
