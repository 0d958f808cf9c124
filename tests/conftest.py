"""Puts scripts/ on sys.path so tests import the load generator and the server-process helpers
the way the scripts themselves do."""

from __future__ import annotations

import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))
