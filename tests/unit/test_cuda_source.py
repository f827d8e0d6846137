"""The CUDA source of aggnet's device kernels builds, without a GPU.

CuPy compiles :data:`aggnet.kernels.cuda_source.VECTOR_SOURCE` with NVRTC
on first use, on a GPU. These tests compile the same text with NVRTC alone
(the ``nvidia-cuda-nvrtc-cu12`` wheel the dev extra installs, with the
``nvidia-cuda-runtime-cu12`` headers), for the architectures aggnet is
run on, and check that every kernel :mod:`aggnet.kernels.gpu` launches by
name is in what it built: a kernel that does not compile, or a launch of
a name that does not exist, fails here on any machine instead of first on
a GPU's.
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import sys
from pathlib import Path

import pytest

from aggnet.kernels.cuda_source import VECTOR_SOURCE


def _site_dirs() -> list[str]:
    return [p for p in sys.path if p and os.path.isdir(os.path.join(p, "nvidia"))]


def _find(patterns: list[str]) -> str | None:
    for base in _site_dirs() + ["/usr/local/cuda"]:
        for pattern in patterns:
            hits = sorted(glob.glob(os.path.join(base, pattern)))
            if hits:
                return hits[-1]
    return None


def _nvrtc():
    path = _find(["nvidia/cuda_nvrtc/lib/libnvrtc.so.*[0-9]", "nvidia/cu13/lib/libnvrtc.so.*[0-9]",
                  "lib64/libnvrtc.so"])
    include = _find(["nvidia/cuda_runtime/include", "nvidia/cu13/include", "include"])
    if path is None or include is None or not os.path.exists(os.path.join(include, "cuda_fp16.h")):
        pytest.skip("NVRTC or the CUDA headers are not installed (pip install nvidia-cuda-nvrtc-cu12 "
                    "nvidia-cuda-runtime-cu12; ./dev installs them)")
    return ctypes.CDLL(path), include


def compile_ptx(source: str, arch: str) -> tuple[bool, str, str]:
    """(built, NVRTC's log, the PTX) of ``source`` for ``arch``
    (``compute_90``), with what CuPy's RawModule leaves as NVRTC has it:
    its default C++ standard (C++17), no flushing of subnormals, no fast
    math."""
    lib, include = _nvrtc()
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"aggnet.cu", 0, None, None) == 0
    try:
        opts = [f"--gpu-architecture={arch}".encode(), f"-I{include}".encode()]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        ptx = ""
        if rc == 0:
            lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
            out = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetPTX(prog, out)
            ptx = out.value.decode()
        return rc == 0, log.value.decode(errors="replace"), ptx
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def launched_kernels() -> set[str]:
    """Every kernel name :mod:`aggnet.kernels.gpu` launches from the source."""
    text = (Path(__file__).parents[2] / "aggnet" / "kernels" / "gpu.py").read_text()
    return set(re.findall(r'(?:_launch|get_function)\(\s*"(\w+)"', text))


@pytest.mark.parametrize("arch", ["compute_70", "compute_80", "compute_90"])
def test_the_device_kernels_compile_and_hold_every_kernel_launched(arch):
    built, log, ptx = compile_ptx(VECTOR_SOURCE, arch)
    assert built, f"NVRTC could not build aggnet's kernels for {arch}:\n{log}"
    entries = set(re.findall(r"\.entry\s+(\w+)", ptx))
    names = launched_kernels()
    assert {"aggnet_quantize4", "aggnet_chunk_max_bits", "aggnet_quantize_chunks",
            "aggnet_dequantize_chunks", "aggnet_exponents_of_bits"} <= names
    assert names <= entries, f"launched but not built: {sorted(names - entries)}"


def test_the_check_fails_on_a_kernel_that_does_not_build():
    broken = VECTOR_SOURCE + '\nextern "C" __global__ void aggnet_broken(float* x) { x[0] = not_declared; }\n'
    built, log, _ = compile_ptx(broken, "compute_90")
    assert not built and "not_declared" in log
