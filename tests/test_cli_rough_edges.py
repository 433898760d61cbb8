"""Issue 34's rough edges: crafted keys in a listing, symlinks in a local source tree, temporary files a
killed ``cp`` leaves, and which settings file is in effect."""

from __future__ import annotations

import pytest

from ckptio.cli import main as cli_main
from ckptio.errors import SettingsError, UnsafeKeyError


def test_a_crafted_key_in_a_listing_is_hostile_data_not_settings(tmp_path, user_uri, capsys):
    from conftest import UserDictBackend

    UserDictBackend.store[f"{user_uri}/tree/fine.bin"] = (b"ok", 1)
    UserDictBackend.store[f"{user_uri}/tree/../escaped.bin"] = (b"evil", 2)  # a listing can return any key
    assert cli_main(["cp", "-r", f"{user_uri}/tree", str(tmp_path / "dst")]) == 1
    err = capsys.readouterr().err
    assert "escapes" in err and "settings" not in err
    assert not (tmp_path / "escaped.bin").exists()
    assert not issubclass(UnsafeKeyError, SettingsError) and issubclass(UnsafeKeyError, ValueError)


def test_cp_r_skips_symlinks_in_a_local_tree_with_a_warning(tmp_path, capsys):
    """The rule, for files and directories alike: a recursive copy does not follow symlinks in a local
    source tree (one pointing outside would upload outside content; a dangling one used to abort the copy
    with exit 3); each is skipped with a warning naming it, everything else is copied."""
    import os

    outside = tmp_path / "outside"
    (outside / "d").mkdir(parents=True)
    (outside / "secret.txt").write_bytes(b"outside content")
    (outside / "d" / "more.txt").write_bytes(b"outside content")
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.bin").write_bytes(b"a")
    (src / "sub" / "b.bin").write_bytes(b"b")
    os.symlink(outside / "secret.txt", src / "file-out")
    os.symlink(outside / "d", src / "dir-out")
    os.symlink(tmp_path / "nowhere", src / "sub" / "dangling")
    os.symlink(src / "a.bin", src / "file-in")
    dst = tmp_path / "dst"
    with pytest.warns(UserWarning, match="symlink") as seen:
        assert cli_main(["cp", "-r", str(src), str(dst)]) == 0
    named = " ".join(str(w.message) for w in seen)
    assert all(n in named for n in ("file-out", "dir-out", "dangling", "file-in"))
    got = sorted(str(p.relative_to(dst)) for p in dst.rglob("*") if p.is_file())
    assert got == ["a.bin", "sub/b.bin"]
    capsys.readouterr()


def _killed_writer(dst: str) -> None:
    """In a child: start writing ``dst`` and die by SIGKILL mid-write (as a killed ``ckptio cp`` does)."""
    import os
    import signal

    import ckptio

    backend, uri = ckptio.resolve(dst)
    w = backend.open_writer(uri)
    w.write(b"x" * 4096)
    os.kill(os.getpid(), signal.SIGKILL)


def test_cp_resume_removes_what_a_killed_copy_left(tmp_path, capsys):
    import multiprocessing as mp
    import os

    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "sub").mkdir(parents=True)
    for name in ("a.bin", "sub/b.bin"):
        (src / name).write_bytes(b"y" * 8192)
    assert cli_main(["cp", "-r", str(src), str(dst)]) == 0
    os.remove(dst / "sub" / "b.bin")
    for target in (dst / "sub" / "b.bin", dst / "a.bin"):
        p = mp.get_context("spawn").Process(target=_killed_writer, args=(str(target),))
        p.start()
        p.join(60)
        assert p.exitcode == -9
    left = [p.name for p in dst.rglob("*") if ".ckptio-tmp-" in p.name]
    assert len(left) == 2
    assert cli_main(["cp", "-r", "--resume", str(src), str(dst)]) == 0
    assert [p.name for p in dst.rglob("*") if ".ckptio-tmp-" in p.name] == []
    assert (dst / "sub" / "b.bin").read_bytes() == b"y" * 8192
    capsys.readouterr()


def test_the_settings_file_in_effect_is_logged_once_and_named_in_hints(tmp_path, monkeypatch, caplog, capsys):
    """A ./ckptio.toml can remap s3://a/ to another bucket: say so, once, at INFO (the file, its mappings
    and aliases), and in the hint of an error about a remapped URI."""
    import logging

    import ckptio

    (tmp_path / "ckptio.toml").write_text('[path_mapping]\n"memory://a/" = "memory://b/"\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CKPTIO_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "none"))
    ckptio.reset()
    with caplog.at_level(logging.INFO, logger="ckptio"):
        ckptio.put(b"x", "memory://a/x.bin")
        assert ckptio.get("memory://b/x.bin") == b"x"
        ckptio.exists("memory://a/y.bin")
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("ckptio") and "ckptio.toml" in r.getMessage()]
    assert len(lines) == 1, lines
    assert str(tmp_path / "ckptio.toml") in lines[0] and "1 path mapping" in lines[0] and "0 aliases" in lines[0]
    assert cli_main(["ls", "memory://a/missing.bin"]) == 3
    err = capsys.readouterr().err
    assert "memory://a/missing.bin" in err and "memory://b/missing.bin" in err and "ckptio.toml" in err
