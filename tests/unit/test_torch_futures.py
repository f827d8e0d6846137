"""aggnet.torch.futures: client futures to the torch futures DDP waits on."""

import threading
from concurrent.futures import Future

import pytest
import torch

from aggnet.errors import AggregationTimeout, NonFiniteError
from aggnet.torch.futures import torch_future, when_all


def _context(exc: BaseException) -> BaseException:
    return type(exc)(f"bucket 3 on rank 1: {exc}")


def test_a_value_passes_through():
    client = Future()
    out = torch_future(client, lambda f: f.result() * 2, _context)
    assert not out.done()
    client.set_result(torch.ones(4))
    assert out.done()
    assert torch.equal(out.wait(), torch.full((4,), 2.0))


def test_a_client_error_surfaces_as_an_error_with_its_context():
    client, errors = Future(), []
    out = torch_future(client, lambda f: f.result(), _context, errors=errors)
    client.set_exception(AggregationTimeout("round 7 timed out"))
    assert out.done()
    with pytest.raises(RuntimeError, match=r"AggregationTimeout: bucket 3 on rank 1: round 7 timed out"):
        out.wait()
    # what a C++ consumer chained on the future (DDP's reducer) reads: an error, not a value
    chained = out.then(lambda f: f.value())
    with pytest.raises(RuntimeError, match=r"bucket 3 on rank 1: round 7 timed out"):
        chained.wait()
    [exc] = errors
    assert type(exc) is AggregationTimeout and str(exc) == "bucket 3 on rank 1: round 7 timed out"


def test_an_error_of_the_value_function_completes_the_future_too():
    client, errors = Future(), []

    def value(f):
        f.result()
        raise NonFiniteError("bucket 0 holds NaN")

    out = torch_future(client, value, errors=errors)
    client.set_result(None)
    assert out.done()
    with pytest.raises(RuntimeError, match=r"NonFiniteError: bucket 0 holds NaN"):
        out.wait()
    assert [str(e) for e in errors] == ["bucket 0 holds NaN"]


def test_the_value_function_may_turn_an_error_into_a_value():
    client = Future()
    nan = torch.full((2,), float("nan"))

    def value(f):
        try:
            return f.result()
        except NonFiniteError:
            return nan

    out = torch_future(client, value, _context)
    client.set_exception(NonFiniteError("another worker reported NaN"))
    assert out.wait() is nan


def test_a_failing_context_leaves_the_error_as_it_was():
    class Picky(Exception):
        def __init__(self, code, text):
            super().__init__(f"{code}: {text}")

    client = Future()
    out = torch_future(client, lambda f: f.result(), _context)  # Picky(text) fails
    client.set_exception(Picky(5, "refused"))
    assert out.done()
    with pytest.raises(RuntimeError, match=r"Picky: 5: refused"):
        out.wait()


def test_a_future_already_done_and_one_done_on_another_thread():
    done = Future()
    done.set_result(torch.zeros(1))
    assert torch.equal(torch_future(done, lambda f: f.result()).wait(), torch.zeros(1))

    later = Future()
    out = torch_future(later, lambda f: f.result())
    threading.Timer(0.05, later.set_result, (torch.ones(1),)).start()
    assert torch.equal(out.wait(), torch.ones(1))


def test_when_all_waits_for_every_one_and_never_fails():
    a, b, c = Future(), Future(), Future()
    all_done = when_all([a, b, c])
    b.set_exception(AggregationTimeout("b"))
    c.set_result(3)
    assert not all_done.done()  # b failed, but a may still be writing
    a.set_result(1)
    assert all_done.result(0) == [b, c, a]  # in the order they finished
    assert when_all([]).result(0) == []


def test_several_client_futures_through_one_torch_future():
    a, b, errors = Future(), Future(), []
    out = torch_future(when_all([a, b]), lambda f: [g.result() for g in f.result()], _context, errors=errors)
    a.set_exception(AggregationTimeout("a timed out"))
    assert not out.done()
    b.set_result(2)
    assert out.done()
    with pytest.raises(RuntimeError, match=r"bucket 3 on rank 1: a timed out"):
        out.wait()
    assert len(errors) == 1


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _ddp_backward(hook):
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    model.register_comm_hook(None, hook)
    model(torch.ones(3, 4)).sum().backward()
    return model


def test_ddp_gets_the_value_and_sees_the_error_as_an_error(one_rank_group):
    def halve(_state, bucket):
        client = Future()
        threading.Timer(0.01, client.set_result, (bucket.buffer(),)).start()
        return torch_future(client, lambda f: f.result().div_(2))

    model = _ddp_backward(halve)
    assert torch.allclose(model.module.bias.grad, torch.full((2,), 1.5))  # 3 rows, halved

    def failing(_state, bucket):
        client = Future()
        threading.Timer(0.01, client.set_exception, (AggregationTimeout("round 1 timed out"),)).start()
        return torch_future(client, lambda f: f.result(), _context)

    # DDP's C++ reducer raises it: a value in its place would fail otherwise, or be taken for gradients
    with pytest.raises(RuntimeError, match=r"AggregationTimeout: bucket 3 on rank 1: round 1 timed out"):
        _ddp_backward(failing)
