"""./dev picks the torch build by the machine: the CPU build where no
NVIDIA GPU is present (from PyTorch's CPU index when it answers), the CUDA
build where one is, and AGGNET_TORCH overrides both."""

import os
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _choice(tmp_path, gpu: bool, **env) -> list[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    # what nvidia-smi -L prints with a GPU, and how it fails without a driver
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n" if gpu else
                   "#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the "
                   "NVIDIA driver.'\nexit 9\n")
    smi.chmod(0o755)
    full = {k: v for k, v in os.environ.items() if k != "AGGNET_TORCH"}
    full.update(PATH=f"{bin_dir}:{os.environ['PATH']}", **env)
    r = subprocess.run(["bash", str(ROOT / "dev"), "torch-choice"], capture_output=True, text=True, env=full,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()


def test_a_gpu_machine_gets_the_cuda_build(tmp_path):
    why, args = _choice(tmp_path, gpu=True)
    assert why.startswith("cuda") and args == "torch==2.13.0"


def test_a_machine_without_a_gpu_gets_the_cpu_build_from_the_cpu_index(tmp_path):
    index = tmp_path / "cpu-index"
    index.mkdir()
    why, args = _choice(tmp_path, gpu=False, AGGNET_TORCH_CPU_INDEX=index.as_uri())
    assert why.startswith("cpu") and args == f"torch==2.13.0 --index-url {index.as_uri()}"


def test_without_the_cpu_index_the_configured_indexes_serve_and_it_says_so(tmp_path):
    why, args = _choice(tmp_path, gpu=False, AGGNET_TORCH_CPU_INDEX=(tmp_path / "absent").as_uri())
    assert why.startswith("cpu") and "does not answer" in why and args == "torch==2.13.0"


def test_aggnet_torch_overrides_the_machine(tmp_path):
    index = tmp_path / "cpu-index"
    index.mkdir()
    why, _ = _choice(tmp_path, gpu=True, AGGNET_TORCH="cpu", AGGNET_TORCH_CPU_INDEX=index.as_uri())
    assert why.startswith("cpu")
    why, _ = _choice(tmp_path, gpu=False, AGGNET_TORCH="cuda")
    assert why.startswith("cuda")
    r = subprocess.run(["bash", str(ROOT / "dev"), "torch-choice"], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, AGGNET_TORCH="rocm"))
    assert r.returncode == 2 and "AGGNET_TORCH must be cpu, cuda or auto" in r.stderr
