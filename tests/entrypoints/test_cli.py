"""The command line: `python -m echo generate` and its errors."""

import re
import socket
import subprocess
import sys

import pytest

from echo.config import EngineConfig, engine_arg_specs


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "echo", *args], capture_output=True, text=True,
                          timeout=300)


def test_generate_prints_the_answer(tiny_chat_model):
    from echo import LLM, SamplingParams

    result = run_cli("generate", "--model", str(tiny_chat_model), "--device", "cpu",
                     "--prompt", "Hi there", "--max-tokens", "5", "--ignore-eos")
    assert result.returncode == 0, result.stderr
    expected = LLM(str(tiny_chat_model), device="cpu").chat(
        [{"role": "user", "content": "Hi there"}],
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert f"> Hi there\n{expected[0].outputs[0].text}\n" in result.stdout


def test_bad_arguments_exit_2_with_the_field_named(tmp_path):
    missing = run_cli("generate", "--model", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "nowhere" in missing.stderr
    bad = run_cli("generate", "--model", "qwen3-0.6b", "--load-format", "dummy",
                  "--max-num-seqs", "0")
    assert bad.returncode == 2 and "max_num_seqs" in bad.stderr
    preset = run_cli("generate", "--model", "qwen3-8b")
    assert preset.returncode == 2 and "never downloads" in preset.stderr


def test_serve_refuses_a_bad_or_busy_port_before_the_engine_starts(tiny_chat_model):
    out_of_range = run_cli("serve", str(tiny_chat_model), "--device", "cpu", "--port", "99999")
    assert out_of_range.returncode == 2
    assert "--port: must be in [0, 65535], got 99999" in out_of_range.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = run_cli("serve", str(tiny_chat_model), "--device", "cpu", "--port", str(port))
    assert busy.returncode == 2
    assert f"error: port: cannot listen on 127.0.0.1:{port}" in busy.stderr
    assert "KV cache" not in busy.stderr  # refused before the engine was built
    foreign = run_cli("serve", str(tiny_chat_model), "--device", "cpu", "--host", "192.0.2.1")
    assert foreign.returncode == 2  # TEST-NET-1: an address this machine does not have
    assert "error: host: cannot listen on 192.0.2.1:8000" in foreign.stderr
    # an empty key (an unset shell variable) would serve everyone: refused, as a zero limit
    empty_key = run_cli("serve", str(tiny_chat_model), "--device", "cpu", "--api-key", "")
    assert empty_key.returncode == 2 and "--api-key: must not be empty" in empty_key.stderr
    no_bytes = run_cli("serve", str(tiny_chat_model), "--device", "cpu",
                       "--max-request-bytes", "0")
    assert no_bytes.returncode == 2
    assert "--max-request-bytes: must be >= 1, got 0" in no_bytes.stderr


@pytest.mark.parametrize("flag", ["--tensor-parallel-size", "--tp", "-tp", "--tp-size"])
def test_tp_flags_of_vllm_and_sglang_are_understood(flag):
    from echo.entrypoints.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["serve", flag, "2"])
    assert engine_kwargs(args) == {"tensor_parallel_size": 2}


def _engine_flags() -> dict:
    import argparse

    from echo.entrypoints.cli import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return {a.dest: a for a in parser._actions}


def test_every_engine_argument_has_a_flag_with_the_config_choices():
    import argparse
    import dataclasses
    import typing

    from echo.config import ENGINE_PARTS, MODEL_ARGS

    flags = _engine_flags()
    # from the dataclasses themselves: a field added without its metadata, or without a flag,
    # fails here
    expected = {a.name: (a.type, a.default, a.choices) for a in MODEL_ARGS}
    for part in ENGINE_PARTS:
        hints = typing.get_type_hints(part)
        for f in dataclasses.fields(part):
            if f.name in expected:  # max_model_len: the model's, copied into the scheduler
                continue
            value_type = [t for t in typing.get_args(hints[f.name]) if t is not type(None)]
            expected[f.name] = (value_type[0] if value_type else hints[f.name], f.default,
                                f.metadata["choices"])
            assert f.metadata["help"], f.name
    for name, (value_type, default, choices) in expected.items():
        action = flags[name]
        assert f"--{name.replace('_', '-')}" in action.option_strings
        assert action.default is None, name  # not given: the config's default applies
        assert action.choices == (list(choices) if choices is not None else None), name
        if value_type is bool:
            boolean = argparse.BooleanOptionalAction if default else argparse._StoreTrueAction
            assert isinstance(action, boolean), name
        elif value_type is dict:  # a JSON object on the command line
            assert action.type('{"a": 1}') == {"a": 1}, name
            with pytest.raises(argparse.ArgumentTypeError):
                action.type("[1]")
        else:
            assert action.type is value_type, name
    assert set(flags) - {"help", "model"} == set(expected)


@pytest.mark.parametrize("spec", [s for s in engine_arg_specs() if s.choices],
                         ids=lambda s: s.name)
def test_the_flags_choices_are_the_ones_the_config_checks(tiny_llama, spec):
    from echo.config import EngineConfig

    assert _engine_flags()[spec.name].choices == list(spec.choices)
    message = f"{spec.name}: 'bogus' is not one of {list(spec.choices)}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        EngineConfig.create(str(tiny_llama), **{"device": "cpu", spec.name: "bogus"})


def test_a_command_line_gives_the_python_calls_config(tiny_llama):
    from echo.config import EngineConfig
    from echo.entrypoints.cli import build_parser, engine_kwargs

    python_kwargs = dict(
        tokenizer=str(tiny_llama), dtype="float32", max_model_len=128, load_format="dummy",
        seed=3, block_size=32, gpu_memory_utilization=0.5, num_gpu_blocks_override=64,
        enable_prefix_caching=False, kv_cache_dtype="int8", max_num_seqs=4,
        max_num_batched_tokens=512, async_scheduling=False, tensor_parallel_size=1,
        device="cpu", attention_backend="torch", enforce_eager=True,
    )
    argv = ["serve", "--model", str(tiny_llama), "--tokenizer", str(tiny_llama),
            "--dtype", "float32", "--max-model-len", "128", "--load-format", "dummy",
            "--seed", "3", "--block-size", "32", "--gpu-memory-utilization", "0.5",
            "--num-gpu-blocks-override", "64", "--no-enable-prefix-caching",
            "--kv-cache-dtype", "int8", "--max-num-seqs", "4", "--max-num-batched-tokens", "512",
            "--no-async-scheduling", "-tp", "1", "--device", "cpu",
            "--attention-backend", "torch", "--enforce-eager"]
    args = build_parser().parse_args(argv)
    assert engine_kwargs(args) == python_kwargs
    assert (EngineConfig.create(args.model, **engine_kwargs(args))
            == EngineConfig.create(str(tiny_llama), **python_kwargs))
    # a flag that is not given is not passed: the config's default applies, as in Python
    bare = build_parser().parse_args(["generate", "--model", str(tiny_llama), "--device", "cpu"])
    assert engine_kwargs(bare) == {"device": "cpu"}
    on = build_parser().parse_args(["serve", "--enable-prefix-caching", "--async-scheduling"])
    assert engine_kwargs(on) == {"enable_prefix_caching": True, "async_scheduling": True}


def test_speculative_config_reaches_the_engine_config(tiny_llama):
    from echo.entrypoints.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(
        ["generate", "--model", str(tiny_llama), "--speculative-config",
         '{"method": "ngram", "num_speculative_tokens": 3}'])
    config = EngineConfig.create(args.model, device="cpu", **engine_kwargs(args))
    assert config.speculative.num_speculative_tokens == 3


def test_vllm_flags_without_effect_are_taken_with_a_reason_and_pipeline_parallelism_refused(
        tiny_llama, capsys):
    from echo.entrypoints.cli import VLLM_FLAGS_WITHOUT_EFFECT, build_parser, flags_without_effect
    from echo.entrypoints.cli import main as cli_main

    line = ["serve", str(tiny_llama), "--enable-chunked-prefill", "--disable-log-stats",
            "--max-log-len", "100", "--download-dir", "/tmp", "--trust-remote-code",
            "--disable-frontend-multiprocessing", "--swap-space", "4",
            "--disable-hybrid-kv-cache-manager", "-pp", "1", "--kv-offloading-backend", "native"]
    notes = flags_without_effect(build_parser().parse_args(line))
    assert [n.split(" has no effect")[0] for n in notes] == [
        f"echo: {flag}" for flag, _, _ in VLLM_FLAGS_WITHOUT_EFFECT]
    assert flags_without_effect(build_parser().parse_args(["serve", str(tiny_llama)])) == []
    # refused before anything starts
    assert cli_main(["serve", str(tiny_llama), "--pipeline-parallel-size", "2"]) == 2
    assert "pipeline_parallel_size: echo has no pipeline parallelism" in capsys.readouterr().err
    assert cli_main(["serve", str(tiny_llama), "--kv-offloading-backend", "lmcache",
                     "--kv-offloading-size", "1"]) == 2
    assert "kv_offloading_backend: echo's host tier is its own" in capsys.readouterr().err
