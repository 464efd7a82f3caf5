"""Body encodings of the meta server's HTTP API: msgpack for programs, JSON for people.

Clients send and accept ``application/msgpack``; ``curl`` users may send and read JSON instead
(``bytes`` travel as base64 strings there). Nothing is ever pickled: msgpack and JSON carry only
plain data, so a hostile body can at worst fail validation.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import msgpack

MSGPACK = "application/msgpack"
JSON = "application/json"
OCTETS = "application/octet-stream"
_MSGPACK_TYPES = (MSGPACK, "application/x-msgpack", "application/vnd.msgpack")


class BodyError(ValueError):
    """A request body that cannot be decoded (the server answers 400 or 415)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def media_type(content_type: str | None) -> str:
    """``"application/json; charset=utf-8"`` -> ``"application/json"``."""
    return (content_type or "").split(";", 1)[0].strip().lower()


def is_msgpack(content_type: str | None) -> bool:
    return media_type(content_type) in _MSGPACK_TYPES


def wants_msgpack(accept: str | None) -> bool:
    """Whether an ``Accept`` header asks for msgpack (JSON is the default for people)."""
    return any(is_msgpack(part) for part in (accept or "").split(","))


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    """Decode one msgpack object; BodyError if it is malformed, truncated or followed by junk."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    except msgpack.ExtraData as exc:
        raise BodyError(f"body has {len(exc.extra)} bytes after its msgpack object") from None
    except (ValueError, msgpack.UnpackException) as exc:
        raise BodyError(f"body is not valid msgpack ({exc}); send one msgpack map") from None


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, bytes):
        return base64.b64encode(obj).decode("ascii")
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def to_json(obj: Any) -> bytes:
    """JSON with ``bytes`` as base64 strings."""
    return json.dumps(_jsonable(obj), separators=(",", ":")).encode()


def extend_map(encoded: bytes, extra: dict[str, Any], *, msgpack_: bool) -> bytes:
    """Add ``extra``'s keys to an already encoded map without decoding it.

    Lets the server answer "the cached roster plus these documents" by appending a few bytes
    to the cached encoding instead of re-encoding a thousand rows per request.
    """
    if not extra:
        return encoded
    if not msgpack_:
        assert encoded[:1] == b"{" and encoded[-1:] == b"}", "not a JSON object"
        tail = to_json(extra)[1:]
        return encoded[:-1] + (b"," if len(encoded) > 2 else b"") + tail
    first = encoded[0]
    if 0x80 <= first <= 0x8F:
        count, body = first & 0x0F, encoded[1:]
    elif first == 0xDE:
        count, body = int.from_bytes(encoded[1:3], "big"), encoded[3:]
    elif first == 0xDF:
        count, body = int.from_bytes(encoded[1:5], "big"), encoded[5:]
    else:
        raise ValueError("not an encoded msgpack map")
    count += len(extra)
    header = bytes([0x80 | count]) if count < 16 else b"\xde" + count.to_bytes(2, "big") if count < 1 << 16 \
        else b"\xdf" + count.to_bytes(4, "big")
    return header + body + b"".join(pack(k) + pack(v) for k, v in extra.items())


def encode(obj: Any, *, msgpack_: bool) -> tuple[bytes, str]:
    """``(body, content type)`` in the chosen encoding."""
    return (pack(obj), MSGPACK) if msgpack_ else (to_json(obj), JSON)
