"""DDP workers end their process group after their models: forked from a
server that imported torch._dynamo, three-rank gloo runs that destroyed
the group first hung at exit in about one teardown in five (gloo's
worker waiting for the GIL that the reducer's deallocation held while it
joined that worker)."""

from __future__ import annotations

import gc
import weakref

import pytest

torch = pytest.importorskip("torch")

from harness import ddp_workers as W  # noqa: E402
from harness.helpers import free_port, run_workers  # noqa: E402

RUNS = 10


def test_three_rank_gloo_ddp_runs_from_the_fork_server_all_end():
    # each run ends within the harness's limit or the test fails naming the rank
    for _ in range(RUNS):
        results = run_workers("spawn://", 3, W.ddp_run, 3, free_port(), "gloo", {"steps": 3}, timeout=60,
                              start_method="spawn")
        assert len(results) == 3


_made: list = []


def _train_then_fail():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    ddp = DDP(torch.nn.Linear(4, 2))
    ddp(torch.ones(3, 4)).sum().backward()
    _made.append(weakref.ref(ddp))
    raise RuntimeError("training failed")


def test_a_failing_worker_has_its_models_released_and_its_group_destroyed():
    import torch.distributed as dist

    from aggnet.torch import ends_process_group

    gc.collect()
    with pytest.raises(RuntimeError, match="training failed") as info:
        ends_process_group(_train_then_fail)()
    # the error still holds the traceback, yet the model is gone: the group
    # was destroyed after it, not under it
    assert info.value.__traceback__ is not None
    assert _made[-1]() is None
    assert not dist.is_initialized()
