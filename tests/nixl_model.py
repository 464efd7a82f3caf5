"""A CPU model of the slice of the ``nixl`` Python API :mod:`weightsync.transport.nixl.agent` uses
(tests only), with the rules of the real one the device model (``tests/device_model.py``) enforces:

* **Registration bounds**: a descriptor must lie inside one memory registration of its agent,
  as ``nixlSecDescList::getCoveringIndex`` checks in NIXL's ``src/infra/nixl_descriptors.cpp``.
* **Transfers complete later than they are posted**: ``transfer`` returns ``"PROC"``; the NIC
  moves the bytes at a later ``check_xfer_state`` (after ``lag`` polls, drawn at random), and
  the notification reaches the peer only then. Until then the NIC's reads and writes are
  pending in the device model, so anyone touching that memory meanwhile is a hazard.

    monkeypatch.setattr(nixl_agent, "load_nixl", NixlModel(model).module)
"""

from __future__ import annotations

import ctypes
import random
import threading
import types
from typing import Any

from device_model import DeviceModel, Range


class NixlModel:
    """Agents in one process find each other by name; transfers are memory copies the device model
    sees as NIC accesses (see module docstring).

    Args:
        model: the device model that checks the NIC's accesses (None: no checks).
        lag: the most polls a transfer stays ``"PROC"`` after it is posted (0: done at once).
    """

    def __init__(self, model: DeviceModel | None = None, *, lag: int = 2, seed: int = 0) -> None:
        self.model = model
        self.lag = lag
        self.rng = random.Random(seed)
        self.agents: dict[str, _Agent] = {}
        self.lock = threading.RLock()
        bindings = types.ModuleType("nixl_model._bindings")
        bindings.nixlNotFoundError = type("nixlNotFoundError", (Exception,), {})  # type: ignore[attr-defined]
        bindings.nixlInvalidParamError = type("nixlInvalidParamError", (Exception,), {})  # type: ignore[attr-defined]
        self.bindings = bindings
        mod = types.ModuleType("nixl_model")
        mod._bindings = bindings  # type: ignore[attr-defined]
        mod.nixl_agent_config = lambda **kw: kw  # type: ignore[attr-defined]
        mod.nixl_thread_sync_t = types.SimpleNamespace(NIXL_THREAD_SYNC_STRICT=1)  # type: ignore[attr-defined]
        mod.nixl_agent = lambda name, config: _Agent(self, name)  # type: ignore[attr-defined]
        self._module = mod

    def module(self) -> types.ModuleType:
        return self._module

    def refuse(self, message: str) -> Exception:
        if self.model is not None:
            self.model.violations.append(message)
        return self.bindings.nixlNotFoundError(message)  # type: ignore[no-any-return]


class _Handle:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)

    def release(self) -> None:
        pass


class _Agent:
    def __init__(self, nixl: NixlModel, name: str) -> None:
        self.nixl, self.name = nixl, name
        self.regs: list[tuple[str, int, int, int]] = []  # (mem, device, start, end)
        self.notifs: dict[str, list[bytes]] = {}
        with nixl.lock:
            nixl.agents[name] = self

    def create_backend(self, kind: str, params: Any) -> None:
        pass

    def register_memory(self, regions: list[tuple[int, int, int, str]], mem: str) -> _Handle:
        new = [(mem, int(dev), int(a), int(a) + int(n)) for a, n, dev, _ in regions]
        self.regs += new
        return _Handle(regs=new)

    def deregister_memory(self, handle: _Handle) -> None:
        for reg in handle.regs:
            self.regs.remove(reg)

    def get_agent_metadata(self) -> bytes:
        return self.name.encode()

    def add_remote_agent(self, metadata: bytes) -> bytes:
        return bytes(metadata)

    def make_connection(self, peer: Any) -> None:
        pass

    def remove_remote_agent(self, peer: Any) -> None:
        pass

    def prep_xfer_dlist(self, agent: str, descs: Any, mem: str) -> _Handle:
        owner = self if agent == "NIXL_INIT_AGENT" else self.nixl.agents[agent if isinstance(agent, str)
                                                                          else agent.decode()]
        rows = [(int(a), int(n), int(d)) for a, n, d in descs]
        for a, n, d in rows:
            if not any(m == mem and dev == d and s <= a and a + n <= e for m, dev, s, e in owner.regs):
                raise self.nixl.refuse(f"NIXL: descriptor ({a:#x}, {n} bytes, dev {d}) of {owner.name} is not "
                                       "inside one memory registration (nixlSecDescList::getCoveringIndex)")
        return _Handle(owner=owner, rows=rows)

    def make_prepped_xfer(self, op: str, local: _Handle, li: Any, remote: _Handle, ri: Any) -> _Handle:
        return _Handle(op=op, local=local, remote=remote, pairs=list(zip(li, ri, strict=True)), pending=None)

    def transfer(self, handle: _Handle, notif: bytes = b"") -> str:
        pairs = [(handle.local.rows[int(i)], handle.remote.rows[int(j)]) for i, j in handle.pairs]
        local: list[Range] = [(a, a + n) for (a, n, _), _ in pairs]
        remote: list[Range] = [(a, a + n) for _, (a, n, _) in pairs]
        reads, writes = (remote, local) if handle.op == "READ" else (local, remote)
        who = f"a NIXL {handle.op} of {self.name}"
        model = self.nixl.model
        if model is not None:
            model.dma(reads, writes, who)  # what the NIC will touch must be idle when it is posted

        def move() -> None:
            for (la, n, _), (ra, _, _) in pairs:
                src, dst = (ra, la) if handle.op == "READ" else (la, ra)
                ctypes.memmove(dst, src, n)
            if notif:
                peer = handle.remote.owner
                with self.nixl.lock:
                    peer.notifs.setdefault(self.name, []).append(bytes(notif))

        with self.nixl.lock:
            polls = self.nixl.rng.randint(0, self.nixl.lag)
        if polls == 0:
            move()
            return "DONE"
        handle.pending = (model.post_nic(reads, writes, who) if model is not None else None, move, polls)
        return "PROC"

    def check_xfer_state(self, handle: _Handle) -> str:
        if handle.pending is None:
            return "DONE"
        nic, move, polls = handle.pending
        if polls > 1:
            handle.pending = (nic, move, polls - 1)
            return "PROC"
        handle.pending = None
        move()
        if nic is not None and self.nixl.model is not None:
            self.nixl.model.end_nic(nic)
        return "DONE"

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        with self.nixl.lock:
            out, self.notifs = self.notifs, {}
        return out
