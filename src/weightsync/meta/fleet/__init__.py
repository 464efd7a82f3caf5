"""The coordinator's decisions for a fleet of writers and readers: one pure function.

``decide(record, command, now)`` (:mod:`.decide`) is the only code that changes a job's
:class:`~weightsync.ports.fleet.FleetRecord`: who is a member, which generation is current,
each try's state and each reader's outcome. Backends apply it and store what it returns; they
never decide themselves. The embedded meta server applies it under its lock and keeps the
commands in its store (replayed through the same function after a restart); a replicated store
(etcd, issue 38) applies it in an optimistic transaction: read the record at revision R,
decide, put it back if the record is still at R (else read again and decide again).

    decision = decide(record, Join("reader", None, "3fa2", host="n0", pid=41, shape=shape), now)
    record = decision.record                 # the new record (the same object: nothing changed)
    decision.reply.id                        # the id the coordinator gave the reader
"""
