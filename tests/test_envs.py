"""echo.envs: the environment switches and their defaults."""

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
