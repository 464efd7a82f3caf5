"""The meta server's data model, shared by the server and its clients.

A **participant** is one writer (training) or reader (inference) rank of a job: where it runs
(``host``), how peers reach it (``endpoints``, transport name -> address) and an opaque
``layout`` blob describing what it holds. The server never parses the blob; weightsync's
writer and reader put a small msgpack layout *descriptor* in it (``megatron:tp=8,...`` plus the
key of a job document holding the model config), so the blob is rank-free and thousands of
ranks share a handful of distinct blobs.

The bulk roster is therefore **columnar and content-addressed**::

    {"job": "default", "roster_revision": 1281,
     "blobs": {"3fa2...": b"<layout descriptor>", ...},
     "participants": {"writer": {"rank": [0, 1, ...],
                                 "group": [["train", 1024]],          # run-length encoded
                                 "host": [["node-0000", 8], ...],      # run-length encoded
                                 "layout": [["3fa2...", 1024]],        # run-length, blob hashes
                                 "endpoints": {"nixl": ["10.0.0.1:5555", ...]}},
                      "reader": {...}}}

so 1280 participants with two distinct blobs cost a few tens of KB, and decoding it is a few
list creations rather than a dict per row. :class:`ParticipantTable` is the decoded roster;
it builds :class:`Participant` objects only on request.
"""

from __future__ import annotations

import hashlib
import re
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Mapping, Sequence
from itertools import accumulate, chain, repeat
from typing import Any

from weightsync.ports.records import ROLES, Participant, check_role

_JOB_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,255}")


def check_job(job: str) -> str:
    """Return ``job`` if it is a valid job namespace name, else raise ValueError."""
    if not isinstance(job, str) or not _JOB_RE.fullmatch(job):
        raise ValueError(f"invalid job name {job!r}: use 1-128 characters from [A-Za-z0-9._-], "
                         "starting with a letter or digit")
    return job


def check_document_key(key: str) -> str:
    """Return ``key`` if it is a valid document key, else raise ValueError."""
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key) or ".." in key:
        raise ValueError(f"invalid document key {key!r}: use 1-256 characters from [A-Za-z0-9._:/-], "
                         "starting with a letter or digit, without '..'")
    return key


def blob_hash(data: bytes) -> str:
    """The content address of a layout blob (128-bit BLAKE2b, hex)."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


# --- the columnar roster -----------------------------------------------------------------------

def run_length(values: Iterable[Any]) -> list[list[Any]]:
    """``["a", "a", "b"]`` -> ``[["a", 2], ["b", 1]]``."""
    runs: list[list[Any]] = []
    for v in values:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return runs


class _Runs:
    """A run-length encoded column: values looked up by row without expanding the runs."""

    __slots__ = ("_ends", "n", "runs", "what")

    def __init__(self, runs: Sequence[Sequence[Any]], n: int, what: str) -> None:
        self.runs, self.n, self.what = runs, n, what
        self._ends: list[int] | None = None

    @property
    def values(self) -> list[Any]:
        return [run[0] for run in self.runs]

    @property
    def ends(self) -> list[int]:
        if self._ends is None:
            ends = list(accumulate(run[1] for run in self.runs))
            if (ends[-1] if ends else 0) != self.n or any(run[1] <= 0 for run in self.runs):
                raise ValueError(f"malformed roster: column {self.what!r} does not cover {self.n} rows")
            self._ends = ends
        return self._ends

    def __getitem__(self, row: int) -> Any:
        return self.runs[bisect_right(self.ends, row)][0]

    def expand(self) -> list[Any]:
        self.ends  # noqa: B018 (validates the runs)
        return list(chain.from_iterable(repeat(run[0], run[1]) for run in self.runs))


def encode_columns(rows: Sequence[tuple[int, str, str, Mapping[str, str], str]]) -> dict[str, Any]:
    """Columns of one role from rows ``(rank, group, host, endpoints, layout_hash)`` sorted by rank."""
    names = sorted({name for row in rows for name in row[3]})
    return {
        "rank": [r[0] for r in rows],
        "group": run_length(r[1] for r in rows),
        "host": run_length(r[2] for r in rows),
        "layout": run_length(r[4] for r in rows),
        "endpoints": {name: [r[3].get(name) for r in rows] for name in names},
    }


class _Columns:
    __slots__ = ("endpoints", "group", "host", "layout", "rank")

    def __init__(self, obj: Mapping[str, Any]) -> None:
        self.rank: list[int] = obj["rank"]
        n = len(self.rank)
        self.group = _Runs(obj["group"], n, "group")
        self.host = _Runs(obj["host"], n, "host")
        self.layout = _Runs(obj["layout"], n, "layout")
        self.endpoints: dict[str, list[str | None]] = obj["endpoints"]
        if any(len(v) != n for v in self.endpoints.values()):
            raise ValueError("malformed roster: an endpoints column has the wrong length")


class ParticipantTable:
    """A job's participants as fetched in one bulk call (see the module docstring).

    Cheap to build (a few list copies); :class:`Participant` objects are made only by
    :meth:`get` and :meth:`participants`.
    """

    __slots__ = ("_cols", "blobs", "documents", "job", "roster_revision")

    def __init__(self, job: str, roster_revision: int, blobs: Mapping[str, bytes],
                 columns: Mapping[str, Mapping[str, Any]], documents: Mapping[str, bytes | None] | None = None) -> None:
        self.job = job
        self.roster_revision = roster_revision
        self.blobs: Mapping[str, bytes] = blobs
        #: the documents asked for with the roster (None: absent when the roster was read)
        self.documents: Mapping[str, bytes | None] = documents or {}
        self._cols = {role: _Columns(columns[role]) for role in ROLES if role in columns}

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> ParticipantTable:
        """Decode the server's bulk roster; ValueError if it is malformed."""
        try:
            return cls(str(obj["job"]), int(obj["roster_revision"]), dict(obj["blobs"]), obj["participants"],
                       obj.get("documents"))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed roster from the meta server: {exc!r}") from exc

    def count(self, role: str) -> int:
        """Number of registered participants with this role."""
        cols = self._cols.get(check_role(role))
        return len(cols.rank) if cols else 0

    def ranks(self, role: str) -> list[int]:
        """Registered ranks of ``role``, ascending."""
        cols = self._cols.get(check_role(role))
        return list(cols.rank) if cols else []

    def missing(self, role: str, expected: int) -> list[int]:
        """Ranks in ``range(expected)`` that have not registered."""
        have = set(self.ranks(role))
        return [r for r in range(expected) if r not in have]

    def get(self, role: str, rank: int) -> Participant | None:
        """The participant ``(role, rank)``, or None if it has not registered."""
        cols = self._cols.get(check_role(role))
        if cols is None:
            return None
        i = bisect_left(cols.rank, rank)
        if i == len(cols.rank) or cols.rank[i] != rank:
            return None
        return self._make(role, cols, i)

    def _make(self, role: str, cols: _Columns, i: int) -> Participant:
        endpoints = {name: col[i] for name, col in cols.endpoints.items() if col[i] is not None}
        return Participant._trusted(role, cols.rank[i], cols.group[i], cols.host[i], endpoints,  # type: ignore[arg-type]
                                    self.blobs[cols.layout[i]])

    def participants(self, role: str | None = None) -> list[Participant]:
        """All participants (or those of ``role``), sorted by ``(role, rank)``."""
        out: list[Participant] = []
        for r in ROLES if role is None else (check_role(role),):
            cols = self._cols.get(r)
            if cols is None:
                continue
            names, n = list(cols.endpoints), len(cols.rank)
            endpoints = ([{k: e for k, e in zip(names, row, strict=True) if e is not None}
                          for row in zip(*cols.endpoints.values(), strict=True)] if names else [{} for _ in range(n)])
            groups, hosts, hashes = cols.group.expand(), cols.host.expand(), cols.layout.expand()
            try:
                layouts = [self.blobs[h] for h in hashes]
            except KeyError as exc:
                raise ValueError(f"malformed roster: layout blob {exc} is missing") from None
            out.extend(map(Participant._trusted, repeat(r, n), cols.rank, groups, hosts, endpoints, layouts))
        return out

    def layouts(self, role: str) -> dict[bytes, list[int]]:
        """Distinct layout blobs of ``role`` -> the ranks that registered each (ascending)."""
        cols = self._cols.get(check_role(role))
        out: dict[bytes, list[int]] = {}
        if cols:
            start = 0
            for h, end in zip(cols.layout.values, cols.layout.ends, strict=True):
                out.setdefault(self.blobs[h], []).extend(cols.rank[start:end])
                start = end
        return out

    def __len__(self) -> int:
        return sum(len(c.rank) for c in self._cols.values())

    def __repr__(self) -> str:
        return (f"ParticipantTable(job={self.job!r}, writers={self.count('writer')}, "
                f"readers={self.count('reader')}, blobs={len(self.blobs)})")
