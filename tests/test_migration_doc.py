"""Every `python` block of docs/MIGRATION.md (the 0.7 side of each before/after pair) runs as it is, after the
prelude the page shows; the 0.6 side is in `text` blocks."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parent.parent / "docs" / "MIGRATION.md"
TEXT = PAGE.read_text(encoding="utf-8")
BLOCKS = re.findall(r"^```python\n(.*?)^```", TEXT, flags=re.S | re.M)
PRELUDE = re.search(r"^```text\n(import torch.*?)^```", TEXT, flags=re.S | re.M).group(1)


def test_the_page_has_runnable_blocks_and_states_their_prelude():
    """The prelude is on the page (so a reader can run the blocks too), and there are blocks to run."""
    assert "train_dl = DataLoader" in PRELUDE and len(BLOCKS) >= 6


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_each_python_block_of_the_migration_page_runs(code, tmp_path, monkeypatch):
    """One block, in a fresh namespace holding the prelude, in an empty folder (checkpoints and logs go
    there); the trainers it makes are closed afterwards."""
    from deepepochs import TrainerBase

    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "migration_block"}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(PRELUDE, "prelude", "exec"), namespace)
        exec(compile(code, str(PAGE), "exec"), namespace)
    for value in namespace.values():
        if isinstance(value, TrainerBase):
            value.close()
