"""Where the meta server is and how to authenticate: read once, at the edge, from the environment.

    WEIGHTSYNC_META_ADDR        http://host:port (or host:port) of a running meta server, or
                                etcd://host1:2379,host2:2379,host3:2379 of an etcd cluster
                                (see weightsync.meta.etcd.address)
    WEIGHTSYNC_ETCD_PASSWORD    the password of the etcd user named in an etcd:// address
    WEIGHTSYNC_META_TOKEN       the shared secret, or
    WEIGHTSYNC_META_TOKEN_FILE  a file holding it (e.g. the server's --token-file on a shared disk)

    env = MetaEnv.from_env()
    client = MetaClient(env.address, token=env.token)
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from weightsync.meta.etcd.address import EtcdAddress, is_etcd_address

ENV_ADDR = "WEIGHTSYNC_META_ADDR"
ENV_TOKEN = "WEIGHTSYNC_META_TOKEN"
ENV_TOKEN_FILE = "WEIGHTSYNC_META_TOKEN_FILE"
ENV_ETCD_PASSWORD = "WEIGHTSYNC_ETCD_PASSWORD"
MIN_TOKEN_LENGTH = 8


def normalize_address(address: str, source: str = ENV_ADDR) -> str:
    """``"host:port"`` or ``"http://host:port/"`` -> ``"http://host:port"``; an ``etcd://`` address
    is checked (:class:`~weightsync.meta.etcd.address.EtcdAddress`) and kept as it is. ValueError if unusable."""
    if not isinstance(address, str) or not address.strip():
        raise ValueError(f"meta server address must be 'http://host:port' or 'host:port', got {address!r}")
    if is_etcd_address(address):
        EtcdAddress.parse(address)
        return address.strip()
    text = address.strip().rstrip("/")
    if "://" not in text:
        text = "http://" + text
    parts = urlsplit(text)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None or parts.path:
        raise ValueError(f"meta server address must be 'http://host:port' or 'host:port' (or an etcd cluster's "
                         f"'etcd://host1:2379,host2:2379,...'), got {address!r} (check {source})")
    return f"{parts.scheme}://{parts.netloc}"


def config_address(address: str, where: str) -> str:
    """A coordinator address a job's config names (``SyncConfig.meta_address``), normalized as
    :func:`normalize_address` does; "" stays "" (the environment's, or an embedded server).

    A config travels (Ray ships it to every actor, logs print it), so an etcd password in it is
    refused: it belongs in ``WEIGHTSYNC_ETCD_PASSWORD``.

    Raises:
        ValueError: naming ``where`` and what is wrong.
    """
    if address == "":
        return ""
    try:
        text = normalize_address(address, source=where)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if is_etcd_address(text) and EtcdAddress.parse(text).password is not None:
        raise ValueError(f"{where} carries an etcd password (user:password@): a config is sent to every rank and "
                         f"logged; give etcd://user@host:port,... and the password in {ENV_ETCD_PASSWORD}")
    return text


def same_coordinator(a: str, b: str) -> bool:
    """Whether two addresses name one coordinator (normalized; an etcd address without its password)."""
    def key(address: str) -> str:
        return str(EtcdAddress.parse(address)) if is_etcd_address(address) else normalize_address(address)
    return key(a) == key(b)


def check_token(token: str, source: str) -> str:
    token = token.strip() if isinstance(token, str) else token
    if not isinstance(token, str) or len(token) < MIN_TOKEN_LENGTH or any(c.isspace() for c in token):
        raise ValueError(f"the meta server token from {source} must be at least {MIN_TOKEN_LENGTH} characters "
                         "without spaces (python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    return token


def new_token() -> str:
    """A fresh meta server token. Never one that starts with ``-`` (1 in 64 of URL-safe tokens): a
    command line reads ``--token -x...`` as two options, and ``weightsync status --token`` failed."""
    while (token := secrets.token_urlsafe(32)).startswith("-"):
        pass
    return token


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token stored in ``path``; ValueError naming the file if it is missing or unusable."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ValueError(f"token file {p} does not exist; start the server with --token-file {p} "
                         f"(it creates the file) or set {ENV_TOKEN}") from None
    return check_token(text, f"token file {p}")


def ensure_token_file(path: str | os.PathLike[str]) -> str:
    """Read ``path``, or create it (mode 0600) with a fresh random token if it does not exist."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_token_file(p)
    token = new_token()
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


@dataclass(frozen=True, slots=True, kw_only=True)
class MetaEnv:
    """The meta server settings found in the environment (None where unset)."""

    address: str | None = None
    token: str | None = None
    #: the password of the etcd user an ``etcd://`` address names (``WEIGHTSYNC_ETCD_PASSWORD``)
    etcd_password: str | None = field(default=None, repr=False)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> MetaEnv:
        env = os.environ if environ is None else environ
        address = env.get(ENV_ADDR, "").strip() or None
        token = env.get(ENV_TOKEN, "").strip() or None
        if token is not None:
            token = check_token(token, ENV_TOKEN)
        elif env.get(ENV_TOKEN_FILE, "").strip():
            token = read_token_file(env[ENV_TOKEN_FILE].strip())
        return cls(address=normalize_address(address) if address else None, token=token,
                   etcd_password=env.get(ENV_ETCD_PASSWORD) or None)
