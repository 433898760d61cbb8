"""``ckptio info`` of what a Checkpointer writes (a root: its steps; a step: its keys, any format) and
``ckptio config``'s text view, through :func:`ckptio.cli.main`, locally and on S3 (moto)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import ckptio
from ckptio import cli
from ckptio.checkpointer import Checkpointer


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv: str) -> dict:
    code, out, err = run(capsys, "--json", *argv)
    assert code == 0, err
    return json.loads(out)


def state(step: int) -> dict:
    return {"model": {"w": torch.ones(4, 2), "b": torch.zeros(3, dtype=torch.bfloat16)}, "epoch": step}


def saved(root: str, fmt: str, steps=(10, 20)) -> str:
    ck = Checkpointer(root, format=fmt)
    for s in steps:
        ck.save(s, state(s), metrics={"loss": 1.0 / s})
    ck.close()
    return root


KEYS = {"model.w": ("float32", [4, 2], 32), "model.b": ("bfloat16", [3], 6)}


def assert_keys(data: dict) -> None:
    got = {t["key"]: (t["dtype"], t["shape"], t["nbytes"]) for t in data["tensors"]}
    assert got == KEYS


@pytest.mark.parametrize("fmt", ["fpk", "pt", "dcp"])
@pytest.mark.parametrize("where", ["local_uri", "s3_uri"])
def test_info_of_a_step_directory_of_any_format(request, capsys, fmt, where):
    root = saved(request.getfixturevalue(where) + "/run", fmt)
    data = run_json(capsys, "info", f"{root}/000000000020")
    assert_keys(data)
    assert data["step"] == 20 and data["metrics"] == {"loss": 0.05}
    code, out, err = run(capsys, "info", f"{root}/000000000020")
    assert code == 0, err
    assert "model.w" in out and "4x2" in out and "bfloat16" in out
    assert run_json(capsys, "verify", f"{root}/000000000010")["ok"] is True


@pytest.mark.parametrize("where", ["local_uri", "s3_uri"])
def test_info_of_a_root_lists_its_steps(request, capsys, where):
    base = request.getfixturevalue(where)
    root = saved(base + "/run", "fpk")
    ckptio.put(b"partial", f"{root}/000000000030/state.fpk")  # a save that was killed: no marker
    data = run_json(capsys, "info", root)
    assert data["kind"] == "checkpointer" and data["latest"] == 20
    rows = {r["step"]: r for r in data["steps"]}
    assert sorted(rows) == [10, 20, 30]
    for s in (10, 20):
        r = rows[s]
        assert (r["format"], r["state"], r["durable"], r["where"]) == ("fpk", "committed", True, "root")
        assert r["metrics"] == {"loss": 1.0 / s} and not r["incremental"]
        assert r["size"] > 100  # the data file and the marker
    assert rows[30]["state"] == "incomplete" and rows[30]["size"] == len(b"partial")
    code, out, err = run(capsys, "info", root)
    assert code == 0, err
    lines = out.splitlines()
    assert "Checkpointer root, 3 step(s), latest 20" in lines[0]
    line20 = next(ln for ln in lines if ln.split()[:1] == ["20"])
    assert "fpk" in line20 and "durable" in line20 and "loss=0.05" in line20
    assert "incomplete" in next(ln for ln in lines if ln.split()[:1] == ["30"])


@pytest.mark.parametrize("fmt", ["fpk", "dcp"])
def test_info_of_a_root_with_step_shows_that_steps_keys(capsys, s3_uri, fmt):
    root = saved(s3_uri + "/run", fmt)
    data = run_json(capsys, "info", root, "--step", "10")
    assert_keys(data)
    assert data["step"] == 10 and data["format"] == ("fastpickle" if fmt == "fpk" else "dcp")
    code, out, err = run(capsys, "info", root, "--step", "11")
    assert code == cli.EXIT_NOT_FOUND and "no step 11" in err


def test_info_of_a_root_with_a_local_tier_says_which_steps_are_durable(capsys, tmp_path):
    root, tier = str(tmp_path / "remote"), str(tmp_path / "tier")
    saved(root, "fpk", steps=(10,))
    saved(tier, "fpk", steps=(10, 20))  # step 20 only on this node's tier: not replicated to root yet
    rows = {r["step"]: r for r in run_json(capsys, "info", root, "--local-tier", tier)["steps"]}
    assert (rows[10]["where"], rows[10]["durable"]) == ("local+remote", True)
    assert (rows[20]["where"], rows[20]["durable"]) == ("local", False)
    code, out, _ = run(capsys, "info", root, "--local-tier", tier)
    assert "local only" in next(ln for ln in out.splitlines() if ln.split()[:1] == ["20"])


def test_kept_steps_show_their_names(capsys, s3_uri):
    root = s3_uri + "/run"
    ck = Checkpointer(root, format="fpk", keep_last=1)
    for s in (10, 20, 30):
        ck.save(s, state(s), metrics={"loss": 1.0 / s})
        if s == 10:
            ck.keep(10, name="best")
            ck.keep(10, name="first")
    ck.close()
    rows = {r["step"]: r for r in run_json(capsys, "info", root)["steps"]}
    assert sorted(rows) == [10, 30] and rows[10]["kept"] == ["best", "first"] and rows[30]["kept"] == []
    code, out, _ = run(capsys, "info", root)
    assert "[kept: best, first]" in next(ln for ln in out.splitlines() if ln.split()[:1] == ["10"])
    ckptio.put(b"not json", f"{root}/kept.json")
    code, out, err = run(capsys, "info", root)
    assert code == 0, err
    assert "kept steps unknown" in out and "kept.json" in out


def test_incremental_steps_show_as_such(capsys, tmp_path):
    root = str(tmp_path / "inc")
    ck = Checkpointer(root, format="fpk", incremental=True)
    ck.save(1, state(1))
    ck.close()
    (row,) = run_json(capsys, "info", root)["steps"]
    assert row["incremental"] and row["state"] == "committed"
    assert_keys(run_json(capsys, "info", root, "--step", "1"))


def test_a_directory_that_is_no_checkpoint_says_what_it_looked_for(capsys, tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.txt").write_text("hi")
    code, _, err = run(capsys, "info", str(tmp_path / "d"))
    assert code == cli.EXIT_FAILURE and "checkpoint.json" in err and "step directories" in err


def test_config_text_shows_the_cache_and_checkpointer_tables(capsys, tmp_path, monkeypatch):
    cfg = tmp_path / "ckptio.toml"
    cfg.write_text(
        '[cache]\ndir = "/tmp/c"\nmax_bytes = "1GiB"\n\n[checkpointer]\nlocal_tier = "/nvme"\nkeep_local = 3\n'
    )
    monkeypatch.setenv("CKPTIO_CONFIG", str(cfg))
    ckptio.reset()
    code, out, err = run(capsys, "config")
    assert code == 0, err
    lines = out.splitlines()
    assert "[cache]" in lines and 'dir = "/tmp/c"' in lines and f"max_bytes = {2**30}" in lines
    assert "[checkpointer]" in lines and 'local_tier = "/nvme"' in lines and "keep_local = 3" in lines
    assert os.environ["CKPTIO_CONFIG"] == str(cfg)
