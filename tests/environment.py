"""What the test machine has, and how a missing piece is treated. In CI (``CI=true``, set
by .ci/run) only a GPU may be missing: a test that needs anything else runs there and
fails rather than skips."""

from __future__ import annotations

import os

import pytest

from kvwire.bench.emulator import SPLICE_AVAILABLE

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}

needs_splice = pytest.mark.skipif(not SPLICE_AVAILABLE and not IN_CI, reason="splice(2) is Linux-only")
"""For the link emulator's splice pump (Linux): skipped elsewhere, never in CI."""
