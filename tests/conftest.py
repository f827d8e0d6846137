import os
import tempfile
import threading

import pytest

# Under pytest-xdist each worker process gets a temporary directory of its
# own, before anything aggnet's is imported: embedded aggregators, job keys
# and benchmark run directories live there, keyed by job name, and two
# tests on two workers may use the same name. Children inherit it.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER:
    os.environ["TMPDIR"] = f"/tmp/agt-{_WORKER}"
    os.makedirs(os.environ["TMPDIR"], exist_ok=True)
    tempfile.tempdir = None

# Every process that imports numpy starts OpenBLAS's threads, which spin
# for about 0.1 CPU-seconds before they sleep (measured: `import numpy`
# alone, 0.20 against 0.09 CPU-seconds). Nothing under test multiplies
# matrices with numpy, and the suite starts hundreds of Python processes.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from harness.helpers import RunningService  # noqa: E402


def pytest_configure(config):
    path = os.environ.get("AGGNET_TEST_CPU")
    if path:  # CPU-seconds per test, where a cgroup can count them (harness/cpu_report.py)
        from harness.cpu_report import CpuReport

        config.pluginmanager.register(CpuReport(config, os.path.abspath(path)), "aggnet-cpu-report")


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups
def pytest_collection_modifyitems(config, items):
    """The system tests (namespaces with fixed names, BMv2 on fixed ports,
    Mininet, which cleans up every Mininet run on the machine) run one at a
    time, on one xdist worker; the rest spread over the others."""
    for item in items:
        if f"{os.sep}system{os.sep}" in str(item.fspath):
            item.add_marker(pytest.mark.xdist_group("system"))


def _ucxx_available() -> bool:
    try:
        import ucxx  # noqa: F401
    except Exception:
        return False
    return True


TRANSPORTS = ["inproc", "zmq+ipc", "zmq+tcp", "tcp", "shm",
              pytest.param("ucx", marks=pytest.mark.skipif(not _ucxx_available(),
                                                           reason="ucxx is not installed (pip install aggnet[rdma])"))]


@pytest.fixture(scope="session", autouse=True)
def _fork_server():
    """Name what the training workers' fork server imports before any test
    can start it: a benchmark run in-process asks for less, and a server
    started with that alone would leave every later worker to import torch
    itself."""
    from harness.helpers import _fresh_process_context

    _fresh_process_context()


@pytest.fixture(scope="session")
def _services():
    """One service per transport for this pytest process: starting one costs
    about two seconds, and over a hundred tests ask for one. Tests keep apart
    by job name and read counters as increments (``service.new_counts()``)."""
    running: dict[str, RunningService] = {}
    yield running
    for svc in running.values():
        svc.stop()


def _pooled(services: dict, kind: str, shards: int) -> RunningService:
    key = kind if shards == 2 else f"{kind}/{shards}"
    svc = services.get(key)
    if svc is None or not svc.alive():
        if svc is not None:
            svc.stop()
        svc = services[key] = RunningService(kind, shards)
    svc.mark_counts()
    return svc


@pytest.fixture(params=TRANSPORTS)
def service(request, _services):
    """An aggregator service with 2 shards on each transport, shared by the
    tests of this process (one that a test left dead is started again)."""
    return _pooled(_services, request.param, 2)


@pytest.fixture
def shared_service(_services):
    """``shared_service(kind, shards)``: a service shared by the tests of
    this process that do not stop it, its counters marked for the caller."""
    return lambda kind="zmq+ipc", shards=2: _pooled(_services, kind, shards)


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
