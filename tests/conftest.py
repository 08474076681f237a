"""Suite-wide set-up: children started by name run in the test environment.

A test (or a library path such as `launch`) that starts `python`, `python3` or `torchrun` by name would get
whatever interpreter comes first on PATH: on a machine with pyenv or a system Python that is the base
interpreter, which has none of the project's packages on a fresh machine. The environment's own bin folder
goes first, so such a child is the same environment as the test run.
"""

import os
import sys
from pathlib import Path

_ENV_BIN = str(Path(sys.executable).parent)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _ENV_BIN:
    os.environ["PATH"] = os.pathsep.join([_ENV_BIN, os.environ.get("PATH", "")])


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_migration_announcements():
    """Each test starts as a fresh process would: no difference from deepepochs 0.6.18 announced yet (the
    library says each at most once per process)."""
    from deepepochs.compat import ANNOUNCED

    ANNOUNCED.clear()
    yield
