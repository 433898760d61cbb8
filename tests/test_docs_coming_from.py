"""docs/coming-from.md cannot drift: each of its ```python blocks runs, twice (the second run resumes from the
first), against a fresh bucket of the local S3 server (moto) in place of s3://my-bucket."""

from __future__ import annotations

import os
import re

import pytest

DOC = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "coming-from.md")

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:.*single process:UserWarning"),
]


def _blocks() -> list[str]:
    with open(DOC) as f:
        return re.findall(r"^```python\n(.*?)^```$", f.read(), flags=re.S | re.M)


def test_the_page_has_runnable_blocks_for_each_seed():
    blocks = _blocks()
    assert len(blocks) == 3
    assert "dinov3" in blocks[0] and "load_model" in blocks[1] and "cosmos" in blocks[2]


def test_the_code_blocks_run_and_resume(s3_uri, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for attempt in range(2):
        for i, code in enumerate(_blocks()):
            code = code.replace("s3://my-bucket", s3_uri)
            exec(compile(code, f"{DOC}[python block {i}, run {attempt}]", "exec"), {"__name__": "__doc_block__"})
