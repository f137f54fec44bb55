"""echo: a small, fast LLM serving engine."""

__version__ = "0.1.0"
__all__ = ["LLM", "AsyncClient", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput"]

# resolved on first use, so `import echo.sampling_params` (as a process's first import, say)
# does not pull in the model stack
_LAZY = {
    "LLM": "echo.entrypoints.llm",
    "AsyncClient": "echo.engine.async_client",
    "SamplingParams": "echo.sampling_params",
    "StructuredOutputsParams": "echo.sampling_params",
    "RequestOutput": "echo.outputs",
    "CompletionOutput": "echo.outputs",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'echo' has no attribute {name!r}")
