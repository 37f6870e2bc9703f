"""CPU stand-ins under which the real TokenSpeed 0.1.1 imports and builds its workspaces on a host with no GPU.

``tokenspeed_kernel`` refuses to import without a device, TokenSpeed's plugin
loader imports it, and ``ServerArgs`` (which ``ModelConfig`` needs) asks
``nvidia-smi`` for the GPU's memory. Four stand-ins, each the smallest that
gets past one refusal, none of them replacing TokenSpeed's code:

1. A ``libcuda.so.1`` whose driver calls answer "no device"
   (``libcuda_stub.c`` beside this file, compiled with the system ``cc``), so
   the shared objects that link the driver load, and torch still sees no GPU.
2. An SM100 (B200) platform record, given to ``Platform.override``
   (TokenSpeed's own test hook) before ``tokenspeed_kernel``'s package body
   runs, so its SM100 kernels register as on a B200.
3. A Triton driver that names SM100, set active on TokenSpeed's Triton, so
   the kernel modules that ask Triton for the target at import get one.
4. An ``nvidia-smi`` on ``PATH`` that answers the B200's memory in MiB.

They are process-wide and are never undone: only the session fixture in
tests/integrations/conftest.py installs them, in a process that runs the
TokenSpeed tests. On a host with a CUDA device none is needed or installed.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = [
    "LIBCUDA_STUB_SOURCE",
    "SM100_SM_COUNT",
    "build_libcuda_stub",
    "enter_tokenspeed_on_cpu",
    "sm100_platform",
]

#: The stand-in driver's C source.
LIBCUDA_STUB_SOURCE = Path(__file__).with_name("libcuda_stub.c")

#: Streaming multiprocessors of the B200 the platform record describes.
SM100_SM_COUNT = 148

_B200_MEMORY_BYTES = 191_514_607_616

#: What the ``nvidia-smi`` stand-in answers for ``--query-gpu=memory.total --format=csv,noheader,nounits``.
_NVIDIA_SMI = f"#!/bin/sh\necho {_B200_MEMORY_BYTES >> 20}\n"


def build_libcuda_stub(directory: Path) -> Path:
    """Compile :data:`LIBCUDA_STUB_SOURCE` into ``directory/libcuda.so.1`` with the system C compiler.

    Args:
        directory: Where the shared object is written.

    Returns:
        The shared object's path.

    Raises:
        RuntimeError: No ``cc`` is on ``PATH``, or it failed (its message is included).
    """
    compiler = shutil.which("cc")
    if compiler is None:
        raise RuntimeError("the libcuda.so.1 stand-in needs a C compiler: no `cc` on PATH")
    library = Path(directory) / "libcuda.so.1"
    command = [compiler, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(library), str(LIBCUDA_STUB_SOURCE)]
    built = subprocess.run(command, capture_output=True, text=True, check=False)
    if built.returncode != 0:
        raise RuntimeError(f"compiling the libcuda.so.1 stand-in failed: {built.stderr.strip()}")
    return library


def sm100_platform(platform: Any) -> Any:
    """A B200's ``PlatformInfo``, built from ``tokenspeed_kernel.platform`` (passed in as ``platform``).

    The SM features are those TokenSpeed derives for compute capability 10.0;
    the runtime features claim only CUDA graphs (one GPU, no NVLink).
    """
    arch = platform.ArchVersion(10, 0)
    return platform.PlatformInfo(
        vendor="nvidia",
        arch_version=arch,
        device_name="NVIDIA B200",
        device_count=1,
        total_memory=_B200_MEMORY_BYTES,
        memory_bandwidth=8000.0,
        sm_count=SM100_SM_COUNT,
        max_threads_per_sm=2048,
        max_shared_memory_per_sm=232_448,
        sm_features=frozenset(
            {"tensor_core:f16", "tensor_core:int8", "memory:async_copy", "tensor_core:f8"}
            | {"memory:tma", "compute:cluster", "tensor_core:f4"}
        ),
        runtime_features=frozenset({"runtime:cuda_graph"}),
        interconnect=platform.InterconnectInfo(topology="single_gpu"),
    )


def _sm100_triton_driver() -> Any:
    """An instance of a Triton driver whose target is CUDA SM100; it compiles and launches nothing."""
    import torch
    from tokenspeed_triton.backends.compiler import GPUTarget
    from tokenspeed_triton.backends.driver import DriverBase

    class Sm100Driver(DriverBase):  # type: ignore[misc]
        """Names CUDA SM100 (warp size 32) as the target; anything that would build or time a kernel refuses."""

        @classmethod
        def is_active(cls) -> bool:
            return False

        def get_current_target(self) -> Any:
            return GPUTarget("cuda", 100, 32)

        def get_active_torch_device(self) -> Any:
            return torch.device("cuda", 0)

        def map_python_to_cpp_type(self, ty: str) -> str:
            raise NotImplementedError("the SM100 stand-in driver builds no kernel")

        def get_benchmarker(self) -> Any:
            raise NotImplementedError("the SM100 stand-in driver times no kernel")

    return Sm100Driver()


def _import_kernel_package_on_sm100() -> Any:
    """Import ``tokenspeed_kernel`` with the SM100 record in place before its package body runs.

    The package body asks for the platform, and ``Platform.override`` lives in
    a submodule of that package: the package's module object is made first,
    its ``platform`` submodule imported into it and overridden, and only then
    is the package body executed, as the import system itself would run it.
    """
    spec = importlib.util.find_spec("tokenspeed_kernel")
    if spec is None or spec.loader is None:
        raise RuntimeError("tokenspeed_kernel is not installed")
    package = importlib.util.module_from_spec(spec)
    sys.modules["tokenspeed_kernel"] = package
    try:
        platform = importlib.import_module("tokenspeed_kernel.platform")
        platform.Platform.override(sm100_platform(platform))
        spec.loader.exec_module(package)
    except BaseException:
        for name in [name for name in sys.modules if name.split(".")[0] == "tokenspeed_kernel"]:
            del sys.modules[name]
        raise
    return package


def enter_tokenspeed_on_cpu(directory: Path) -> bool:
    """Install the three stand-ins in this process, in the order TokenSpeed's imports need them.

    Idempotent. Nothing is installed where torch sees a CUDA device.

    Args:
        directory: Where the ``libcuda.so.1`` stand-in is compiled and the
            ``nvidia-smi`` stand-in written; it is put first on ``PATH``.

    Returns:
        Whether the stand-ins are in place (False on a host with a CUDA device).

    Raises:
        RuntimeError: ``tokenspeed_kernel`` was imported before the stand-ins, or building one failed.
    """
    import torch

    if torch.cuda.is_available():
        return False
    kernel = sys.modules.get("tokenspeed_kernel")
    if kernel is not None:
        platform = sys.modules["tokenspeed_kernel.platform"].Platform.get()
        if platform.arch_version.major != 10:
            raise RuntimeError("tokenspeed_kernel was imported before the CPU stand-ins were installed")
        return True
    ctypes.CDLL(str(build_libcuda_stub(directory)), mode=ctypes.RTLD_GLOBAL)
    nvidia_smi = Path(directory) / "nvidia-smi"
    nvidia_smi.write_text(_NVIDIA_SMI)
    nvidia_smi.chmod(0o755)
    os.environ["PATH"] = f"{directory}{os.pathsep}{os.environ.get('PATH', '')}"
    import tokenspeed_triton

    tokenspeed_triton.runtime.driver.set_active(_sm100_triton_driver())
    _import_kernel_package_on_sm100()
    return True
