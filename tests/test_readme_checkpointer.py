"""The README's Checkpointer loop, extracted from README.md and run as written against moto's S3 server:
interrupted twice and restarted, it saves every step it should exactly once and ends where an
uninterrupted run ends."""

from __future__ import annotations

import pathlib
import re

import torch

import ckptio
from conftest import S3_TEST_OPTIONS
from servers import make_s3_bucket

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _checkpointer_block() -> str:
    text = README.read_text()
    section = text[text.index("## Checkpointer") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _run(block: str, steps: int, crash_after: int | None) -> tuple[torch.nn.Module, list[int]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(optim, 2)
    saved: list[int] = []

    class Crash(Exception):
        pass

    def train_step():
        loss = model(torch.randn(3, 4)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
        seen = g.get("step")
        if seen == crash_after:
            g["ck"].wait()
            raise Crash
        return loss

    g = {"ckptio": ckptio, "model": model, "optim": optim, "sched": sched, "steps": steps, "train_step": train_step}
    real_save = ckptio.Checkpointer.save

    def save(self, step, state, **kw):
        saved.append(step)
        return real_save(self, step, state, **kw)

    ckptio.Checkpointer.save = save  # type: ignore[method-assign]
    try:
        exec(block.replace("500", "2").replace("1000", "4"), g)
    except Crash:
        pass
    finally:
        ckptio.Checkpointer.save = real_save  # type: ignore[method-assign]
    return model, saved


def test_the_readme_checkpointer_loop_resumes(s3_endpoint):
    make_s3_bucket(s3_endpoint, "team-bucket")
    ckptio.configure(backends={"s3": {"endpoint_url": s3_endpoint, **S3_TEST_OPTIONS}})
    block = _checkpointer_block()
    assert "ck.resume(state)" in block
    _, first = _run(block, 10, 3)
    _, second = _run(block, 10, 6)
    final, third = _run(block, 10, None)
    assert first + second + third == [0, 2, 4, 6, 8]
    ck = ckptio.Checkpointer("s3://team-bucket/run7")
    assert ck.list() == [0, 4, 6, 8]  # keep_last=3, and keep_every=4 keeps 0 and 4
    ckptio.rmtree("s3://team-bucket/run7")
