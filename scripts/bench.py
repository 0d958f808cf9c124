"""slotserve's benchmarks: five scenarios against servers it starts itself, a markdown report,
PNGs and a JSON of every number (``python scripts/bench.py --help``; ``scenarios/suite.py``).

    python scripts/bench.py                          # all scenarios, 3 repeats, into docs/
    python scripts/bench.py --quick --out-dir /tmp/b  # 1 repeat, small sizes, no SmolLM2
    python scripts/bench.py --scenarios 1,5 --repeats 5
"""

from __future__ import annotations

import sys

from scenarios.suite import main

if __name__ == "__main__":
    sys.exit(main())
