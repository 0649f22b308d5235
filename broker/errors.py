"""Errors the broker raises; each message says what was wrong and what to do."""

from __future__ import annotations

__all__ = ["BrokerError", "BrokerUnavailable", "ConfigurationError", "DecodeError"]


class BrokerError(Exception):
    """Base class of broker errors."""


class BrokerUnavailable(BrokerError):
    """The Redis/Valkey server cannot be reached; the message says how to start one."""


class ConfigurationError(BrokerError):
    """A destination, group or name is invalid or conflicts with what the server already holds."""


class DecodeError(BrokerError):
    """A stream entry is not a valid envelope (missing or malformed fields)."""
