"""The CPU stand-ins (tests/helpers/tokenspeed_cpu.py) under which the real TokenSpeed 0.1.1 runs without a GPU.

Run inside TokenSpeed's environment (``.ci/engine-envs tokenspeed``):

    .venv-tokenspeed/bin/python -m pytest -q tests/integrations/test_tokenspeed_stand_ins.py
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.tokenspeed_cpu import SM100_SM_COUNT

CUDA_ERROR_NO_DEVICE = 100
DRIVER_SYMBOL = re.compile(r"^cu[A-Z]\w*$")


@pytest.fixture
def stand_ins(tokenspeed_on_cpu: bool) -> None:
    """The stand-ins are in place; skips on a host with a CUDA device, where none is installed."""
    if not tokenspeed_on_cpu:
        pytest.skip("a CUDA device is present here: TokenSpeed runs on it and no stand-in is installed")


def _linked_driver_symbols(site_packages: Path) -> set[str]:
    """Every ``cu*`` symbol that a shared object under ``site_packages`` imports from a ``libcuda.so.1`` it names."""
    symbols: set[str] = set()
    for library in site_packages.rglob("*.so*"):
        if not library.is_file():
            continue
        dynamic = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True, check=False)
        if "[libcuda.so.1]" not in dynamic.stdout:
            continue
        undefined = subprocess.run(
            ["nm", "-D", "--undefined-only", str(library)], capture_output=True, text=True, check=True
        )
        # Driver entry points are cu + a capital (cuInit); cublas*, cudnn* and versioned names are other libraries'.
        symbols |= {
            name for name in (line.split()[-1] for line in undefined.stdout.splitlines()) if DRIVER_SYMBOL.match(name)
        }
    return symbols


def test_the_driver_stand_in_answers_no_device(stand_ins: None) -> None:
    """libcuda.so.1 resolves to the stand-in: cuInit answers CUDA_ERROR_NO_DEVICE and torch sees no GPU."""
    driver = ctypes.CDLL("libcuda.so.1")
    version = ctypes.c_int(0)
    assert driver.cuInit(0) == CUDA_ERROR_NO_DEVICE
    assert driver.cuDeviceGetCount(ctypes.byref(ctypes.c_int(0))) == CUDA_ERROR_NO_DEVICE
    assert driver.cuDriverGetVersion(ctypes.byref(version)) == 0
    assert version.value == 13000
    assert not torch.cuda.is_available()


def test_the_driver_stand_in_exports_what_the_environment_links(stand_ins: None) -> None:
    """Every driver symbol a shared object of this environment imports from libcuda.so.1 is defined by the stand-in."""
    if shutil.which("readelf") is None or shutil.which("nm") is None:
        pytest.skip("readelf and nm (binutils) are needed to read the shared objects' symbols")
    site_packages = Path(torch.__file__).parents[1]
    linked = _linked_driver_symbols(site_packages)
    assert {"cuInit", "cuLaunchKernel", "cuMemCreate", "cuTensorMapEncodeTiled"} <= linked
    stub = ctypes.CDLL("libcuda.so.1")
    missing = sorted(name for name in linked if not hasattr(stub, name))
    assert missing == []


def test_the_kernel_package_sees_a_b200(stand_ins: None) -> None:
    """tokenspeed_kernel runs on the SM100 record, so its Blackwell-only kernels register as on a B200."""
    from tokenspeed_kernel.platform import ArchVersion, current_platform
    from tokenspeed_kernel.registry import KernelRegistry, load_builtin_kernels

    platform = current_platform()
    assert (platform.vendor, platform.arch_version, platform.sm_count) == ("nvidia", ArchVersion(10, 0), SM100_SM_COUNT)
    assert platform.is_blackwell
    load_builtin_kernels()
    registry = KernelRegistry.get()
    for name in ("flashinfer_trtllm_mha_decode_with_kvcache", "tokenspeed_mla_decode_with_kvcache"):
        assert registry.get_by_name(name) is not None, name


def test_triton_names_sm100_and_builds_nothing(stand_ins: None) -> None:
    """TokenSpeed's Triton reports a CUDA SM100 target; the stand-in driver refuses to build a kernel."""
    import tokenspeed_triton
    from tokenspeed_triton.backends.compiler import GPUTarget

    driver = tokenspeed_triton.runtime.driver.active
    assert driver.get_current_target() == GPUTarget("cuda", 100, 32)
    with pytest.raises(NotImplementedError, match="builds no kernel"):
        driver.map_python_to_cpp_type("i32")


def test_server_arguments_read_the_b200_memory(stand_ins: None) -> None:
    """TokenSpeed's nvidia-smi query answers the B200's memory in MiB, so ServerArgs can be built."""
    from tokenspeed.runtime.utils.common import get_nvgpu_memory_capacity

    assert get_nvgpu_memory_capacity() == 182642.0


def test_the_kernel_package_imports_only_behind_the_stand_ins(stand_ins: None) -> None:
    """Without the stand-ins tokenspeed_kernel refuses to import on this host, which is why they exist."""
    script = "import tokenspeed_kernel"
    refused = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=300)
    assert refused.returncode != 0
    assert "libcuda.so.1" in refused.stderr or "requires an NVIDIA CUDA" in refused.stderr
