"""Turning bench rows into the summary JSON, a rich table and a matplotlib figure.

The summary's ``ratios`` are always two times measured in the same run, side by side:

* ``shm_over_memcpy``: weightsync over shared memory / one memcpy of the bytes a reader
  receives (issue #4's case when it ran, else the main case);
* ``safetensors_over_weightsync``, ``safetensors_shm_over_weightsync``,
  ``per_param_broadcast_over_weightsync``, ``bucketed_broadcast_over_weightsync``: a
  baseline's time / weightsync's time on the main case (TP2 -> TP1 x 2), weightsync with the
  transport ``auto`` picks for co-located ranks (shared memory);
* ``*_over_weightsync_torch``: the same against weightsync over gloo (the baselines' medium);
* ``awex_over_weightsync_torch``: the awex peer / weightsync over gloo on the same shapes;
* ``integrity_cost_<method>``: a weightsync method with in-band digests (``+integrity``) / the
  same method without, minus one, on the same case (issue 4's case first, then the main case).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_BASELINE_KEYS = {"safetensors-disk": "safetensors", "safetensors-shm": "safetensors_shm",
                  "per-param-broadcast": "per_param_broadcast", "bucketed-broadcast": "bucketed_broadcast"}


def _seconds(rows: Sequence[dict[str, Any]], case: str, method: str) -> float | None:
    for r in rows:
        if r["case"] == case and r["method"] == method and r.get("seconds"):
            return float(r["seconds"])
    return None


def summary_ratios(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The headline ratios (see module docstring); keys whose rows did not run are absent."""
    out: dict[str, float] = {}
    cases = list(dict.fromkeys(r["case"] for r in rows))
    main = next((c for c in cases if any(r["case"] == c and r["method"] == "per-param-broadcast" for r in rows)
                 and any(r["case"] == c and r["layout"] == "tp2->tp1x2" for r in rows)), None)
    main = main or next((c for c in cases if any(r["case"] == c and r["method"] in _BASELINE_KEYS for r in rows)),
                        None)
    shm_case = "issue4" if "issue4" in cases else main
    if shm_case is not None:
        shm = next((r for r in rows if r["case"] == shm_case and r["method"] == "weightsync-shm"
                    and r.get("over_memcpy")), None)
        if shm is not None:
            out["shm_over_memcpy"] = float(shm["over_memcpy"])
        zero = next((r for r in rows if r["case"] == shm_case and r["method"] == "weightsync-shm-zero-copy"
                     and r.get("over_memcpy")), None)
        if zero is not None:
            out["shm_zero_copy_over_memcpy"] = float(zero["over_memcpy"])
    if main is not None:
        for ours, suffix in (("weightsync-shm", ""), ("weightsync-torch", "_torch"),
                             ("weightsync-shm-zero-copy", "_shm_zero_copy")):
            mine = _seconds(rows, main, ours)
            if not mine:
                continue
            for method, key in _BASELINE_KEYS.items():
                theirs = _seconds(rows, main, method)
                if theirs:
                    out[f"{key}_over_weightsync{suffix}"] = theirs / mine
    for r in rows:
        method = r["method"]
        if not method.endswith("+integrity") or not r.get("seconds"):
            continue
        plain = _seconds(rows, r["case"], method.removesuffix("+integrity"))
        key = f"integrity_cost_{method.removesuffix('+integrity').removeprefix('weightsync-').replace('-', '_')}"
        if plain and key not in out:
            out[key] = float(r["seconds"]) / plain - 1.0
    peer = next((r for r in rows if r["method"] == "awex-p2p" and r.get("seconds")), None)
    if peer is not None:
        mine = _seconds(rows, peer["case"], "weightsync-torch")
        if mine:
            out["awex_over_weightsync_torch"] = float(peer["seconds"]) / mine
        mine = _seconds(rows, peer["case"], "weightsync-shm")
        if mine:
            out["awex_over_weightsync_shm"] = float(peer["seconds"]) / mine
        mine = _seconds(rows, peer["case"], "weightsync-shm-zero-copy")
        if mine:
            out["awex_over_weightsync_shm_zero_copy"] = float(peer["seconds"]) / mine
    return out


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def print_table(rows: Sequence[dict[str, Any]], *, console: Any = None, title: str = "weightsync bench") -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=title)
    for col in ("case", "method", "GB", "seconds", "GB/s", "x memcpy", "x limit", "vs safetensors",
                "vs per-param", "vs bucketed", "peak extra MB", "bitwise"):
        table.add_column(col, justify="left" if col in ("case", "method") else "right")
    for r in rows:
        if "seconds" not in r:
            table.add_row(r["case"], r["method"], "", "", "", "", "", "", "", "", "",
                          f"[red]{r.get('error', 'failed')[:60]}[/red]")
            continue
        sv = r.get("speedup_vs", {})

        def speed(name: str, sv: dict[str, float] = sv) -> str:
            return f"{sv[name]:.1f}x" if name in sv else ""

        peak = r.get("peak_extra_bytes", -1)
        table.add_row(
            r["case"], r["method"], _gb(r["bytes"]), f"{r['seconds']:.3f}", f"{r.get('gbps', 0):.2f}",
            f"{r['over_memcpy']:.2f}" if "over_memcpy" in r else "",
            f"{r['over_limit']:.2f} ({r['limit']})" if "over_limit" in r else "",
            speed("safetensors-disk"), speed("per-param-broadcast"), speed("bucketed-broadcast"),
            f"{peak / 2**20:.0f}" if peak >= 0 else "n/a",
            "yes" if r.get("verified") else "[red]NO[/red]",
        )
    console.print(table)


def plot(rows: Sequence[dict[str, Any]], limits: dict[str, dict[str, float]], path: str, *, title: str = "") -> None:
    """One panel per case: GB/s of every method, with the measured memcpy and loopback lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [c for c in dict.fromkeys(r["case"] for r in rows) if any(r["case"] == c and "gbps" in r for r in rows)]
    if not cases:
        raise ValueError("no successful rows to plot")
    cols = min(len(cases), 2)
    nrows = -(-len(cases) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(7.5 * cols, 0.45 * 8 * nrows + 1.0), squeeze=False)
    for ax in axes.flat[len(cases):]:
        ax.set_visible(False)
    for ax, case in zip(axes.flat, cases, strict=False):
        mine = [r for r in rows if r["case"] == case and "gbps" in r]
        names = [r["method"] for r in mine]
        values = [r["gbps"] for r in mine]
        colors = ["tab:green" if n.startswith("weightsync") else "tab:purple" if n.startswith("awex")
                  else "tab:gray" for n in names]
        ax.barh(names, values, color=colors)
        for y, (v, r) in enumerate(zip(values, mine, strict=True)):
            ax.text(v, y, f" {v:.2f} GB/s, {r['seconds']:.2f}s", va="center", fontsize=8)
        lim = limits.get(case, {})
        if lim.get("memcpy_gbps"):
            per_reader = mine[0]["per_reader_bytes"]
            total = mine[0]["bytes"]
            ax.axvline(lim["memcpy_gbps"] * total / per_reader, color="tab:red", ls="--", lw=1,
                       label="memcpy (readers in parallel)")
            ax.axvline(lim.get("loopback_gbps", 0) * total / per_reader, color="tab:blue", ls=":", lw=1,
                       label="gloo loopback")
        first = mine[0]
        ax.set_title(f"{case}: {first['model']} {first['dtype']}, {first['source']} -> {first['target']}",
                     fontsize=9)
        ax.set_xlabel("GB/s landed in engine memory (higher is better)")
        ax.invert_yaxis()
        ax.legend(fontsize=7, loc="lower right")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
