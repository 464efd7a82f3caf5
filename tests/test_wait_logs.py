"""What a rank waiting for its peers logs (issue 41): one INFO line every few seconds naming
who is missing and how long is left, and no per-request lines of the HTTP library."""

from __future__ import annotations

import logging

import pytest

from weightsync.meta import EmbeddedMetaServer, MetaClient, Participant, client_base


@pytest.fixture
def httpx_level():
    library = logging.getLogger("httpx")
    level = library.level
    library.setLevel(logging.NOTSET)
    yield library
    library.setLevel(level)


@pytest.fixture
def server():
    with EmbeddedMetaServer() as running:
        yield running


def test_a_registration_wait_says_who_is_missing_every_few_seconds_and_httpx_stays_quiet(server, httpx_level,
                                                                                           caplog, monkeypatch):
    monkeypatch.setattr(client_base, "PROGRESS_SECONDS", 0.3)
    caplog.set_level(logging.INFO)
    with MetaClient(server.address, job="waits", token=server.token) as client:
        client.register(Participant("writer", 0, "train", "h0", {}, b""))
        client.register(Participant("reader", 0, "serve", "h0", {}, b""))
        with pytest.raises(TimeoutError, match=r"missing writer ranks \[1\] \(1\) and reader ranks \[1, 2\] \(2\)"):
            client.wait_table(writers=2, readers=3, timeout=1.6)
    waits = [r.getMessage() for r in caplog.records if r.name == "weightsync.meta.client" and r.levelno == logging.INFO]
    assert 3 <= len(waits) <= 6, waits  # one line per 0.3 s of a 1.6 s wait
    assert all(m.startswith("job 'waits': waiting for writer ranks [1] (1) and reader ranks [1, 2] (2) to register "
                            "(1/2 writers, 1/3 readers so far); ") and m.endswith(" s left") for m in waits), waits
    assert not [r for r in caplog.records if r.name.startswith("httpx")]
    assert httpx_level.level == logging.WARNING


def test_a_level_the_application_set_on_httpx_is_kept(server, httpx_level):
    root = logging.getLogger().level
    httpx_level.setLevel(logging.DEBUG)
    with MetaClient(server.address, job="waits", token=server.token):
        pass
    assert httpx_level.level == logging.DEBUG
    assert logging.getLogger().level == root  # the root logger is never touched
