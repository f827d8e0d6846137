"""Ray Train through aggnet: ``TorchTrainer(..., torch_config=
AggnetTorchConfig(aggregators=aggs))``.

Ray Train sets up ``torch.distributed`` in each worker before the training
loop runs, by backend name. This config makes that name ``"aggnet"`` and,
before the process groups are made, registers the backend in every worker
and hands each one the topology of the aggregators as they run now: its
rack is the ``aggnet.io/rack`` label of the node Ray placed it on. Without
``aggregators`` the workers use ``AGGNET_ADDRESS`` (or, on one machine,
the embedded aggregator rank 0 starts).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from aggnet.ray.actors import require_ray
from aggnet.ray.placement import RACK_LABEL

require_ray()
from ray.train.torch import TorchConfig  # noqa: E402
from ray.train.torch.config import _TorchBackend  # noqa: E402


def _node_rack() -> str | None:
    import ray

    return ray.get_runtime_context().get_node_labels().get(RACK_LABEL)


def _prepare_worker(topology_text: str | None, env: dict) -> None:
    import tempfile

    import aggnet.torch  # noqa: F401  (registers the "aggnet" backend)

    os.environ.update({k: str(v) for k, v in env.items()})
    if topology_text is not None:
        # one file per worker process, rewritten when Ray Train restarts it
        path = os.path.join(tempfile.gettempdir(), f"aggnet-ray-topology-{os.getpid()}.toml")
        with open(path, "w", encoding="utf-8") as f:
            f.write(topology_text)
        os.environ["AGGNET_TOPOLOGY"] = path
        os.environ.pop("AGGNET_ADDRESS", None)


class _AggnetBackend(_TorchBackend):
    def on_start(self, worker_group, backend_config: "AggnetTorchConfig"):
        text = None
        if backend_config.aggregators is not None:
            racks = worker_group.execute(_node_rack)
            text = backend_config.aggregators.worker_topology(racks)
        worker_group.execute(_prepare_worker, text, dict(backend_config.env))
        super().on_start(worker_group, backend_config)


@dataclass
class AggnetTorchConfig(TorchConfig):
    """``TorchConfig`` with the aggnet backend.

    ``aggregators``: :class:`aggnet.ray.Aggregators` to train through;
    ``env``: ``AGGNET_*`` settings for every worker (``{"AGGNET_CODEC":
    "int32"}``)."""

    backend: str | None = "aggnet"
    aggregators: object = None
    env: dict = field(default_factory=dict)

    @property
    def backend_cls(self):
        return _AggnetBackend


__all__ = ["AggnetTorchConfig"]
