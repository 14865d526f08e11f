"""Typed errors for everything that crosses a wire or a file boundary.

Every failure to decode or validate input raises one of these, never a bare
``ValueError``, ``IndexError`` or numpy error, so callers can catch one base
class and turn it into a clear reply::

    ProtocolError
    ├── FrameError                 activation frames (protocols.frames)
    │   ├── FrameTooLargeError     declared or actual size over the limit
    │   ├── TruncatedFrameError    fewer bytes than the header promises
    │   ├── MalformedFrameError    bad magic, bad header, trailing bytes
    │   └── TensorSpecError        dtype outside the whitelist, bad shape, byte-count mismatch
    ├── TxtRecordError             mDNS TXT records (protocols.txt)
    └── SchemaError                JSON documents: manifest, plan, problem, DEVICES.json
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Base class of every error raised by :mod:`protocols`."""


class FrameError(ProtocolError):
    """An activation frame could not be encoded or decoded."""


class FrameTooLargeError(FrameError):
    """A frame is, or declares itself, larger than the configured maximum."""


class TruncatedFrameError(FrameError):
    """A frame ended before the bytes its header promises."""


class MalformedFrameError(FrameError):
    """A frame's magic, header or layout is not what the codec writes."""


class TensorSpecError(FrameError):
    """A tensor's dtype, shape or byte count is not acceptable."""


class TxtRecordError(ProtocolError):
    """An mDNS TXT record is missing a key, has a malformed value or an entry over 255 bytes."""


class SchemaError(ProtocolError):
    """A JSON document does not follow its schema."""
