"""Soak tests: the pure parts run anywhere; the short soak needs the whole local stack.

The benchmark's modules live under `benchmarks/soak/` (not an installed package), so the
repository root goes on the import path here.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
