"""Errors a user of aggnet can meet; each message says what went wrong and
what to do about it."""

from __future__ import annotations


class AggnetError(RuntimeError):
    """Base of aggnet's runtime errors."""


class AggregatorUnreachable(AggnetError):
    """No aggregator answered at the configured address."""


class AggregationTimeout(AggnetError):
    """An all-reduce made no progress within the client's timeout."""


class AggregationError(AggnetError):
    """The aggregator rejected a request (the message says why)."""


class JobMismatch(AggregationError):
    """Workers of one job disagree (world size, buffer sizes, dtypes)."""


class NonFiniteError(AggnetError):
    """A buffer held NaN or Inf values that cannot be quantized."""


class ClientClosed(AggnetError):
    """The client was closed or failed earlier."""
