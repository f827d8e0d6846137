import threading

import pytest

from harness.helpers import RunningService

def _ucxx_available() -> bool:
    try:
        import ucxx  # noqa: F401
    except Exception:
        return False
    return True


TRANSPORTS = ["inproc", "zmq+ipc", "zmq+tcp", "shm",
              pytest.param("ucx", marks=pytest.mark.skipif(not _ucxx_available(),
                                                           reason="ucxx is not installed (pip install aggnet[rdma])"))]


@pytest.fixture(params=TRANSPORTS)
def service(request):
    """An aggregator service with 2 shards on each transport."""
    svc = RunningService(request.param, shards=2)
    yield svc
    svc.stop()


@pytest.fixture
def service_factory():
    made = []

    def make(kind="zmq+ipc", shards=2):
        svc = RunningService(kind, shards)
        made.append(svc)
        return svc

    yield make
    for svc in made:
        svc.stop()


@pytest.fixture(autouse=True)
def no_leaked_clients():
    """A test that leaves a client's I/O thread running leaks its sockets."""
    yield
    leaked = [t.name for t in threading.enumerate() if t.name.startswith("aggnet-io-")]
    for _ in range(50):
        if not leaked:
            break
        threading.Event().wait(0.05)
        leaked = [t.name for t in threading.enumerate() if t.name.startswith("aggnet-io-")]
    assert not leaked, f"clients left open: {leaked}"
