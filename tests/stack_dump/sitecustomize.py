"""Test-only: every Python process started with this folder on PYTHONPATH and
``SPMD_TEST_STACKS_AFTER_S`` set writes all its threads' stacks to stderr after that many seconds
(faulthandler, once), so a test that times out on a hung subprocess
(torchrun and its ranks) shows where each process was waiting. Nothing else is changed."""

from __future__ import annotations

import faulthandler
import os

_after = os.environ.get("SPMD_TEST_STACKS_AFTER_S")
if _after:
    faulthandler.dump_traceback_later(float(_after), repeat=False, exit=False)
