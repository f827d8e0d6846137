"""aggnet: gradient aggregation for distributed deep learning as a network service.

Public API:

* :class:`Client` -- a worker's all-reduce through an aggregator service;
* :class:`ClientConfig` -- its settings (``ClientConfig.from_env()``);
* :func:`load_topology` -- racks, their aggregators and the root, from a
  topology file (:class:`Topology`; mistakes raise :class:`TopologyError`);
* :func:`shared_array` -- an array the aggregator on the same host reads
  where it lies (``shm://``), with no copy on the way in;
* :class:`SparseClient` -- sparse tables on the aggregator service (a
  parameter server: push and pull rows, optimizers on the service);
  :class:`HostGroup` -- the workers of one host, which combine their rows
  before the network;
* the errors a caller can meet (:mod:`aggnet.errors`);
* ``aggnet.torch`` -- the PyTorch pieces (needs torch): the DDP
  communication hook, the ``"aggnet"`` torch.distributed backend and
  ``ShardedEmbedding``.
"""

from aggnet.client.base import Client, ClientStats
from aggnet.client.config import ClientConfig
from aggnet.client.host_group import HostGroup
from aggnet.client.sparse import SparseClient
from aggnet.protocol.topology import Topology, TopologyError
from aggnet.transport.shm import shared_array
from aggnet.protocol.topology import load as load_topology
from aggnet.errors import (
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
    "HostGroup",
    "JobMismatch",
    "NonFiniteError",
    "SparseClient",
    "Topology",
    "TopologyError",
    "load_topology",
    "shared_array",
]
