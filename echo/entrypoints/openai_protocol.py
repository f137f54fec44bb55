"""OpenAI request bodies (pydantic) and their translation into SamplingParams.

Unknown fields are ignored, as OpenAI-compatible servers commonly do; known fields that echo
cannot honour (best_of > n, use_beam_search, suffix, prompt_embeds, non-text message parts) are
rejected with a 400 that names them, so nothing silently behaves differently from what was
asked.

Structured outputs come in four spellings, at most one per request: OpenAI's response_format
(json_object, json_schema), vLLM's structured_outputs object, its older guided_* fields, and
(chat) a required or named tool_choice (echo/entrypoints/tool_calls.py).
"""

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from echo.engine.generation_config import GenerationDefaults
from echo.entrypoints.tool_calls import ToolPlan
from echo.sampling_params import STRUCTURED_KINDS, SamplingParams, StructuredOutputsParams

NO_DEFAULTS = GenerationDefaults()


def first_non_utf8(value, path: str = "") -> str | None:
    """The path of the first string under value that UTF-8 cannot encode (JSON lets a client
    send a lone surrogate, "\\ud800", which no tokenizer or response can carry). Iterative:
    an extra field may nest as deep as the JSON parser allows."""
    stack = [(path, value)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
            continue
        if isinstance(value, BaseModel):
            items = {**value.__dict__, **(value.__pydantic_extra__ or {})}.items()
        elif isinstance(value, dict):
            items = value.items()
        elif isinstance(value, list):
            items = ((f"[{i}]", v) for i, v in enumerate(value))
        else:
            continue
        children = []
        for key, item in items:
            key = str(key)
            children.append((f"{path}{key}" if key.startswith("[") or not path
                             else f"{path}.{key}", item))
        stack.extend(reversed(children))
    return None


class Utf8Only(BaseModel):
    """A request body whose every string UTF-8 can encode (tokenizers and responses cannot
    carry a lone surrogate): the base of every body with text in it."""

    @model_validator(mode="after")
    def _utf8_only(self):
        path = first_non_utf8(self, "")
        if path is not None:
            raise ValueError(f"{path}: not valid UTF-8 (a lone surrogate)")
        return self


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


# apply_chat_template's own arguments: chat_template_kwargs may not set them
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class ChatTemplateFields(Utf8Only):
    """How a conversation becomes a prompt: shared by chat completions and /tokenize."""

    model_config = ConfigDict(extra="ignore")

    messages: list["ChatMessage"] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # leave the last (assistant) message open
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict] | None = None  # the template tells the model how to call them

    @model_validator(mode="after")
    def _template_options(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: needs add_generation_prompt set to false")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message: the last message must be the "
                             "assistant's")
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or {}))
        if reserved:
            raise ValueError(f"chat_template_kwargs: {', '.join(reserved)} cannot be set here")
        return self

    def message_dicts(self) -> list[dict]:
        """The messages as the chat template sees them: every field a client sent (tool_calls,
        tool_call_id, name, ...) kept, text parts joined by newlines as vLLM joins them."""
        result = []
        for m in self.messages:
            message = m.model_dump(exclude_none=True)
            content = m.content
            if isinstance(content, list):  # text parts only: unsupported() refuses the others
                content = "\n".join(part.get("text", "") for part in content)
            message["content"] = content or ""
            result.append(message)
        return result

    def template_kwargs(self) -> dict:
        kwargs = {"add_generation_prompt": self.add_generation_prompt,
                  "continue_final_message": self.continue_final_message,
                  **(self.chat_template_kwargs or {})}
        if self.tools:
            kwargs["tools"] = self.tools
        return kwargs


class _SamplingFields(Utf8Only):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False  # vLLM's extension: choices carry their output token ids
    # vLLM's: logprobs name their tokens "token_id:ID", for tokens that are not valid text
    return_tokens_as_token_ids: bool = False
    priority: int = 0  # vLLM's: lower first; other than 0 needs --scheduling-policy priority
    stream: bool = False
    stream_options: StreamOptions | None = None
    best_of: int | None = None
    use_beam_search: bool = False  # vLLM's; refused: echo samples
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (a string) -> bias
    allowed_token_ids: list[int] | None = None  # vLLM's extensions
    bad_words: list[str] | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's
    guided_json: str | dict | None = None  # vLLM's older spellings
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens

    @field_validator("stream_options")
    @classmethod
    def _needs_stream(cls, value: StreamOptions | None,
                      info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):  # as OpenAI's API
            raise ValueError("stream_options needs stream set to true")
        return value

    def unsupported(self) -> str | None:
        """The name of a field echo cannot honour, if one was set."""
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        if self.use_beam_search:
            return "use_beam_search"
        return None

    def structured_constraint(self) -> tuple[str, StructuredOutputsParams] | None:
        """The request's structured output constraint and the field it came from (ValueError
        naming it when two are given or one is malformed); None without one. Its grammar is
        checked once, by InputProcessor.validate, under that field's name."""
        found = []
        fmt = self.response_format
        if fmt is not None and fmt.get("type", "text") != "text":
            found.append(_response_format(fmt))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", _structured_outputs(self.structured_outputs)))
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                found.append((f"guided_{kind}", _structured(f"guided_{kind}", **{kind: value})))
        found.extend(self._tool_constraint())
        if len(found) > 1:
            raise ValueError(f"{found[1][0]}: only one structured output constraint per "
                             f"request, but {found[0][0]} is given too")
        if not found:
            return None
        return found[0]

    def _tool_constraint(self) -> list[tuple[str, StructuredOutputsParams]]:
        return []  # chat completions': a required or named tool_choice

    def grammar_field(self, field: str) -> str:
        """The field named when the grammar of the constraint from `field` does not compile."""
        return field

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: GenerationDefaults = NO_DEFAULTS) -> SamplingParams:
        """The request's SamplingParams; a field it leaves out takes the model's generation
        config default (`defaults`), else echo's."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

        def pick(name: str, fallback):
            value = getattr(self, name)
            return defaults.get(name, fallback) if value is None else value

        constraint = self.structured_constraint()
        stop_token_ids = list(self.stop_token_ids or [])
        if not self.ignore_eos:  # extra EOS ids are EOS: ignore_eos ignores them too (as vLLM)
            stop_token_ids += [t for t in defaults.extra_eos_token_ids
                               if t not in stop_token_ids]
        return SamplingParams(
            n=self.n,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", -1),
            min_p=pick("min_p", 0.0),
            seed=self.seed,
            max_tokens=max_tokens if max_tokens is not None else defaults.get("max_tokens", None),
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=stop_token_ids,
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=pick("repetition_penalty", 1.0),
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.logit_bias_ids(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words or None,
            structured_outputs=constraint[1] if constraint else None,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
        )

    def logit_bias_ids(self) -> dict[int, float] | None:
        """logit_bias with its keys (JSON object keys: strings) as token ids."""
        if not self.logit_bias:
            return None
        result = {}
        for key, bias in self.logit_bias.items():
            try:
                result[int(key)] = bias
            except ValueError:
                raise ValueError(f"logit_bias: keys must be token ids, got {key!r}") from None
        return result


def _structured(field: str, **kwargs) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except (ValueError, TypeError) as e:
        message = str(e).removeprefix("SamplingParams.").removeprefix("structured_outputs: ")
        raise ValueError(f"{field}: {message}") from None


def _response_format(fmt: dict) -> tuple[str, StructuredOutputsParams]:
    kind = fmt.get("type")
    if kind == "json_object":
        return "response_format", _structured("response_format", json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise ValueError("response_format.json_schema: must be an object with a schema")
        schema = spec.get("schema")
        if schema is None:  # OpenAI's name-only form: any JSON object
            return "response_format", _structured("response_format", json_object=True)
        return ("response_format.json_schema.schema",
                _structured("response_format.json_schema.schema", json=json.dumps(schema)))
    if kind == "structural_tag":
        return "response_format", _structured("response_format", structural_tag=json.dumps(fmt))
    raise ValueError(f"response_format.type: {kind!r} is not one of text, json_object, "
                     "json_schema, structural_tag")


def _structured_outputs(value: dict) -> StructuredOutputsParams:
    known = {*STRUCTURED_KINDS, "disable_any_whitespace"}
    unknown = sorted(set(value) - known - {"whitespace_pattern", "disable_fallback",
                                           "disable_additional_properties"})
    if unknown:
        raise ValueError(f"structured_outputs: unknown field(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(known))}")
    kwargs = {k: v for k, v in value.items() if k in known}
    if isinstance(kwargs.get("structural_tag"), dict):
        kwargs["structural_tag"] = json.dumps(kwargs["structural_tag"])
    return _structured("structured_outputs", **kwargs)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=20)
    # the prompt leads the text (and, with logprobs, the logprobs: the first token's None)
    echo: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)  # vLLM's, on the choice
    suffix: str | None = None
    prompt_embeds: Any = None  # vLLM's (--enable-prompt-embeds); refused: echo takes tokens

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self):
        if self.prompt_logprobs is not None and self.stream:  # as vLLM
            raise ValueError("prompt_logprobs: not available when stream is true")
        return self

    def unsupported(self) -> str | None:
        if self.suffix:
            return "suffix"
        if self.prompt_embeds is not None:
            return "prompt_embeds"
        return super().unsupported()

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0 (vLLM allows 0 only then): the prompt alone comes back."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: GenerationDefaults = NO_DEFAULTS) -> SamplingParams:
        if self.echo_only and max_tokens == 0:
            max_tokens = 1  # as vLLM: one token is generated and left out of the response
        params = super().sampling_params(max_tokens, logprobs, defaults)
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = logprobs  # echoed prompt tokens carry logprobs like the rest
        params.prompt_logprobs = prompt_logprobs  # in [0, 20] (the fields' bounds)
        return params

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(ChatTemplateFields, _SamplingFields):
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tool_choice: str | dict | None = None  # none, auto (the default with tools), required, named
    parallel_tool_calls: bool | None = None  # accepted; a required choice may make several
    echo: bool = False  # vLLM's: a reply to an assistant's last message starts with it

    def echoed_text(self) -> str:
        """What each choice's content starts with: with echo, the last message's text when it
        is the assistant's (the reply's own role, as vLLM has it), else nothing."""
        if not self.echo or self.messages[-1].role != "assistant":
            return ""
        return self.message_dicts()[-1]["content"]

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):  # as OpenAI's API: not silently dropped
            raise ValueError("top_logprobs needs logprobs set to true")
        return value

    def tool_plan(self) -> ToolPlan:
        return ToolPlan.create(self.tools, self.tool_choice)

    def _tool_constraint(self) -> list[tuple[str, StructuredOutputsParams]]:
        constraint = self.tool_plan().constraint()
        return [("tool_choice", constraint)] if constraint is not None else []

    def grammar_field(self, field: str) -> str:
        # a required or named tool_choice compiles the tools' parameter schemas
        return self.tool_plan().constraint_field() if field == "tool_choice" else field

    def unsupported(self) -> str | None:
        for i, message in enumerate(self.messages):  # text-only models: no image or audio parts
            if isinstance(message.content, list) and any(
                    part.get("type") != "text" for part in message.content):
                return f"messages[{i}].content"
        return super().unsupported()

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


class TokenizeRequest(Utf8Only):
    """vLLM's /tokenize body: a prompt, or messages through the chat template."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatTemplateFields):
    model: str | None = None
    add_special_tokens: bool = False  # the template holds them
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]
