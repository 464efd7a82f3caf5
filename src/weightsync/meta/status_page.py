"""The meta server's small human-readable status page (``GET /status``).

Rendered from the same dict as ``GET /v1/status`` (JSON), so the two never disagree. Plain
HTML, no scripts; it reloads itself every few seconds. Everything user-supplied is escaped.
"""

from __future__ import annotations

import html
import time
from typing import Any


def _ago(at: float | None, now: float) -> str:
    if at is None:
        return "never"
    seconds = max(0.0, now - at)
    if seconds < 120:
        return f"{seconds:.1f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def _table(headers: list[str], rows: list[list[Any]], *, bad: list[bool] | None = None) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    marks = bad or [False] * len(rows)
    body = "".join(("<tr class='bad'>" if mark else "<tr>") + "".join(f"<td>{html.escape(str(c))}</td>" for c in row)
                   + "</tr>" for row, mark in zip(rows, marks, strict=True))
    return f"<table><tr>{head}</tr>{body}</table>"


def _state(reader: dict[str, Any], now: float) -> str:
    """A reader's state: valid, invalid since when (a failed update left its engine a mix of
    versions), or no version yet."""
    if reader["state"] == "invalid":
        return f"INVALID since {_ago(reader['invalid_since'], now)}"
    return "valid" if reader["state"] == "valid" else "no version yet"


def _failure(reader: dict[str, Any]) -> str:
    if not reader["error"]:
        return ""
    version = reader.get("failed_version")
    return reader["error"] if version is None else f"version {version}: {reader['error']}"


def _completions(rows: list[dict[str, Any]]) -> str:
    """The newest versions under the job's quorum or fraction policy: who applied, who missed
    (and why), who has caught up since."""
    if "error" in rows[0]:
        return f"<h3>Completion</h3><p class='bad'>{html.escape(rows[0]['error'])}</p>"
    return f"<h3>Completion ({html.escape(rows[0]['policy'])})</h3>" + _table(
        ["version", "state", "applied", "missed", "caught up since"],
        [[c["version"], c["state"], f"{len(c['applied'])} of {c['needed']} needed: {c['applied']}",
          "; ".join(f"reader {r}: {why}" for r, why in c["missed"].items()), ", ".join(map(str, c["caught_up"]))]
         for c in rows],
        bad=[c["state"] == "failed" for c in rows])


def render(status: dict[str, Any], *, refresh_seconds: int = 5) -> str:
    """HTML for a ``MetaState.status()`` dict."""
    now = time.time()
    server = status["server"]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<meta http-equiv='refresh' content='{refresh_seconds}'><title>weightsync meta server</title>",
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:.5em 0 1.5em}"
        "td,th{border:1px solid #ccc;padding:2px 8px;text-align:left;font-size:90%}th{background:#eee}"
        ".bad{color:#b00}</style></head><body>",
        "<h1>weightsync meta server</h1>",
        f"<p>up {html.escape(_ago(server['started_at'], now).replace(' ago', ''))}, "
        f"{'durable (state directory)' if server['durable'] else 'in memory'}, "
        f"{len(status['jobs'])} job(s), {server['waiting']} long-poll(s) waiting.</p>",
    ]
    if not status["jobs"]:
        parts.append("<p>No jobs yet.</p>")
    for job in status["jobs"]:
        latest = job["latest_version"]
        version = (f"version {latest['version']} (fingerprint {latest['fingerprint']}, "
                   f"published {_ago(latest['published_at'], now)})" if latest else "no version published yet")
        parts.append(f"<h2>job {html.escape(job['job'])}</h2>")
        parts.append(f"<p>{job['writers']} writer(s), {job['readers']} reader(s); {html.escape(version)}; "
                     f"last sync {html.escape(_ago(job['last_sync_at'], now))}.</p>")
        if job["pending_versions"]:
            parts.append("<h3>Versions being published</h3>" + _table(
                ["version", "fingerprint", "writers reported"],
                [[p["version"], p["fingerprint"], f"{p['reported']} / {p['num_writers']}"]
                 for p in job["pending_versions"]]))
        if job["reader_state"]:
            parts.append("<h3>Readers</h3>" + _table(
                ["rank", "state", "version", "lag", "last sync", "seconds", "bytes", "last failure"],
                [[r["rank"], _state(r, now), "" if r["version"] is None else r["version"],
                  "" if r["lag"] is None else r["lag"], _ago(r["last_sync_at"], now),
                  f"{r['seconds']:.3f}", r["nbytes"], _failure(r)] for r in job["reader_state"]],
                bad=[r["state"] == "invalid" for r in job["reader_state"]]))
        if job["completions"]:
            parts.append(_completions(job["completions"]))
        parts.append("<h3>Participants</h3>" + _table(
            ["role", "rank", "group", "host", "endpoints", "layout"],
            [[p["role"], p["rank"], p["group"], p["host"],
              ", ".join(f"{k}={v}" for k, v in sorted(p["endpoints"].items())), p["layout"]]
             for p in job["participants"]]))
        if job["documents"]:
            parts.append("<h3>Documents</h3>" + _table(
                ["key", "bytes"], [[k, n] for k, n in job["documents"].items()]))
    parts.append("</body></html>")
    return "".join(parts)
