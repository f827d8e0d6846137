"""aggnet for PyTorch: the pieces that plug aggnet into torch training.

* :mod:`aggnet.torch.hook` -- the DDP communication hook
  (``ddp_model.register_comm_hook(AggnetState(), allreduce_hook)``);
* :mod:`aggnet.torch.backend` -- aggnet as a ``torch.distributed`` backend
  (``dist.init_process_group("aggnet")``, or :func:`init_process_group`
  before Accelerate or the HF Trainer): DDP without a hook, FSDP2's
  reduce-scatters and ``dist.all_reduce`` go through aggnet;
* :mod:`aggnet.torch.stale` -- stale-gradient data parallelism
  (``AggnetState(staleness=1, predict=True)`` and :class:`StaleStep`):
  the all-reduce hides behind the next step's compute;
* :mod:`aggnet.torch.sparse` -- sparse parameters on the service's sparse
  tables: the hook's sparse buckets (all-reduce mode) and
  :class:`ShardedEmbedding` (the table and its optimizer on the service);
* :mod:`aggnet.torch.teardown` -- :func:`ends_process_group`, for worker
  functions that train with DDP over gloo: the group is destroyed after
  the models are gone (the other order can hang at exit).

They share one configuration: the ``AGGNET_*`` environment variables, or
the same keyword arguments, read by :class:`aggnet.ClientConfig`.
Importing this package registers the ``"aggnet"`` backend with
torch.distributed and does nothing else (docs/torch.md says which piece
to pick when).
"""

from aggnet.torch import backend
from aggnet.torch.backend import init_process_group
from aggnet.torch.hook import AggnetState, allreduce_hook
from aggnet.torch.sparse import ShardedEmbedding
from aggnet.torch.stale import StaleStep
from aggnet.torch.teardown import ends_process_group

backend.register()

__all__ = ["AggnetState", "allreduce_hook", "ShardedEmbedding", "StaleStep", "ends_process_group", "init_process_group"]
