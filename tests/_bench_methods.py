"""Methods that cheat, for the bench's self-test: each would look fast and correct to a bench
that sends the same weights every time or checks only at the end."""

from __future__ import annotations

from weightsync.apps.bench.baselines import BucketedBroadcast, RankContext, SyncReport


class SkipsCopyAfterFirst(BucketedBroadcast):
    """A real bucketed broadcast for the first version; afterwards it moves nothing and claims
    the bytes anyway (a transport whose copy was skipped)."""

    name = "skips-copy"

    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx, bucket_bytes=1 << 20)
        self._claimed = 0

    def sync(self, version: int) -> SyncReport:
        if version == 0:
            report = super().sync(version)
            self._claimed = report.received_bytes
            return report
        return SyncReport({"broadcast": 0.0}, self._claimed)
