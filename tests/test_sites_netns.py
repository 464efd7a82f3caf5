"""Two reader sites made real: each byte crosses the slow link once per site (counted), and every
reader ends bitwise equal (plan/sites.py, tests/_site_worker.py).

Three network namespaces: ``a`` (the meta server and two writers, Megatron TP2) and two reader
sites ``b`` and ``c`` (four vLLM TP1 readers each), each joined to ``a`` by a veth pair shaped to
10 Gbit/s with ``tc tbf`` on both ends (``netem`` is not built into every kernel: this one has
none, so the links have a rate and no added delay). ``a`` routes between ``b`` and ``c`` (gloo
connects every pair of a group). Each site is one process, its ranks threads. Readers take
their share across (torch/gloo over the veth), then forward it to the other readers of their
site over shared memory and take theirs (the inside plan). The veth's own counters say what
crossed: one copy of the model per site and version, where a flat plan sends four.

Needs root, ``ip`` and ``tc`` (CI runs as root); skipped, with the reason, where a namespace
cannot be created.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
VERSIONS = 2
RATE = "10gbit"


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)


def _cannot() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    probe = f"wsp{secrets.token_hex(3)}"
    made = _ip("netns", "add", probe)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    try:  # the links' rate: tbf must exist in this kernel (tried on the probe's loopback)
        shaped = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
                                 "rate", RATE, "burst", "2mb", "latency", "100ms"],
                                capture_output=True, text=True, timeout=30, check=False)
        if shaped.returncode != 0:
            return f"cannot shape a link with tc tbf: {shaped.stderr.strip()}"
    finally:
        _ip("netns", "del", probe)
    return None


def _run(*cmd: str) -> None:
    done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")


@contextlib.contextmanager
def sites() -> Iterator[dict[str, Any]]:
    """Namespaces a, b, c; veths a<->b, a<->c shaped to RATE; addresses and routes."""
    tag = secrets.token_hex(2)
    ns = {s: f"ws{tag}{s}" for s in "abc"}
    try:
        for name in ns.values():
            _run("ip", "netns", "add", name)
            _run("ip", "-n", name, "link", "set", "lo", "up")
        _run("ip", "-n", ns["a"], "addr", "add", "10.77.0.1/32", "dev", "lo")
        hosts = {"a": "10.77.0.1"}
        for i, site in ((1, "b"), (2, "c")):
            here, there = f"v{tag}a{site}", f"v{tag}{site}a"
            _run("ip", "link", "add", here, "netns", ns["a"], "type", "veth", "peer", "name", there, "netns", ns[site])
            _run("ip", "-n", ns["a"], "addr", "add", f"10.77.{i}.1/24", "dev", here)
            _run("ip", "-n", ns[site], "addr", "add", f"10.77.{i}.2/24", "dev", there)
            for n, dev in ((ns["a"], here), (ns[site], there)):
                _run("ip", "-n", n, "link", "set", dev, "up")
                _run("ip", "netns", "exec", n, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", RATE,
                     "burst", "2mb", "latency", "100ms")
            _run("ip", "-n", ns[site], "route", "add", "default", "via", f"10.77.{i}.1")
            hosts[site] = f"10.77.{i}.2"
        _run("ip", "netns", "exec", ns["a"], "sysctl", "-qw", "net.ipv4.ip_forward=1")
        yield {"ns": ns, "hosts": hosts, "links": {s: f"v{tag}a{s}" for s in "bc"}}
    finally:
        for name in ns.values():
            _ip("netns", "del", name)  # its veth ends go with it


def _tx_bytes(ns: str, dev: str) -> int:
    out = subprocess.run(["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/tx_bytes"],
                         capture_output=True, text=True, timeout=30, check=True)
    return int(out.stdout)


def _start(ns: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""),) if p)}
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, os.path.join(HERE, "_site_worker.py"),
                             *args, "--versions", str(VERSIONS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _records(proc: subprocess.Popen[str], timeout: float) -> list[dict[str, Any]]:
    out, err = proc.communicate(timeout=timeout)
    records = [json.loads(line[5:]) for line in out.splitlines() if line.startswith("SITE ")]
    assert proc.returncode == 0 and records, f"exit {proc.returncode}: {err[-3000:]}"
    return records


def _first_line(proc: subprocess.Popen[str], timeout: float, what: str) -> dict[str, Any]:
    got: dict[str, Any] = {}

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("SITE "):
                got.update(json.loads(line[5:]))
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    if not got:
        proc.kill()
        _, err = proc.communicate(timeout=30)
        raise AssertionError(f"{what} within {timeout} s: {err[-3000:]}")
    return got


@pytest.mark.slow
def test_two_reader_sites_take_one_copy_each_across_and_every_reader_is_bitwise():
    reason = _cannot()
    if reason:
        pytest.skip(reason)
    sys.path.insert(0, HERE)
    from _site_worker import CONFIG, layouts
    from weightsync.layout import ModelSpec

    model_bytes = sum(t.nbytes for t in ModelSpec.from_hf_config(CONFIG).canonical_tensors().values())
    writers, readers, _ = layouts()
    with sites() as net:
        ns, hosts = net["ns"], net["hosts"]
        before = {s: _tx_bytes(ns["a"], dev) for s, dev in net["links"].items()}
        procs = [_start(ns["a"], "--site", "a", "--host", hosts["a"])]
        try:
            meta = _first_line(procs[0], timeout=120, what="site a did not start its meta server")
            procs += [_start(ns[s], "--site", s, "--host", hosts[s], "--meta", meta["meta"], f"--token={meta['token']}")  # a token may start with "-"
                      for s in "bc"]
            outs = {s: _first_line(p, timeout=400, what=f"site {s} did not report its readers")
                    for s, p in zip("bc", procs[1:], strict=True)}
            after = {s: _tx_bytes(ns["a"], dev) for s, dev in net["links"].items()}
            for p in (*procs[1:], procs[0]):  # every site reported: the readers leave, then the writers
                assert p.stdin is not None
                p.stdin.write("\n")
                p.stdin.flush()
                if p is not procs[0]:
                    _, err = p.communicate(timeout=120)
                    assert p.returncode == 0, err[-3000:]
            written = _records(procs[0], timeout=120)[-1]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate(timeout=30)
    assert written["errors"] == [] and outs["b"]["errors"] == [] and outs["c"]["errors"] == [], (written, outs)
    assert sum(w["sent_bytes"] for w in written["writers"]) == VERSIONS * 2 * model_bytes  # one copy per site
    for site, out in outs.items():
        assert [r["exact"] for r in out["readers"]] == [[True] * VERSIONS] * 4, out
        # the readers' own count: what crossed into the site is one copy of the model per version
        assert sum(r["across_bytes"] for r in out["readers"]) == VERSIONS * model_bytes == \
            VERSIONS * out["planned_across_bytes"]
        for r in out["readers"]:  # the rest of each replica came from the site's other readers
            assert r["across_bytes"] + r["inside_bytes"] == VERSIONS * model_bytes
        # the link's count: a flat plan would carry four copies (one per reader) per version
        crossed = after[site] - before[site]
        print(f"site {site}: {crossed} bytes crossed its link for {VERSIONS} versions of {model_bytes} bytes "
              f"({crossed / (VERSIONS * model_bytes):.3f} copies per version; a flat plan: 4)")
        assert VERSIONS * model_bytes <= crossed < 1.2 * VERSIONS * model_bytes, (site, crossed, model_bytes)
    assert len(writers) == 2 and len(readers) == 8
