"""aggnet: gradient aggregation for distributed deep learning as a network service.

Public API:

* :class:`Client` -- a worker's all-reduce through an aggregator service;
* :class:`ClientConfig` -- its settings (``ClientConfig.from_env()``);
* the errors a caller can meet (:mod:`aggnet.errors`);
* ``aggnet.torch`` -- the PyTorch DDP communication hook (needs torch).
"""

from .client import Client, ClientStats
from .config import ClientConfig
from .errors import (
    AggnetError,
    AggregationError,
    AggregationTimeout,
    AggregatorUnreachable,
    ClientClosed,
    JobMismatch,
    NonFiniteError,
)

__version__ = "0.1.0"

__all__ = [
    "AggnetError",
    "AggregationError",
    "AggregationTimeout",
    "AggregatorUnreachable",
    "Client",
    "ClientClosed",
    "ClientConfig",
    "ClientStats",
    "JobMismatch",
    "NonFiniteError",
]
