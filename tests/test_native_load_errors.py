"""What a user reads when the native extension is there but a library it links cannot be loaded.

The extension's import is made to fail the way the dynamic loader fails it (an ImportError naming
the missing shared object) in a child interpreter, so the real pydflash package runs its real
error path. A GPU build without the GPU's driver must not be told to rebuild pydflash.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_CHILD = r"""
import importlib.abc, json, sys

class FailNative(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "pydflash._native":
            raise ImportError(sys.argv[1])
        return None

sys.meta_path.insert(0, FailNative())
from pydflash import NativeExtensionError
from pydflash.runtime import devices
try:
    devices.devices()
except NativeExtensionError as exc:
    print(json.dumps({"msg": str(exc), "name": exc.name}))
"""


def _message(loader_error: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _CHILD, loader_error], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize(("missing", "says"), [
    ("libcuda.so.1", "built with CUDA"),
    ("libvulkan.so.1", "built with Vulkan"),
])
def test_a_missing_gpu_driver_is_named_not_a_rebuild(missing: str, says: str) -> None:
    got = _message(f"{missing}: cannot open shared object file: No such file or directory")
    assert got["name"] == "pydflash._native"
    assert missing in got["msg"] and says in got["msg"]
    assert "install the driver" in got["msg"] and "CPU-only" in got["msg"]


def test_another_missing_library_gets_the_build_hint() -> None:
    got = _message("libllama.so: cannot open shared object file: No such file or directory")
    assert "libllama.so" in got["msg"] and "pip install ." in got["msg"]
    assert "driver" not in got["msg"]
