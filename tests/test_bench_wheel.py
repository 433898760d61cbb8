"""`ckptio bench` from a wheel installed in a fresh virtual environment, run outside the repository.

The wheel is built from a copy of the sources (no build/ or egg-info left in the checkout) and
installed with ``--no-deps``; the dependencies come from this test's own environment through a
``.pth`` file, so nothing is downloaded (``pip --python`` installs into a venv made without pip).
The assertions make sure the installed copy of ckptio is the one that runs, not this checkout or an
editable install.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
    assert p.returncode == 0, f"{cmd} exited {p.returncode}\nstdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"
    return p


def test_ckptio_bench_runs_from_an_installed_wheel(tmp_path):
    src, dist, venv, work = (tmp_path / d for d in ("src", "dist", "venv", "work"))
    shutil.copytree(os.path.join(ROOT, "ckptio"), src / "ckptio", ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, f), src / f)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", CKPTIO_PROGRESS="0")
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(dist),
            str(src),
        ],
        env=env,
    )
    (wheel,) = glob.glob(str(dist / "ckptio-*.whl"))

    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], env=env)
    py = str(venv / "bin" / "python")
    _run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", "-q", wheel], env=env)
    site = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env=env).stdout.strip()
    # this environment's packages, after the venv's own; addsitedir also runs their .pth files (an editable
    # install's finder goes to the end of sys.meta_path, so it cannot shadow the wheel: checked below)
    deps = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    with open(os.path.join(site, "zz-test-deps.pth"), "w") as f:
        f.write("".join(f"import site; site.addsitedir({d!r})\n" for d in deps))

    work.mkdir()
    probe = (
        "import sys, ckptio; print(ckptio.__file__); "
        "assert not [m for m in sys.modules if m.startswith('ckptio.bench')], 'import ckptio loaded ckptio.bench'"
    )
    where = _run([py, "-c", probe], cwd=work, env=env).stdout.strip()
    assert where.startswith(site + os.sep), f"ckptio imported from {where}, not from the wheel in {site}"

    p = _run(
        [
            str(venv / "bin" / "ckptio"),
            "bench",
            "--quick",
            "--sizes",
            "256KiB",
            "--repeats",
            "1",
            "--backends",
            "local,memory",
        ],
        cwd=work,
        env=env,
    )
    assert "KiB of fp32 tensors; GB/s" in p.stdout and "ckptio .pt" in p.stdout and "torch.save/load" in p.stdout
    assert "ckptio .fpk" in p.stdout and "not measured" not in p.stdout
    (res,) = glob.glob(str(work / "ckptio-bench-results" / "throughput-*.json"))
    assert f"results: {res}" in p.stdout
    doc = json.loads(open(res).read())
    assert {r["backend"] for r in doc["results"]} == {"local", "memory"}
    assert all(r["gb_per_s"] > 0 for r in doc["results"])
    assert doc["outputs"]["json"] == res and not os.path.exists(os.path.join(site, "ckptio-bench-results"))
