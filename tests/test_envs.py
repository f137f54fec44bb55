"""echo.envs: the environment switches and their defaults."""

import pytest

from echo import envs


def test_fused_norm_all_reduce_is_on_by_default(monkeypatch):
    monkeypatch.delenv("ECHO_FUSED_NORM_ALL_REDUCE", raising=False)
    assert envs.fused_norm_all_reduce()
    monkeypatch.setenv("ECHO_FUSED_NORM_ALL_REDUCE", "0")
    assert not envs.fused_norm_all_reduce()


def test_early_kv_loads_are_on_by_default(monkeypatch):
    monkeypatch.delenv("ECHO_KV_EARLY_LOADS", raising=False)
    assert envs.kv_early_loads()
    monkeypatch.setenv("ECHO_KV_EARLY_LOADS", "0")
    assert not envs.kv_early_loads()


def test_the_joined_load_limit_is_unset_by_default_and_names_a_bad_value(monkeypatch):
    monkeypatch.delenv("ECHO_KV_JOINED_LOAD_BLOCKS", raising=False)
    assert envs.kv_joined_load_blocks() is None
    monkeypatch.setenv("ECHO_KV_JOINED_LOAD_BLOCKS", "256")
    assert envs.kv_joined_load_blocks() == 256
    for bad in ("-1", "1.5", "many"):
        monkeypatch.setenv("ECHO_KV_JOINED_LOAD_BLOCKS", bad)
        with pytest.raises(ValueError, match="ECHO_KV_JOINED_LOAD_BLOCKS"):
            envs.kv_joined_load_blocks()


def test_step_timeout_defaults_to_ten_minutes(monkeypatch):
    monkeypatch.delenv("ECHO_STEP_TIMEOUT_S", raising=False)
    assert envs.step_timeout_s() == 600
    monkeypatch.setenv("ECHO_STEP_TIMEOUT_S", "2.5")
    assert envs.step_timeout_s() == 2.5


@pytest.mark.parametrize("read, name, default, other", [
    (envs.kv_copy_mode, "ECHO_KV_COPY_MODE", "staged", "direct"),
    (envs.step_copy_mode, "ECHO_STEP_COPIES", "kernel", "engine"),
])
def test_copy_modes_have_a_default_and_name_a_bad_value(monkeypatch, read, name, default,
                                                        other):
    monkeypatch.delenv(name, raising=False)
    assert read() == default
    monkeypatch.setenv(name, other)
    assert read() == other
    monkeypatch.setenv(name, "fast")
    with pytest.raises(ValueError, match=name):
        read()
