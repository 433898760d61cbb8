"""Issue 34's rough edges: crafted keys in a listing, symlinks in a local source tree, temporary files a
killed ``cp`` leaves, and which settings file is in effect."""

from __future__ import annotations

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
