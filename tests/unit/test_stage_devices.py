"""Where a pipeline stage runs: the device its layers are on, or the one
given; a model spread over devices is refused in one line."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="stages need PyTorch (pip install aggnet[torch])")
nn = torch.nn

from aggnet.parallel.hybrid import HostBoundary, _device_of  # noqa: E402
from aggnet.pipeline import Stage  # noqa: E402


def test_a_stage_runs_where_its_layers_are_unless_told_otherwise():
    on_meta = nn.Sequential(nn.Linear(3, 4), nn.Tanh()).to("meta")
    assert _device_of(on_meta, None) == torch.device("meta")
    assert _device_of(on_meta, "cpu") == torch.device("cpu")
    # no parameters at all: the default given
    assert _device_of(nn.Tanh(), None, torch.device("meta")) == torch.device("meta")
    stage = Stage(on_meta, torch.optim.SGD(on_meta.parameters(), lr=0.1), index=0, stages=2, mode="sync")
    assert stage.device == torch.device("meta")


def test_a_model_spread_over_devices_is_refused_naming_them():
    spread = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2).to("meta"))
    with pytest.raises(ValueError, match=r"\['cpu', 'meta'\].*device="):
        _device_of(spread, None)


def test_the_host_boundary_hands_back_host_tensors_and_their_gradients():
    layer = nn.Linear(3, 2)
    x = torch.randn(5, 3, requires_grad=True)
    for keep in (False, True):
        out = HostBoundary(layer, torch.device("cpu"), keep_output=keep)(x)
        out.sum().backward()
        assert out.device.type == "cpu" and x.grad.shape == x.shape
        torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(5, 3))
        x.grad = None


def test_the_host_boundary_runs_the_stage_on_its_device():
    # "meta" stands in for a GPU: the host input must reach the stage's
    # device, and the last stage's output stay there for the loss
    on_meta = nn.Linear(3, 2).to("meta")
    out = HostBoundary(on_meta, torch.device("meta"), keep_output=True)(torch.randn(5, 3))
    assert out.device.type == "meta" and out.shape == (5, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_a_layer_on_the_gpu_is_timed_for_its_kernels_not_their_queueing():
    from aggnet.parallel import profile

    # forward and backward of a 4096-square layer on 4096 samples: 3 x 2 x
    # 4096^3 = 4.1e11 operations, over 4 ms even at 100 TFLOPS, where
    # queueing the kernels takes tens of microseconds
    layer = nn.Sequential(nn.Linear(4096, 4096)).cuda()
    prof = profile(layer, torch.randn(4096, 4096, device="cuda"), reps=3)
    assert prof.device.startswith("cuda")
    assert prof.layers[0].seconds_per_sample * 4096 > 4e-3, prof.layers[0]
