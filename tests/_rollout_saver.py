"""Child process of tests/test_rollouts.py: saves a rollout record and is killed in the middle of it.

    python _rollout_saver.py DIRECTORY

Saves a small record of rollout ``r``, then a large one over it; the large save stops after its
first chunk is written, prints ``MID-SAVE`` and waits to be killed (the test drives when).
"""

from __future__ import annotations

import os
import sys
import time

from weightsync.roles.rollouts import files as rollout_files
from weightsync.roles.rollouts.record import RolloutRecord, Sampling, ToolCall, Turn
from weightsync.roles.rollouts.store import RolloutStore


def main() -> None:
    store = RolloutStore(sys.argv[1])
    record = store.save(RolloutRecord.start("r", [1, 2, 3], sampling=Sampling(max_tokens=8, seed=5)))
    big = record.with_turn(Turn(kind="generated", token_ids=tuple(range(300_000)), weight_version=1, engine="e"))
    big = big.with_turn(Turn(kind="tool", token_ids=(7,), tool_call=ToolCall(name="t"), tool_result="x"))
    write = os.write

    def write_then_stall(fd: int, data: bytes | memoryview) -> int:
        n = write(fd, data)
        print("MID-SAVE", flush=True)
        time.sleep(600)
        return n

    rollout_files.CHUNK = 4096
    os.write = write_then_stall  # type: ignore[assignment]
    store.save(big)


if __name__ == "__main__":
    main()
