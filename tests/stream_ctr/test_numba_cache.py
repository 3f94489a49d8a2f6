"""A read-only install run by a user without a writable home still imports (numba's cache)."""
import os

import stream_ctr


def test_numba_cache_moves_to_a_temp_folder_when_nothing_else_is_writable(monkeypatch, tmp_path):
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "nonexistent"))
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    stream_ctr._numba_cache_dir()
    assert "stream-ctr-numba-" in os.environ["NUMBA_CACHE_DIR"]


def test_a_writable_install_or_home_or_a_set_variable_is_left_alone(monkeypatch, tmp_path):
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    stream_ctr._numba_cache_dir()                      # this checkout is writable
    assert "NUMBA_CACHE_DIR" not in os.environ
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    stream_ctr._numba_cache_dir()
    assert os.environ["NUMBA_CACHE_DIR"] == str(tmp_path)
