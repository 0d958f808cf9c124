"""What the server imports at start-up: the constraint matcher must not pull in torch's
compiler (``llguidance.torch`` does, at import, for a kernel never called here), which cost
every server and command-line process ~5 s of CPU before it read a flag."""

from __future__ import annotations

import subprocess
import sys


def test_the_server_imports_without_torch_compile():
    probe = (
        "import sys, app.__main__, app.api.server, app.constraints.matcher; "
        "loaded = [m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules]; "
        "print(loaded); sys.exit(1 if loaded else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
