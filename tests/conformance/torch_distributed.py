"""PyTorch's own distributed test suite (``DistributedTest``, shipped with
torch) run through the aggnet backend: every test gloo runs, with every
process group created as ``aggnet`` instead.

The suite's decorators choose tests by backend name, so it runs under
``BACKEND=gloo`` and ``init_process_group`` is redirected: a test gloo runs
is run, and what it checks goes through aggnet (its all-reduces and
reduce-scatters; the rest through the backend's gloo group). Run by
``./dev torch-suite``, once as it is (gloo) and once redirected, which
compares the two (``compare.py``); not part of ``./dev test`` (a quarter of
an hour a run on two cores)."""

from __future__ import annotations

import os
import tempfile

os.environ["BACKEND"] = "gloo"
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="aggnet-torch-suite-"))

import torch.distributed as dist  # noqa: E402
import torch.distributed.distributed_c10d as c10d  # noqa: E402

if os.environ.get("AGGNET_CONFORMANCE_BACKEND", "aggnet") == "aggnet":
    import aggnet.torch  # noqa: E402,F401  (registers the backend)

    _init_process_group = c10d.init_process_group

    def _through_aggnet(backend=None, *args, **kwargs):
        if backend in (None, "gloo", dist.Backend.GLOO):
            backend = "aggnet"
        return _init_process_group(backend, *args, **kwargs)

    c10d.init_process_group = dist.init_process_group = _through_aggnet

from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    run_tests()
