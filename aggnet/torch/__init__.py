"""aggnet for PyTorch: the pieces that plug aggnet into torch training.

* :mod:`aggnet.torch.hook` -- the DDP communication hook
  (``ddp_model.register_comm_hook(AggnetState(), allreduce_hook)``).

They share one configuration: the ``AGGNET_*`` environment variables, or
the same keyword arguments, read by :class:`aggnet.ClientConfig`.
"""

from .hook import AggnetState, allreduce_hook

__all__ = ["AggnetState", "allreduce_hook"]
