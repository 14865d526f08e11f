"""Errors raised by the coordinator::

CoordinatorError
├── StateError          the state dir is unreadable or inconsistent
└── PairingError        a pairing request or approval is refused
    ├── WrongCodeError  the typed code is not the device's code
    └── RevokedError    the device was revoked
"""

from __future__ import annotations


class CoordinatorError(Exception):
    """Base class of every error raised by :mod:`coordinator`."""


class StateError(CoordinatorError):
    """The coordinator's state dir cannot be read or written as expected."""


class PairingError(CoordinatorError):
    """A pairing request or approval is refused."""


class WrongCodeError(PairingError):
    """The pairing code typed by the operator does not match the device's key."""


class RevokedError(PairingError):
    """The device has been revoked and is refused everywhere."""
