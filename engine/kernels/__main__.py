"""Build the CPU kernels now (``python -m engine.kernels``), so no server start waits on it."""

from __future__ import annotations

import logging

from engine.kernels import cpu_kernels, cpu_kernels_supported

logging.basicConfig(level=logging.WARNING, format="%(message)s")
if not cpu_kernels_supported():
    print("CPU kernels: not built (this CPU has no AVX512-BF16; torch's ops serve)")
elif cpu_kernels() is None:
    print("CPU kernels: build failed (see the warning above); torch's ops serve")
else:
    print("CPU kernels: built")
