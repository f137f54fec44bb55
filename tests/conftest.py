"""Shared fixtures: tiny random Hugging Face models written by the tests themselves."""

import os

import pytest

# Triton kernels run under its CPU interpreter when there is no GPU; set before triton loads.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

from tests.helpers import write_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """Llama with GQA, untied embeddings and llama3 rope scaling."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama", tie=False,
                            rope_scaling=True)


@pytest.fixture(scope="session")
def tiny_llama_tied(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny_llama_tied"), "llama", tie=True)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """Qwen3 with head_dim != hidden / heads and tied embeddings."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", tie=True)


@pytest.fixture(scope="session")
def tiny_qwen3_untied(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_untied"), "qwen3", tie=False,
                            sharded=True)


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory):
    from echo.models.default_model import ensure_default_model
    from tests.helpers import write_tiny_chat_model

    return write_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"), ensure_default_model())


@pytest.fixture(scope="session")
def tiny_qwen3_kv1(tmp_path_factory):
    """Qwen3 with one KV head: at tensor_parallel_size=2 every rank holds a replica of it."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_kv1"), "qwen3", tie=True,
                            num_kv_heads=1)


@pytest.fixture(scope="session")
def tiny_llama_kv1_odd_vocab(tmp_path_factory):
    """Llama with one KV head, untied, and a vocabulary (127) that two ranks cannot split
    evenly: the last rank's slice of the embedding and LM head is padded."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny_llama_kv1_odd_vocab"), "llama",
                            tie=False, num_kv_heads=1, vocab_size=127)
