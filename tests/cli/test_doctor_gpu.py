"""GPU tests for wspool.cli.doctor: each CUDA device and its profile, and no CUDA context made."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_doctor_lists_every_cuda_device_with_its_profile_and_makes_no_context() -> None:
    """On a GPU machine doctor names each device and its profile, and no device has a CUDA context after it."""
    code = (
        "import json, torch\n"
        "from wspool.cli.doctor import diagnose\n"
        "report = diagnose()\n"
        "contexts = [torch._C._cuda_hasPrimaryContext(i) for i in range(torch.cuda.device_count())]\n"
        "print(json.dumps({'report': report, 'contexts': contexts}))\n"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WSPOOL_")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    report = result["report"]
    assert report["torch"]["cuda_available"] is True
    devices = report["devices"]
    assert [d["device"] for d in devices] == [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    for index, device in enumerate(devices):
        major, _ = torch.cuda.get_device_capability(index)
        assert device["profile"] == {9: "hopper", 10: "blackwell"}.get(major, "fixed"), device
    assert result["contexts"] == [False] * len(devices)
