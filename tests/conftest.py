"""Suite-wide setup: ownership checks (`p2p_diloco.owner`) are on in the test process and, through the
environment, in every process a test starts (a `join` changing owned state on a wrong thread fails)."""

from __future__ import annotations

import os

from p2p_diloco.owner import CHECK_ENV, set_checks

os.environ[CHECK_ENV] = "1"
set_checks(True)
