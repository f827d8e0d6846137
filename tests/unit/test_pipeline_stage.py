"""A pipeline stage's passes in one process: ``sync`` is single-process
training cut into stages, the asynchronous modes are not, and the weight
prediction is the paper's formula."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="pipelining needs PyTorch (pip install aggnet[torch])")

import torch.nn as nn  # noqa: E402
from harness import pipeline_workers as W  # noqa: E402

from aggnet.pipeline import Stage, WeightPredictor, emulate  # noqa: E402

STEPS = 30


def _single_process(steps: int) -> list:
    model = W.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=W.LR, momentum=0.9, dampening=0.9)
    for x, y in W.batches(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().numpy() for p in model.parameters()]


def _flat(weights) -> list:
    return [w for row in weights for w in row[0]]


@pytest.mark.parametrize("stages", [2, 4])
def test_sync_mode_is_single_process_training_bit_for_bit(stages):
    got, _ = W.emulated(stages, "sync", STEPS)
    for a, b in zip(_flat(got), _single_process(STEPS), strict=True):
        assert (a == b).all()


@pytest.mark.parametrize("mode", ["vanilla", "stash", "spectrain"])
def test_asynchronous_modes_train_on_stale_or_predicted_weights(mode):
    # the same batches, a different trajectory: the staleness is real
    got, _ = W.emulated(4, mode, STEPS)
    ref = _single_process(STEPS)
    assert any(not (a == b).all() for a, b in zip(_flat(got), ref))


def test_spectrain_with_no_version_difference_is_vanilla():
    def run(mode, versions):
        stages = []
        for k in range(2):
            st = W.make_stage(k, 2, mode)
            if versions is not None:
                st.versions = versions
            stages.append(st)
        emulate(stages, W.batches(STEPS))
        return [p.detach().clone() for s in stages for p in s.params]

    for a, b in zip(run("spectrain", (0, 0)), run("vanilla", None), strict=True):
        assert torch.equal(a, b)


def test_momentum_sgd_prediction_is_the_papers_formula():
    p = nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    opt = torch.optim.SGD([p], lr=0.5, momentum=0.9, dampening=0.9)
    pred = WeightPredictor([p], opt)
    assert pred.from_momentum
    assert torch.equal(pred.predicted(3)[0], p.detach())  # nothing to go on before a step
    for g in ([1.0, 0.0, -1.0], [2.0, 1.0, 0.5]):
        p.grad = torch.tensor(g)
        pred.before_step()
        opt.step()
        pred.after_step()
    v = opt.state[p]["momentum_buffer"]
    assert torch.allclose(pred.predicted(3)[0], p.detach() - 3 * 0.5 * v)
    # a step whose gradient equals the smoothed one moves exactly as predicted
    ahead = pred.predicted(1)[0]
    p.grad = v.clone()
    opt.step()
    assert torch.allclose(p.detach(), ahead)


def test_other_optimizers_extrapolate_their_last_step():
    p = nn.Parameter(torch.tensor([0.5, 1.5]))
    opt = torch.optim.Adam([p], lr=0.1)
    pred = WeightPredictor([p], opt)
    assert not pred.from_momentum
    p.grad = torch.tensor([1.0, -1.0])
    before = p.detach().clone()
    pred.before_step()
    opt.step()
    pred.after_step()
    step = p.detach() - before
    assert torch.allclose(pred.predicted(2)[0], p.detach() + 2 * step)


def test_predictions_never_alias_the_weights():
    # the optimizer updates weights in place while a batch's graph holds
    # the tensors its forward ran at
    st = W.make_stage(0, 2, "spectrain")
    for w, p in zip(st.predictor.predicted(0), st.params):
        assert w.data_ptr() != p.data_ptr()


def test_stage_misuse_is_named():
    st = W.make_stage(0, 2, "stash")
    with pytest.raises(RuntimeError, match="backward of batch 3 before its forward"):
        st.backward(3)
    x, _ = W.batches(1)[0]
    st.forward(0, x)
    with pytest.raises(RuntimeError, match="batch 0 ran its forward twice"):
        st.forward(0, x)
    module = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="last stage needs loss_fn"):
        Stage(module, torch.optim.SGD(module.parameters(), lr=0.1), index=1, stages=2)
    with pytest.raises(ValueError, match="backward must be one of"):
        Stage(module, torch.optim.SGD(module.parameters(), lr=0.1), index=0, stages=2, backward="later")
    other = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="not updated by the optimizer"):
        WeightPredictor(list(module.parameters()), torch.optim.SGD(other.parameters(), lr=0.1))
