"""The mDNS TXT codec: :class:`Announcement` to DNS-SD TXT entries and back.

Each entry ``key=value`` stays within DNS-SD's 255-byte limit. ``pv`` carries the protocol
version. Unknown keys are ignored (newer agents may add some); missing or malformed values
raise :class:`TxtRecordError`, and so does a record a real agent could not have sent: an entry
over 255 bytes, more than :data:`MAX_TXT_ENTRIES` entries or over :data:`MAX_RECORD_BYTES` in
all (checked before anything is parsed).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final

import pydantic

from protocols.errors import TxtRecordError
from protocols.profile import AgentState, Announcement, DeviceProfile

MAX_ENTRY_BYTES: Final = 255
MAX_TXT_ENTRIES: Final = 64
"""Most entries a record may have (an agent sends 18 at most)."""
MAX_RECORD_BYTES: Final = 4096
"""Most bytes a whole record may have, with one length byte per entry (an agent's fit in
18 x 256)."""

# TXT key -> model field. Every profile key is required; state keys are optional.
_PROFILE_KEYS: Final = {
    "pv": "protocol_version",
    "id": "device_id",
    "name": "name",
    "mem": "memory_bytes",
    "gf": "gflops",
    "prov": "providers",
    "cp": "control_port",
    "dp": "data_port",
    "fp": "cert_fingerprint",
    "sw": "software_version",
}
_OPTIONAL_PROFILE_KEYS: Final = {
    "mbw": "memory_gbps",
    "cbw": "cache_gbps",
    "cache": "cache_bytes",
    "opus": "op_us",
    "callus": "call_us",
    "topkns": "topk_ns",
    "gemv": "gemv_gflops",
    "vec": "vector_gflops",
    "i4x": "int4_rows_exact",
}
"""Profile keys older agents do not send: left out when unset, absent means unknown."""
_STATE_KEYS: Final = {"paired": "paired", "seg": "segment_sha256", "plv": "plan_version"}


def encode_txt(announcement: Announcement) -> dict[str, str]:
    """TXT entries for an announcement; raises TxtRecordError if an entry would exceed 255 bytes."""
    profile = announcement.profile.model_dump()
    state = announcement.state.model_dump()
    entries = {key: _to_text(profile[field]) for key, field in _PROFILE_KEYS.items()}
    for key, field in _OPTIONAL_PROFILE_KEYS.items():
        if profile[field] is not None:
            entries[key] = _to_text(profile[field])
    for key, field in _STATE_KEYS.items():
        if state[field] is not None:
            entries[key] = _to_text(state[field])
    for key, value in entries.items():
        size = len(key.encode()) + 1 + len(value.encode())
        if size > MAX_ENTRY_BYTES:
            raise TxtRecordError(f"TXT entry {key!r} is {size} bytes, over {MAX_ENTRY_BYTES}")
    return entries


def decode_txt(properties: Mapping[bytes, bytes | None] | Mapping[str, str | None]) -> Announcement:
    """Parse TXT entries as zeroconf hands them over (bytes or str keys and values)."""
    _check_size(properties)
    text = {_as_text(k): _as_text(v) for k, v in properties.items() if v is not None}
    missing = [key for key in _PROFILE_KEYS if key not in text]
    if missing:
        raise TxtRecordError(f"TXT record lacks {', '.join(missing)}")
    profile_fields = {field: _from_text(field, text[key]) for key, field in _PROFILE_KEYS.items()}
    profile_fields |= {
        field: _from_text(field, text[key])
        for key, field in _OPTIONAL_PROFILE_KEYS.items()
        if key in text
    }
    state_fields = {
        field: _from_text(field, text[key]) for key, field in _STATE_KEYS.items() if key in text
    }
    try:
        return Announcement(
            profile=DeviceProfile.model_validate(profile_fields),
            state=AgentState.model_validate(state_fields),
        )
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise TxtRecordError(f"TXT record has a bad {where}: {err['msg']}") from exc


def _check_size(properties: Mapping[bytes, bytes | None] | Mapping[str, str | None]) -> None:
    """Refuse a record no agent sends: too many entries, one over 255 bytes, too big in all."""
    if len(properties) > MAX_TXT_ENTRIES:
        raise TxtRecordError(f"TXT record has {len(properties)} entries, over {MAX_TXT_ENTRIES}")
    total = 0
    for key, value in properties.items():
        size = _wire_len(key) + (0 if value is None else 1 + _wire_len(value))
        if size > MAX_ENTRY_BYTES:
            raise TxtRecordError(f"TXT entry of {size} bytes is over {MAX_ENTRY_BYTES}")
        total += 1 + size
    if total > MAX_RECORD_BYTES:
        raise TxtRecordError(f"TXT record of {total} bytes is over {MAX_RECORD_BYTES}")


def _wire_len(part: bytes | str) -> int:
    return len(part) if isinstance(part, bytes) else len(part.encode("utf-8", "surrogatepass"))


def _to_text(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _as_text(raw: bytes | str | None) -> str:
    if isinstance(raw, str):
        return raw
    try:
        return (raw or b"").decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TxtRecordError(f"TXT entry is not UTF-8: {raw!r}") from exc


def _parse_bool(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError("expected 0 or 1")
    return text == "1"


def _parse_int(text: str) -> int:
    if not text.isascii() or not text.isdigit():
        raise ValueError("expected a decimal integer")
    return int(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError("expected a finite number")
    return value


def _parse_list(text: str) -> list[str]:
    return [item for item in text.split(",") if item]


_PARSERS: Final[dict[str, Callable[[str], object]]] = {
    "protocol_version": _parse_int,
    "memory_bytes": _parse_int,
    "gflops": _parse_float,
    "memory_gbps": _parse_float,
    "cache_gbps": _parse_float,
    "cache_bytes": _parse_int,
    "op_us": _parse_float,
    "call_us": _parse_float,
    "topk_ns": _parse_float,
    "gemv_gflops": _parse_float,
    "vector_gflops": _parse_float,
    "int4_rows_exact": _parse_bool,
    "providers": _parse_list,
    "control_port": _parse_int,
    "data_port": _parse_int,
    "plan_version": _parse_int,
    "paired": _parse_bool,
}


def _from_text(field: str, text: str) -> object:
    parser = _PARSERS.get(field)
    if parser is None:
        return text
    try:
        return parser(text)
    except ValueError as exc:
        raise TxtRecordError(f"TXT value for {field} is malformed ({text[:40]!r}): {exc}") from exc
