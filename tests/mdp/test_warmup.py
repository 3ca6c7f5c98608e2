"""The set-up step compiles the solver kernels into numba's cache: a fresh process never compiles."""

from __future__ import annotations

import subprocess
import sys


def test_after_the_warm_up_a_fresh_process_loads_every_kernel_from_the_cache():
    # what the Makefile runs at set-up (a no-op apart from loading when the cache is current)
    subprocess.run([sys.executable, "-m", "overtake.mdp._warmup"], check=True, capture_output=True)
    code = "from overtake.mdp._warmup import kernel_cache_misses, warm_up; warm_up(); print(kernel_cache_misses())"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "0"
