"""A worker's shared buffers (transport/shm.py): found by the address of
any array inside them, and opened by a shard only when they are what
they claim to be, since the shard writes results into what it opens."""

from __future__ import annotations

import os

import numpy as np
import pytest

from aggnet.transport import shm


def test_an_array_inside_a_shared_buffer_is_found_with_its_offset():
    raw = shm.shared_bytes(4096)
    name, size, at = shm.find_shared(raw[100:300])
    assert name.startswith(shm.SHARED_PREFIX) and size == 4096 and at == 100
    assert shm.find_shared(raw.view(np.float32)[8:16]) == (name, size, 32)
    assert shm.find_shared(np.zeros(10)) is None
    assert shm.find_shared(raw[:0]) is None  # nothing to read


def test_a_shard_maps_the_buffer_and_sees_the_worker_s_writes():
    raw = shm.shared_bytes(1 << 16)
    name, size, _ = shm.find_shared(raw)
    mapped = shm.SharedBuffer.open(name, size)
    raw[:4] = [1, 2, 3, 4]
    mapped.array[4:8] = [5, 6, 7, 8]  # a result written back
    assert list(mapped.array[:4]) == [1, 2, 3, 4] and list(raw[4:8]) == [5, 6, 7, 8]
    mapped.close()


def test_a_link_a_foreign_name_or_a_short_file_is_refused():
    link = os.path.join(shm.SHM_DIR, "aggnet-buf-1-1-0badf00d")
    os.symlink("/etc/hostname", link)
    try:
        with pytest.raises(OSError, match="symbolic link"):
            shm.SharedBuffer.open("aggnet-buf-1-1-0badf00d", 4)
    finally:
        os.unlink(link)
    with pytest.raises(ValueError, match="not the name of an aggnet shared buffer"):
        shm.SharedBuffer.open("../etc/passwd", 4)
    raw = shm.shared_bytes(64)
    name = shm.find_shared(raw)[0]
    with pytest.raises(ValueError, match="smaller than"):
        shm.SharedBuffer.open(name, 65)
    with pytest.raises(OSError, match="cannot open"):
        shm.SharedBuffer.open("aggnet-buf-1-2-00000000", 4)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_another_user_s_buffer_is_refused():
    raw = shm.shared_bytes(64)
    name = shm.find_shared(raw)[0]
    os.chown(os.path.join(shm.SHM_DIR, name), 54321, -1)
    with pytest.raises(ValueError, match="belongs to uid 54321"):
        shm.SharedBuffer.open(name, 64)


def test_a_forked_child_letting_go_of_its_copy_keeps_the_segment():
    """A process forked after the buffer was made (a DataLoader worker)
    inherits the mapping; when it lets go, the segment stays for the parent."""
    import gc

    raw = shm.shared_bytes(128)
    path = os.path.join(shm.SHM_DIR, shm.find_shared(raw)[0])
    pid = os.fork()
    if pid == 0:  # the child: drop its copy, collect, and leave without running atexit
        del raw
        gc.collect()
        os._exit(0 if not os.path.exists(path) else 3)  # 3: the segment survived, as it must
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 3
    assert os.path.exists(path)
    del raw
    gc.collect()
    assert not os.path.exists(path)
