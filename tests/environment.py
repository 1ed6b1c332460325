"""What the test machine has, and how a missing piece is treated. In CI (``CI=true``, set
by .ci/run) only a GPU may be missing: a test that needs anything else runs there and
fails rather than skips."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kvwire.bench.emulator import SPLICE_AVAILABLE

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}

needs_splice = pytest.mark.skipif(not SPLICE_AVAILABLE and not IN_CI, reason="splice(2) is Linux-only")
"""For the link emulator's splice pump (Linux): skipped elsewhere, never in CI."""

NVCC = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if Path("/usr/local/bin/nvcc").exists() else None)
"""The CUDA compiler, which compiles the kernels to PTX without a GPU (None: missing)."""

needs_nvcc = pytest.mark.skipif(NVCC is None and not IN_CI, reason="nvcc not found")
"""For tests that compile the kernels with nvcc: skipped where it is missing, never in CI
(there such a test runs and fails)."""
