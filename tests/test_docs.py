"""The docs cannot drift: every ```python, ```bash and ```toml block of README.md and docs/*.md runs here.

How a page runs (one test per page, blocks in document order, cwd a fresh temporary directory):

* ``python``: executed in one namespace per page, which starts with :data:`PREAMBLE` (``ckptio``,
  ``torch``, a tiny ``model``, ``optim``, ``sched``, ``step``, ``steps``, ``train_step``). A page may add
  hidden setup in an HTML comment ``<!-- docs-test: setup`` ... ``-->`` (Python, run where it stands).
* ``bash``: each line is a ``ckptio`` command, run through the console script's entry point
  (``ckptio.cli:main``) with ``CKPTIO_*`` variables and settings pointing ``s3://`` at moto and
  ``gs://`` at the GCS emulator.
* ``toml``: written to a file and loaded with ckptio's settings loader (:func:`ckptio.config.load_file`).
* ``<!-- docs-test: skip (reason) -->`` just before a block skips it; the reason shows in the page, and
  :data:`MAX_SKIPS` keeps skips few.

Rewrites, so examples keep their natural names: the buckets in :data:`S3_BUCKETS`/:data:`GCS_BUCKETS`
become fresh buckets on the test servers, and the example roots ``/ckpt/``, ``/local/``, ``/nvme/`` lie
under the test's temporary directory. docs/coming-from.md runs in tests/test_docs_coming_from.py.
The README's Checkpointer loop is also interrupted twice and resumed
(:func:`test_the_readme_checkpointer_loop_resumes`).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import pathlib
import re
import shlex
import uuid
from dataclasses import dataclass

import pytest
import torch

import ckptio
from ckptio.cli import main as CONSOLE_SCRIPT
from ckptio.config import load_file
from conftest import S3_TEST_OPTIONS
from servers import free_port, make_gcs_bucket, make_s3_bucket

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = ["README.md"] + sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md") if p.name != "coming-from.md"
)
MAX_SKIPS = 4
S3_BUCKETS = ("team-bucket", "scratch-bucket", "my-bucket", "bucket", "mirror")
GCS_BUCKETS = ("bucket", "mirror")
LOCAL_ROOTS = ("ckpt", "local", "nvme")
PREAMBLE = """
import ckptio
import torch

torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
optim = torch.optim.AdamW(model.parameters(), lr=0.01)
sched = torch.optim.lr_scheduler.StepLR(optim, 2)
step, steps = 100, 10


def train_step():
    loss = model(torch.randn(3, 4)).pow(2).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()
    sched.step()
    return loss
"""

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:.*single process:UserWarning"),
]


@dataclass
class Block:
    kind: str  # python, bash, toml, setup (hidden Python), or another fence's language
    code: str
    line: int
    skip: str | None  # the reason given in the page


_ITEM = re.compile(
    r"(?:^<!-- docs-test: skip \((?P<reason>[^)]+)\) -->\n)?^```(?P<lang>[\w-]*)\n(?P<code>.*?)^```$"
    r"|^<!-- docs-test: setup\n(?P<setup>.*?)^-->$",
    re.S | re.M,
)


def blocks(page: str) -> list[Block]:
    text = (ROOT / page).read_text()
    out = []
    for m in _ITEM.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        if m.group("setup") is not None:
            out.append(Block("setup", m.group("setup"), line, None))
        else:
            out.append(Block(m.group("lang"), m.group("code"), line, m.group("reason")))
    return out


def test_skips_are_few_and_give_a_reason():
    skipped = [(page, b.line, b.skip) for page in PAGES for b in blocks(page) if b.skip]
    assert len(skipped) <= MAX_SKIPS, skipped
    for page in PAGES:
        assert "docs-test: skip" not in (ROOT / page).read_text().replace("<!-- docs-test: skip (", ""), page


def test_every_page_has_blocks_and_every_fence_is_a_known_language():
    for page in PAGES:
        kinds = {b.kind for b in blocks(page)}
        assert kinds & {"python", "bash"}, page
        assert kinds <= {"python", "bash", "toml", "setup"}, (page, kinds)


def test_the_quick_start_commands_exist():
    quick = next(b for b in blocks("README.md") if b.kind == "bash")
    commands = [line.split()[0] for line in quick.code.splitlines() if line.strip()]
    assert commands == ["./scripts/demo.sh", "./scripts/test.sh"]
    for c in commands:
        assert os.access(ROOT / c, os.X_OK), c
    assert "pytest" in (ROOT / "scripts/test.sh").read_text()


def test_relative_links_resolve():
    for page in [*PAGES, "docs/coming-from.md"]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", (ROOT / page).read_text()):
            assert (ROOT / page).parent.joinpath(target).exists(), f"{page}: broken link {target}"


class _Rewrite:
    """Example names -> the test's buckets and directories."""

    def __init__(self, tmp: pathlib.Path, s3_endpoint: str, gcs_endpoint: str) -> None:
        suffix = uuid.uuid4().hex[:8]
        self.s3 = {b: f"{b}-{suffix}" for b in S3_BUCKETS}
        self.gcs = {b: f"{b}-{suffix}" for b in GCS_BUCKETS}
        for name in self.s3.values():
            make_s3_bucket(s3_endpoint, name)
        for name in self.gcs.values():
            make_gcs_bucket(gcs_endpoint, name)
        self.tmp = tmp

    def __call__(self, code: str) -> str:
        code = re.sub(r"\b(s3|gs)://([\w-]+)", self._bucket, code)
        return re.sub(rf"(?<![\w/.:-])/({'|'.join(LOCAL_ROOTS)})/", lambda m: f"{self.tmp}/{m.group(1)}/", code)

    def _bucket(self, m: re.Match) -> str:
        table = self.s3 if m.group(1) == "s3" else self.gcs
        return f"{m.group(1)}://{table.get(m.group(2), m.group(2))}"


@pytest.fixture
def page_env(s3_endpoint, gcs_endpoint, tmp_path, monkeypatch):
    """cwd, settings and environment for one page: the servers, a cache directory, a process group's address."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    env = {
        "CKPTIO_S3_ENDPOINT_URL": s3_endpoint,
        "CKPTIO_GCS_ENDPOINT_URL": gcs_endpoint,
        "CKPTIO_GCS_ANON": "true",
        "CKPTIO_GCS_PROJECT": "test",
        "CKPTIO_CACHE_DIR": str(tmp_path / "cache"),
        "CKPTIO_PROGRESS": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    ckptio.reset()
    ckptio.configure(
        backends={
            "s3": {"endpoint_url": s3_endpoint, **S3_TEST_OPTIONS},
            "gcs": {"endpoint_url": gcs_endpoint, "anon": True, "project": "test"},
        }
    )
    yield _Rewrite(tmp_path, s3_endpoint, gcs_endpoint)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _run_commands(code: str, where: str) -> None:
    """Each line of a shell block is a ``ckptio`` command: run it through the console script's entry point
    (:data:`CONSOLE_SCRIPT`, in this process: a fresh interpreter per command costs seconds here)."""
    for line in code.splitlines():
        argv = shlex.split(line, comments=True)
        if not argv:
            continue
        assert argv[0] == "ckptio", f"{where}: only ckptio commands run here: {line}"
        ckptio.configure()  # as a fresh process would, read the settings file again (a setup may write one)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code_ = CONSOLE_SCRIPT(argv[1:])
        assert code_ == 0, f"{where}: {line}\nexit {code_}\n{out.getvalue()}\n{err.getvalue()}"


def test_the_console_script_is_what_the_shell_blocks_run():
    scripts = (ROOT / "pyproject.toml").read_text().split("[project.scripts]", 1)[1]
    module, func = re.search(r'^ckptio = "([\w.]+):(\w+)"', scripts, re.M).groups()
    assert getattr(importlib.import_module(module), func) is CONSOLE_SCRIPT


@pytest.mark.parametrize("page", PAGES)
def test_the_page_runs(page, page_env, tmp_path):
    namespace: dict = {"__name__": "__docs__"}
    exec(compile(PREAMBLE, "PREAMBLE", "exec"), namespace)
    ran = 0
    for b in blocks(page):
        where = f"{page}:{b.line}"
        code = page_env(b.code)
        if b.skip:
            continue
        if b.kind in ("python", "setup"):
            exec(compile(code, where, "exec"), namespace)
        elif b.kind == "bash":
            _run_commands(code, where)
        elif b.kind == "toml":
            path = tmp_path / f"block-{b.line}.toml"
            path.write_text(code)
            load_file(str(path))
        ran += 1
    assert ran


def test_storage_emulator_host_points_gs_at_the_emulator(gcs_endpoint, monkeypatch):
    """docs/storage.md: with no endpoint_url, gs:// goes where STORAGE_EMULATOR_HOST says."""
    bucket = f"emu-{uuid.uuid4().hex[:8]}"
    make_gcs_bucket(gcs_endpoint, bucket)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_endpoint.split("://", 1)[1])
    ckptio.reset()
    ckptio.configure(backends={"gcs": {"anon": True, "project": "test"}})
    ckptio.put(b"hello", f"gs://{bucket}/x.bin")
    assert ckptio.get(f"gs://{bucket}/x.bin") == b"hello"


# ---- the README's Checkpointer loop, interrupted twice and resumed --------------------------------


def _checkpointer_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Checkpointer") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _run(block: str, steps: int, crash_after: int | None) -> tuple[torch.nn.Module, list[int]]:
    saved: list[int] = []

    class Crash(Exception):
        pass

    g: dict = {"__name__": "__docs__"}
    exec(compile(PREAMBLE, "PREAMBLE", "exec"), g)
    step_once = g["train_step"]

    def train_step():
        loss = step_once()
        if g.get("step") == crash_after:
            g["ck"].wait()
            raise Crash
        return loss

    g.update(steps=steps, train_step=train_step)
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
    return g["model"], saved


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
