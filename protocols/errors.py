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

An error that crosses the data plane travels as a :class:`WireErrorCode` in the frame header
(``kind="error"``, ``error_code``, ``error`` message), and one that crosses the control plane as
a :class:`ControlErrorCode` in an ``ErrorReply``; never as a Python class name. Each side keeps
one table between its own exceptions and these codes.
"""

from __future__ import annotations

from enum import StrEnum


class WireErrorCode(StrEnum):
    """Why an agent answered a data-plane request with an error frame."""

    REFUSED = "refused"
    """The request was refused (a field it may not set, an id already claimed or too long)."""
    INPUT_MISMATCH = "input_mismatch"
    """Tensor names, dtypes, ranks or fixed dimensions differ from the segment's inputs."""
    BAD_FRAME = "bad_frame"
    """The frame itself could not be decoded."""
    FRAME_TOO_LARGE = "frame_too_large"
    """The frame is, or declares itself, larger than the agent accepts."""
    TENSOR_SPEC = "tensor_spec"
    """A tensor's dtype, shape or byte count is not acceptable."""
    NO_SEGMENT = "no_segment"
    """The agent holds no segment for that plan version and index."""
    PEER_REJECTED = "peer_rejected"
    """The sender is not the peer this stage accepts frames from."""
    EXECUTION_FAILED = "execution_failed"
    """ONNX Runtime failed while running the segment."""
    SESSION_LIMIT = "session_limit"
    """No room for another session's state now: retry later."""
    SESSION_STATE = "session_state"
    """A step for an unknown session, or at the wrong position."""
    CONTEXT_LENGTH = "context_length"
    """A session would grow past the planned context length."""
    SHAPE_LIMIT = "shape_limit"
    """A tensor is larger than the shapes the deployment was planned for (batch, sequence)."""
    LINK_DOWN = "link_down"
    """A stage could not reach the next agent of the chain."""
    INTERNAL = "internal"
    """Anything else that went wrong on the agent."""


class ControlErrorCode(StrEnum):
    """Why an agent refused a control-plane request: the ``error`` of a
    :class:`protocols.deploy.ErrorReply` (its HTTP status says how bad; this says what)."""

    BAD_REQUEST = "bad_request"
    """The HTTP request or its JSON body could not be read (malformed, cut off, no length)."""
    TOO_LARGE = "too_large"
    """The request head or body is over the route's size limit (refused before it is read)."""
    TIMEOUT = "timeout"
    """The request head or body did not arrive in time."""
    NOT_FOUND = "not_found"
    """No such route."""
    PEER_REJECTED = "peer_rejected"
    """The caller's certificate has the wrong name or role for this route."""
    INTEGRITY = "integrity"
    """A segment's bytes do not hash to its manifest's SHA-256."""
    SIGNATURE = "signature"
    """The manifest's signature is missing, malformed or does not verify."""
    WRONG_TARGET = "wrong_target"
    """The manifest names another device, or its plan version is already loaded."""
    OVER_BUDGET = "over_budget"
    """The segment does not fit the agent's memory budget beside what it already holds."""
    STORAGE = "storage"
    """A training copy does not fit the agent's training storage."""
    SEGMENT_LOAD = "segment_load"
    """ONNX Runtime could not load the segment or run its warm-up."""
    REFUSED = "refused"
    """Any other refused deploy, unload or training request."""
    PAIRING = "pairing"
    """A pairing grant does not fit this agent."""
    ALREADY_PAIRED = "already_paired"
    """A pairing offer was asked of an agent that is already paired."""
    LINK_DOWN = "link_down"
    """The agent could not reach the device a probe named."""


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
