"""Run BMv2 (simple_switch_grpc) on a set of interfaces.

The switch starts empty (``--no-p4``); the control plane then loads the
aggnet pipeline over P4Runtime. It can run in a namespace (the ToR of an
emulated rack, attached to the same port interfaces the Linux bridge would
use) or in this one (the differential tests' veth pairs).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import time

from aggnet.p4.tools import find_tool

log = logging.getLogger("aggnet.emulation")


def find_simple_switch_grpc() -> str | None:
    return find_tool("simple_switch_grpc")


class Bmv2Switch:
    def __init__(self, ports: dict[int, str], *, grpc_port: int = 9559, thrift_port: int = 9090,
                 netns: str | None = None, device_id: int = 0, log_file: str | None = None,
                 cpu_port: int | None = None):
        binary = find_simple_switch_grpc()
        if binary is None:
            from aggnet.emulation.netns import EmulationError

            raise EmulationError("simple_switch_grpc (BMv2 with P4Runtime, from p4lang/behavioral-model) is not on "
                                 "PATH: build it, or install a prebuilt bundle, and put its bin/ on PATH (docs/p4.md)")
        self.grpc_addr = f"127.0.0.1:{grpc_port}"
        self.thrift_port = thrift_port
        self.netns = netns
        cmd = [binary, "--no-p4", "--device-id", str(device_id), "--thrift-port", str(thrift_port)]
        for num, iface in sorted(ports.items()):
            cmd += ["-i", f"{num}@{iface}"]
        if log_file:
            cmd += ["--log-file", log_file, "--log-flush"]
        cmd += ["--", "--grpc-server-addr", f"127.0.0.1:{grpc_port}"]
        if cpu_port is not None:
            cmd += ["--cpu-port", str(cpu_port)]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        self.command = cmd
        self.process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self._wait_ready(30.0)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read()
                raise RuntimeError(f"simple_switch_grpc exited ({self.process.returncode}): {err.strip()[-1000:]}")
            if self._port_open():
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"simple_switch_grpc did not open {self.grpc_addr} within {timeout:g}s")

    def _port_open(self) -> bool:
        host, port = self.grpc_addr.rsplit(":", 1)
        probe = ["python3", "-c", f"import socket; socket.create_connection(('{host}', {port}), 0.5)"]
        if self.netns:
            r = subprocess.run(["ip", "netns", "exec", self.netns, *probe], capture_output=True)
            return r.returncode == 0
        try:
            socket.create_connection((host, int(port)), 0.5).close()
            return True
        except OSError:
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stderr:
            self.process.stderr.close()

    def __enter__(self) -> "Bmv2Switch":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def veth_pairs(names: list[str]) -> None:
    """Create veth pairs ``name`` <-> ``name + 'p'`` in this namespace, up,
    with IPv6 off so no router solicitation wanders through a test."""
    for n in names:
        subprocess.run(["ip", "link", "del", n], capture_output=True)
        _ip("link", "add", n, "type", "veth", "peer", "name", f"{n}p")
        for end in (n, f"{n}p"):
            _ip("link", "set", end, "mtu", "9000")
            with open(f"/proc/sys/net/ipv6/conf/{end}/disable_ipv6", "w") as f:
                f.write("1")
            _ip("link", "set", end, "up")


def delete_veths(names: list[str]) -> None:
    for n in names:
        subprocess.run(["ip", "link", "del", n], capture_output=True)


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {r.stderr.strip()}")


def can_run_bmv2() -> tuple[bool, str]:
    if find_simple_switch_grpc() is None:
        return False, "simple_switch_grpc (BMv2 with P4Runtime) is not installed"
    if os.geteuid() != 0:
        return False, "BMv2 on veth interfaces needs root"
    try:
        import p4runtime_sh  # noqa: F401
    except ImportError:
        return False, "p4runtime-shell is not installed (pip install 'aggnet[p4]')"
    return True, ""
