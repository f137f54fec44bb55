"""The one rule for how long a request may get, for every entry point (the server, the Python
APIs, the scheduler): the prompt fits in max_model_len (a prompt of exactly max_model_len tokens
still yields one token: the KV of its last token never has to be computed), and the request
stops for length at min(prompt + max_tokens, max_model_len).
"""


def check_request_length(num_prompt_tokens: int, max_model_len: int,
                         max_tokens: int | None = None) -> None:
    """ValueError 'FIELD: ...' for an empty prompt, one longer than max_model_len, or, when
    max_tokens is given (the OpenAI server refuses rather than truncates, as vLLM's does),
    prompt + max_tokens over max_model_len."""
    if num_prompt_tokens == 0:
        raise ValueError("prompt: must not be empty")
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise ValueError(
            f"max_tokens: This model's maximum context length is {max_model_len} tokens. "
            f"However, you requested {num_prompt_tokens + max_tokens} tokens "
            f"({num_prompt_tokens} in the prompt, {max_tokens} in the completion). Please "
            "reduce the length of the prompt or completion.")
    if num_prompt_tokens > max_model_len:
        raise ValueError(f"prompt: length {num_prompt_tokens} exceeds max_model_len "
                         f"{max_model_len}")


def length_limit(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """The token count (prompt + output) at which a request stops for length."""
    if max_tokens is None:
        return max_model_len
    return min(num_prompt_tokens + max_tokens, max_model_len)


def check_kv_cache_holds(max_model_len: int, block_size: int, num_blocks: int) -> None:
    """At start-up: one sequence of max_model_len tokens must fit in the KV cache, else a
    request the frontend accepts could never be scheduled (vLLM refuses to start likewise).
    Refusing rather than clamping: the frontends validate against max_model_len before the
    engine has sized its cache, so a smaller value found then would reach them too late."""
    needed = -(-max_model_len // block_size)
    if needed > num_blocks:
        raise ValueError(
            f"max_model_len: {max_model_len} tokens need {needed} KV-cache blocks of "
            f"{block_size}, but the cache holds {num_blocks} ({num_blocks * block_size} "
            f"tokens): pass max_model_len <= {num_blocks * block_size}, or raise "
            "gpu_memory_utilization (or ECHO_CPU_KV_CACHE_GIB on a CPU), or use "
            "kv_cache_dtype='int8'")
