import pytest
from transformers import AutoTokenizer


@pytest.fixture(scope="session")
def tokenizer():
    """The embedded SmolLM2's tokenizer: the vocabulary the grammars compile against."""
    from echo.models.default_model import ensure_default_model

    return AutoTokenizer.from_pretrained(str(ensure_default_model()))
