"""What a forkserver of training workers imports before it forks them
(``ctx.set_forkserver_preload([..., "aggnet.torch.warm"])``), so that
each worker starts with it instead of paying for it again:

* ``torch._dynamo``: DistributedDataParallel's constructor imports it,
  about 2 CPU-seconds in every worker;
* numba's code generator, set up at aggnet's first kernel call, about
  0.7 (:mod:`aggnet.kernels.warm`).
"""

from __future__ import annotations

import torch._dynamo  # noqa: F401

from aggnet.kernels.warm import warm_up

warm_up()
