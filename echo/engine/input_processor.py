"""Frontend-side input handling: tokenize prompts and chats, validate against the model limits.

Every check runs before anything is queued, and each error names what was wrong.
"""

from collections.abc import Sequence
from pathlib import Path

import jinja2

from echo.config import ModelConfig
from echo.core.length_limit import check_request_length
from echo.sampling_params import SamplingParams
from echo.structured_output.grammar_spec import build_grammar

Prompt = str | Sequence[int]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(config: ModelConfig):
    """The model folder's tokenizer, or None where there is none (presets, weight-only
    folders): such models take token-id prompts only."""
    folder = config.tokenizer
    if folder is None or not any((folder / name).exists() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def read_chat_template(template: str) -> str:
    """`--chat-template`: a file holding a Jinja template, or the template itself."""
    try:
        is_file = Path(template).expanduser().is_file()
    except OSError:  # too long to be a path
        is_file = False
    if is_file:
        return Path(template).expanduser().read_text()
    if "{{" in template or "{%" in template:
        return template
    raise FileNotFoundError(f"chat_template: {template!r} is neither a file nor a template")


class InputProcessor:
    def __init__(self, config: ModelConfig, tokenizer, chat_template: str | None = None):
        """chat_template: a Jinja template used instead of the tokenizer's own."""
        self.config = config
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    def need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise ValueError(f"{what}: model {self.config.model!r} has no tokenizer; "
                             "pass prompts as token ids")
        return self.tokenizer

    def tokenize(self, prompt: Prompt, field: str = "prompt") -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt; errors name `field` (the dict's key where the ids
        came in vLLM's {"prompt_token_ids": [...]})."""
        if isinstance(prompt, str):
            ids = self.need_tokenizer(field).encode(prompt)
            return prompt, list(ids)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return self.tokenize(prompt["prompt_token_ids"], "prompt_token_ids")
            return self.tokenize(prompt.get("prompt"), field)
        try:
            ids = list(prompt)
        except TypeError:
            raise ValueError(f"{field}: expected a string, a list of token ids or "
                             f"{{'prompt_token_ids': [...]}}, got {type(prompt).__name__}"
                             ) from None
        self.check_token_ids(ids, field)
        return None, ids

    def check_token_ids(self, ids: list, field: str) -> None:
        """ValueError naming `field` unless every id is an int in the model's vocabulary."""
        vocab = self.config.arch.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"{field}: every id must be an int in [0, {vocab})")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        tokenizer = self.need_tokenizer("messages")
        template = self.chat_template or tokenizer.chat_template
        if not template:
            raise ValueError(f"messages: model {self.config.model!r} has no chat template "
                             "(pass one with --chat-template)")
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise ValueError("messages: must be a list of {'role': ..., 'content': ...}")
        try:
            return tokenizer.apply_chat_template(messages, chat_template=template,
                                                 tokenize=False,
                                                 add_generation_prompt=add_generation_prompt,
                                                 **kwargs)
        except jinja2.TemplateError as e:  # e.g. the template's raise_exception(): bad roles
            raise ValueError(f"messages: the chat template refused them: {e}") from None

    def chat_to_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                    **template_kwargs) -> list[int]:
        """A conversation's prompt token ids: the chat template, then the tokenizer without
        special tokens (the template already holds them, BOS included)."""
        text = self.apply_chat_template(messages, add_generation_prompt, **template_kwargs)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def truncate(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt's last truncate_prompt_tokens ids (-1: max_model_len), as vLLM keeps
        them; all of them without it."""
        keep = params.truncate_prompt_tokens
        if keep is None:
            return prompt_token_ids
        limit = self.config.max_model_len
        if keep == -1:
            keep = limit
        if keep > limit:
            raise ValueError(f"SamplingParams.truncate_prompt_tokens: {keep} is greater than "
                             f"max_model_len ({limit})")
        return prompt_token_ids[-keep:]

    def validate(self, prompt_token_ids: list[int], params: SamplingParams,
                 max_tokens_must_fit: bool = False, structured_field: str | None = None) -> None:
        """What the engine would refuse; with max_tokens_must_fit (the OpenAI server), also a
        max_tokens that would run past max_model_len instead of stopping there.
        structured_field: the request field a grammar error names (the server's
        response_format, guided_regex, ...; structured_outputs.KIND by default)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params: expected SamplingParams, got {type(params)}")
        check_request_length(len(prompt_token_ids), self.config.max_model_len,
                             params.max_tokens if max_tokens_must_fit else None)
        params.update_from_tokenizer(self.tokenizer)  # bad_words into token ids, as vLLM
        params.check_token_ids(self.config.arch.vocab_size)
        if params.structured_outputs is not None:  # a bad grammar fails here, not in the core
            if self.tokenizer is None:
                raise ValueError(f"structured_outputs: model {self.config.model!r} has no "
                                 "tokenizer to compile a grammar against")
            build_grammar(params.structured_outputs, structured_field)
