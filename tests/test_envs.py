"""echo.envs: the environment switches and their defaults."""

import pytest

from echo import envs


def test_fused_norm_all_reduce_is_on_by_default(monkeypatch):
    monkeypatch.delenv("ECHO_FUSED_NORM_ALL_REDUCE", raising=False)
    assert envs.fused_norm_all_reduce()
    monkeypatch.setenv("ECHO_FUSED_NORM_ALL_REDUCE", "0")
    assert not envs.fused_norm_all_reduce()


def test_step_timeout_defaults_to_ten_minutes(monkeypatch):
    monkeypatch.delenv("ECHO_STEP_TIMEOUT_S", raising=False)
    assert envs.step_timeout_s() == 600
    monkeypatch.setenv("ECHO_STEP_TIMEOUT_S", "2.5")
    assert envs.step_timeout_s() == 2.5


def test_kv_copy_mode_is_staged_by_default_and_names_a_bad_value(monkeypatch):
    monkeypatch.delenv("ECHO_KV_COPY_MODE", raising=False)
    assert envs.kv_copy_mode() == "staged"
    monkeypatch.setenv("ECHO_KV_COPY_MODE", "direct")
    assert envs.kv_copy_mode() == "direct"
    monkeypatch.setenv("ECHO_KV_COPY_MODE", "fast")
    with pytest.raises(ValueError, match="ECHO_KV_COPY_MODE"):
        envs.kv_copy_mode()


def test_step_copies_go_by_the_copy_engine_by_default_and_name_a_bad_value(monkeypatch):
    monkeypatch.delenv("ECHO_STEP_COPIES", raising=False)
    assert envs.step_copy_mode() == "engine"
    monkeypatch.setenv("ECHO_STEP_COPIES", "kernel")
    assert envs.step_copy_mode() == "kernel"
    monkeypatch.setenv("ECHO_STEP_COPIES", "dma")
    with pytest.raises(ValueError, match="ECHO_STEP_COPIES"):
        envs.step_copy_mode()
