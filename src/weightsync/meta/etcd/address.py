"""An etcd address: ``etcd://[user@]host1:2379,host2:2379,host3:2379[/prefix][?ca=...&cert=...&key=...]``.

Pure parsing (no etcd client imported), so that :mod:`weightsync.meta.config` can check
``WEIGHTSYNC_META_ADDR`` at the edge and name what is wrong before anything connects.

- ``etcd://`` speaks plain HTTP to the members' client URLs; ``etcds://`` (or any of ``ca``,
  ``cert``, ``key`` given) speaks HTTPS, verifying the members against ``ca`` (else the
  system's CAs) and, with ``cert`` and ``key``, presenting a client certificate.
- ``user@`` turns on etcd's authentication as that user; the password comes from
  ``WEIGHTSYNC_ETCD_PASSWORD`` (read by :class:`~weightsync.meta.config.MetaEnv`), or from
  ``user:password@`` for throwaway setups (an address is logged; a password in it would be too).
- ``/prefix`` (default ``weightsync``) is the key prefix every key of weightsync lives under,
  so that one etcd cluster can serve several independent deployments.

    address = EtcdAddress.parse("etcd://n1:2379,n2:2379,n3:2379?ca=/etc/etcd/ca.pem")
    address.urls()     # ["https://n1:2379", "https://n2:2379", "https://n3:2379"]
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import parse_qsl, unquote

SCHEMES = ("etcd", "etcds")
DEFAULT_PREFIX = "weightsync"
_HOST_RE = re.compile(r"[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\]")
_PREFIX_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_EXAMPLE = "etcd://host1:2379,host2:2379,host3:2379"


def is_etcd_address(text: str) -> bool:
    """Whether ``text`` names an etcd cluster (its scheme is ``etcd://`` or ``etcds://``)."""
    return isinstance(text, str) and text.strip().lower().startswith(tuple(f"{s}://" for s in SCHEMES))


@dataclass(frozen=True, slots=True, kw_only=True)
class EtcdAddress:
    """Where the etcd cluster is and how to authenticate to it (see module docstring)."""

    endpoints: tuple[tuple[str, int], ...]
    tls: bool = False
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    prefix: str = DEFAULT_PREFIX

    @classmethod
    def parse(cls, text: str) -> EtcdAddress:
        """Parse an ``etcd://`` address; ValueError naming the part that is wrong and the form to use."""
        if not is_etcd_address(text):
            raise ValueError(f"an etcd address starts with etcd:// or etcds://, got {text!r} (e.g. {_EXAMPLE})")
        scheme, rest = text.strip().split("://", 1)
        rest, _, query = rest.partition("?")
        rest, _, prefix = rest.partition("/")
        user = password = None
        if "@" in rest:
            creds, rest = rest.rsplit("@", 1)
            user, sep, pw = creds.partition(":")
            user, password = unquote(user), (unquote(pw) if sep else None)
            if not user:
                raise ValueError(f"etcd address {_safe(text)!r}: the user before '@' is empty")
        endpoints = tuple(_endpoint(part, text) for part in rest.split(","))
        if len(set(endpoints)) != len(endpoints):
            raise ValueError(f"etcd address {_safe(text)!r} names an endpoint twice")
        options = _options(query, text)
        prefix = prefix.strip("/") or DEFAULT_PREFIX
        if not _PREFIX_RE.fullmatch(prefix):
            raise ValueError(f"etcd address {_safe(text)!r}: key prefix {prefix!r} must be 1-64 characters from "
                             "[A-Za-z0-9._-], starting with a letter or digit")
        tls = scheme.lower() == "etcds" or any(options.get(k) for k in ("ca", "cert", "key"))
        return cls(endpoints=endpoints, tls=tls, user=user, password=password, prefix=prefix, **options)

    def with_password(self, password: str | None) -> EtcdAddress:
        """This address with ``password`` (from the environment) unless it carries one already."""
        if password is None or self.password is not None:
            return self
        if self.user is None:
            raise ValueError("WEIGHTSYNC_ETCD_PASSWORD is set but the etcd address names no user: write it as "
                             "etcd://USER@host1:2379,... (or unset WEIGHTSYNC_ETCD_PASSWORD)")
        return replace(self, password=password)

    def urls(self) -> list[str]:
        scheme = "https" if self.tls else "http"
        return [f"{scheme}://{_bracket(host)}:{port}" for host, port in self.endpoints]

    def __str__(self) -> str:
        """The address without its password (safe to log)."""
        who = f"{self.user}@" if self.user else ""
        hosts = ",".join(f"{_bracket(h)}:{p}" for h, p in self.endpoints)
        return f"{'etcds' if self.tls else 'etcd'}://{who}{hosts}/{self.prefix}"


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _safe(text: str) -> str:
    """``text`` with any password replaced by ``***``."""
    return re.sub(r"(://[^:@/]*:)[^@/]*@", r"\1***@", text)


def _endpoint(part: str, text: str) -> tuple[str, int]:
    host, sep, port = part.strip().rpartition(":")
    if not sep or not host or not _HOST_RE.fullmatch(host) or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"etcd address {_safe(text)!r}: endpoint {part!r} is not host:port (e.g. {_EXAMPLE}; "
                         "each member's client URL, port 2379 by default)")
    return host.strip("[]"), int(port)


def _options(query: str, text: str) -> dict[str, str | None]:
    options: dict[str, str | None] = {"ca": None, "cert": None, "key": None}
    for name, value in parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        if name not in options:
            raise ValueError(f"etcd address {_safe(text)!r}: unknown option {name!r}; the options are ca=, cert= "
                             "and key= (PEM files for TLS)")
        if not Path(value).is_file():
            raise ValueError(f"etcd address {_safe(text)!r}: {name}={value!r} is not a readable file")
        options[name] = value
    if (options["cert"] is None) != (options["key"] is None):
        raise ValueError(f"etcd address {_safe(text)!r}: a client certificate needs both cert= and key=")
    return options
