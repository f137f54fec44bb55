"""The command line: `python -m echo generate` and its errors."""

import subprocess
import sys

import pytest


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


@pytest.mark.parametrize("flag", ["--tensor-parallel-size", "--tp", "-tp", "--tp-size"])
def test_tp_flags_of_vllm_and_sglang_are_understood(flag):
    from echo.entrypoints.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["serve", flag, "2"])
    assert engine_kwargs(args) == {"tensor_parallel_size": 2}
