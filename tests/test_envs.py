"""echo.envs: the environment switches, their defaults and their errors."""

import pytest

from echo import envs


def test_l2_prefetch_bytes(monkeypatch):
    monkeypatch.delenv("ECHO_L2_PREFETCH_MIB", raising=False)
    assert envs.l2_prefetch_bytes() == 0  # off unless asked for
    for value, nbytes in (("8", 8 << 20), ("0.5", 512 << 10), ("0", 0), ("", 0)):
        monkeypatch.setenv("ECHO_L2_PREFETCH_MIB", value)
        assert envs.l2_prefetch_bytes() == nbytes
    for bad in ("-1", "lots", "nan", "inf"):
        monkeypatch.setenv("ECHO_L2_PREFETCH_MIB", bad)
        with pytest.raises(ValueError, match="ECHO_L2_PREFETCH_MIB"):
            envs.l2_prefetch_bytes()


def test_fused_norm_all_reduce_is_on_by_default(monkeypatch):
    monkeypatch.delenv("ECHO_FUSED_NORM_ALL_REDUCE", raising=False)
    assert envs.fused_norm_all_reduce()
    monkeypatch.setenv("ECHO_FUSED_NORM_ALL_REDUCE", "0")
    assert not envs.fused_norm_all_reduce()
