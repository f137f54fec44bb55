"""A vLLM-style command line starts echo's server, and the model folder's generation_config.json
gives the defaults of requests that leave a sampling field out."""

import json
import shutil

import httpx
import pytest

from tests.entrypoints.test_serve_process import start_server


@pytest.fixture(scope="module")
def greedy_by_default_model(tiny_chat_model, tmp_path_factory):
    """tiny_chat_model whose generation_config.json makes sampling greedy (top_k 1) and adds
    an extra EOS id (which a request that ignores EOS must not stop at)."""
    folder = tmp_path_factory.mktemp("greedy") / "model"
    shutil.copytree(tiny_chat_model, folder)
    (folder / "generation_config.json").write_text(json.dumps(
        {"top_k": 1, "temperature": 1.0, "eos_token_id": [0, 5]}))
    return folder


@pytest.fixture(scope="module")
def vllm_style_server(greedy_by_default_model):
    yield from start_server(
        str(greedy_by_default_model), "--generation-config", "auto", "--disable-log-requests",
        "--uvicorn-log-level", "warning", "--trust-remote-code", "--num-gpu-blocks-override",
        "256", names=("a", "b"), model_flag=False)


def test_vllm_command_line_and_generation_config_defaults(vllm_style_server):
    _, base = vllm_style_server
    with httpx.Client(base_url=base, timeout=60) as http:
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["a", "b"]

        def texts(**fields) -> list[str]:
            r = http.post("/v1/completions", json={"model": "b", "prompt": "Once upon",
                                                   "max_tokens": 12, "n": 3, "seed": 7,
                                                   "min_tokens": 12, **fields})
            assert r.status_code == 200, r.text
            return [c["text"] for c in r.json()["choices"]]

        by_default = texts()
        assert len(set(by_default)) == 1  # top_k 1 from the file: greedy, all choices alike
        assert by_default == texts(temperature=0)
        # a request's own value wins over the file's: top_k -1 samples again
        assert len(set(texts(top_k=-1))) > 1


def test_generation_config_values_are_checked_at_start_and_ignore_eos_ignores_extra_eos(
        tmp_path):
    from echo.engine.generation_config import load_generation_defaults
    from echo.entrypoints.openai_protocol import CompletionRequest

    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": "high"}))
    with pytest.raises(ValueError, match="generation_config: .*generation_config.json"):
        load_generation_defaults(str(tmp_path), None)
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"top_p": 0.5, "eos_token_id": [2, 7]}))
    defaults = load_generation_defaults("auto", tmp_path, model_eos_token_ids=(2,))
    assert defaults.values == {"top_p": 0.5} and defaults.extra_eos_token_ids == (7,)
    body = CompletionRequest(prompt="x", stop_token_ids=[9])
    assert body.sampling_params(4, None, defaults).stop_token_ids == [9, 7]
    ignoring = CompletionRequest(prompt="x", ignore_eos=True)
    assert ignoring.sampling_params(4, None, defaults).stop_token_ids == []  # as vLLM
    assert ignoring.sampling_params(4, None, defaults).top_p == 0.5
