"""OpenAI response bodies for completions and chat completions, streamed or whole."""

from collections.abc import AsyncIterator
from dataclasses import dataclass

from echo.entrypoints.chat_output import ChatOutput
from echo.outputs import CompletionOutput, Logprob, RequestOutput


@dataclass
class EchoedPrompt:
    """What a completions choice reports of its prompt: `echo` puts the prompt before the text
    and, when the choice has logprobs, the prompt tokens' before the logprobs (the first token's
    None), as vLLM does; vLLM's `prompt_logprobs` field adds them to the choice as they are."""

    text: str
    token_ids: list[int]
    echo: bool = False
    drop_output: bool = False  # echo with max_tokens 0: the prompt alone
    with_logprobs: bool = False  # the choice reports logprobs
    report_prompt_logprobs: bool = False  # vLLM's choice["prompt_logprobs"]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # from the RequestOutput


async def with_prompt_logprobs(stream: AsyncIterator[RequestOutput],
                               prompts: list[EchoedPrompt]) -> AsyncIterator[RequestOutput]:
    """Pass a request's outputs on, handing its prompt logprobs to its choices' prompts."""
    try:
        async for out in stream:
            for prompt in prompts:
                prompt.prompt_logprobs = out.prompt_logprobs
            yield out
    finally:
        await stream.aclose()


def echo_prompts(body, prompts: list, prepared: list, states: list["ChoiceState"],
                 streams: list, tokenizer) -> list:
    """A completions request with echo or prompt_logprobs: give each choice its prompt
    (`prompts[i]` as sent, `prepared[i]` its (token ids, SamplingParams)); the streams of
    requests computing prompt logprobs hand them to their choices. Returns the streams."""
    result = []
    for i, (prompt, (ids, params), stream) in enumerate(zip(prompts, prepared, streams)):
        if isinstance(prompt, str) and params.truncate_prompt_tokens is None:
            text = prompt
        else:  # token ids, or a prompt cut to its last tokens: the text of what the model saw
            text = tokenizer.decode(ids) if tokenizer is not None else ""
        choice_prompts = [EchoedPrompt(text, ids, body.echo, body.echo_only,
                                       body.logprobs is not None,
                                       body.prompt_logprobs is not None)
                          for _ in range(body.n)]
        for state, choice_prompt in zip(states[i * body.n:(i + 1) * body.n], choice_prompts):
            state.prompt = choice_prompt
        if params.prompt_logprobs is not None:
            stream = with_prompt_logprobs(stream, choice_prompts)
        result.append(stream)
    return result


class ChoiceState:
    """One choice of a response: what has been sent so far and how to format the rest."""

    def __init__(self, index: int, tokenizer, chat: bool, return_token_ids: bool = False,
                 chat_output: ChatOutput | None = None, tool_calls_finish: bool = False,
                 tokens_as_ids: bool = False):
        """chat_output: splits a chat output into reasoning, content and tool calls;
        tool_calls_finish: a message with tool calls finishes with "tool_calls" (auto and
        required tool choices; a named choice finishes with "stop", as in OpenAI's API);
        tokens_as_ids: logprobs name tokens "token_id:ID" (vLLM's
        return_tokens_as_token_ids)."""
        self.index, self.tokenizer, self.chat = index, tokenizer, chat
        self.tokens_as_ids = tokens_as_ids
        self.chat_output = chat_output
        self.tool_calls_finish = tool_calls_finish
        # vLLM's extension: choices also carry their token ids, so a client can count and time
        # tokens that have no text (a model without a tokenizer, special tokens)
        self.return_token_ids = return_token_ids
        self.text = ""
        self.token_ids: list[int] = []  # whole output when absorbed; unused when streaming
        self.num_tokens = 0
        self.logprobs: list[dict[int, Logprob]] = []
        # the sampled token of each entry of `logprobs` (a logprobs dict also holds the top-N
        # alternatives, so the sampled token is known only from the completion's token ids)
        self.logprob_token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason = None
        self.prompt: EchoedPrompt | None = None  # completions with echo or prompt_logprobs
        self.num_echoed = 0  # leading entries of `logprobs` that are the prompt's
        self.lead_sent = False

    def _lead(self) -> tuple[str, list[tuple[int, dict[int, Logprob] | None]]]:
        """The prompt's text and logprob entries that go before the output (echo)."""
        prompt = self.prompt
        self.lead_sent = True
        if prompt is None or not prompt.echo:
            return "", []
        entries = []
        if prompt.with_logprobs:
            logprobs = prompt.prompt_logprobs or [None] * len(prompt.token_ids)
            entries = list(zip(prompt.token_ids, logprobs))
        self.logprob_token_ids.extend(t for t, _ in entries)
        self.logprobs.extend(e for _, e in entries)
        self.num_echoed = len(entries)
        return prompt.text, entries

    def absorb(self, completion: CompletionOutput) -> None:
        """Take a whole (non-streamed) completion."""
        self.text, _ = self._lead()
        if self.prompt is not None and self.prompt.drop_output:
            self.finish_reason, self.stop_reason = completion.finish_reason, completion.stop_reason
            return
        self.text += completion.text
        self.token_ids = list(completion.token_ids)
        self.num_tokens = len(completion.token_ids)
        logprobs = list(completion.logprobs or [])
        self.logprobs.extend(logprobs)
        self.logprob_token_ids.extend(completion.token_ids[:len(logprobs)])
        self.finish_reason, self.stop_reason = completion.finish_reason, completion.stop_reason

    def delta(self, completion: CompletionOutput) -> dict | None:
        """The streamed choice for what is new in `completion` (None if nothing is). Once a
        choice's finish chunk is sent, nothing more is: with n > 1 the request's outputs keep
        carrying a finished choice until its siblings finish."""
        if self.finish_reason is not None:
            return None
        text, entries = "", []
        if not self.lead_sent:
            text, entries = self._lead()  # the first chunk: the prompt's logprobs are all in
            self.text = text
        finish = completion.finish_reason
        if self.prompt is not None and self.prompt.drop_output:
            if not text and not entries and finish is None:
                return None
            self.finish_reason, self.stop_reason = finish, completion.stop_reason
            return self._choice(text, entries, finish, completion.stop_reason, delta=True,
                                token_ids=[])
        sent = len(self.logprobs) - self.num_echoed
        new_logprobs = (completion.logprobs or [])[sent:]
        new_logprob_ids = list(completion.token_ids[sent:sent + len(new_logprobs)])
        self.logprobs.extend(new_logprobs)
        self.logprob_token_ids.extend(new_logprob_ids)
        new_ids = list(completion.token_ids[self.num_tokens:]) if self.return_token_ids else []
        self.num_tokens = len(completion.token_ids)
        text += completion.delta_text
        self.text += completion.delta_text
        entries += zip(new_logprob_ids, new_logprobs)
        message = None
        if self.chat_output is not None:
            message = self.chat_output.delta(text, last=finish is not None)
            text = "" if not message else text
        if not text and finish is None and not entries and not new_ids:
            return None
        self.finish_reason, self.stop_reason = finish, completion.stop_reason
        return self._choice(text, entries, finish, completion.stop_reason, delta=True,
                            token_ids=new_ids, message=message)

    def role_delta(self) -> dict:
        return {"index": self.index, "delta": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None}

    def final_choice(self) -> dict:
        choice = self._choice(self.text, list(zip(self.logprob_token_ids, self.logprobs)),
                              self.finish_reason, self.stop_reason,
                              delta=False, token_ids=self.token_ids)
        if self.prompt is not None and self.prompt.report_prompt_logprobs:
            choice["prompt_logprobs"] = prompt_logprobs_json(self.prompt.prompt_logprobs)
        return choice

    def _choice(self, text, logprobs: list[tuple[int, dict[int, Logprob]]], finish, stop_reason,
                delta: bool, token_ids: list[int], message: dict | None = None) -> dict:
        """`logprobs`: (sampled token id, its logprobs dict) per token; `message`: a chat
        delta's fields, when chat_output made them."""
        choice = {"index": self.index, "logprobs": None, "finish_reason": finish,
                  "stop_reason": stop_reason}
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        if self.chat:
            if message is None and self.chat_output is not None and not delta:
                message = self.chat_output.message(text)
            if message is None:
                message = {"content": text}
            if not delta:
                message = {"role": "assistant", **message}
            if (finish == "stop" and self.tool_calls_finish and self.chat_output is not None
                    and self.chat_output.called_tools):
                choice["finish_reason"] = "tool_calls"
            choice["delta" if delta else "message"] = message
            if logprobs:
                choice["logprobs"] = {"content": [self._chat_logprob(t, e) for t, e in logprobs]}
        else:
            choice["text"] = text
            if logprobs:
                choice["logprobs"] = self._completion_logprobs(logprobs)
        return choice

    def _token(self, token_id: int, lp: Logprob) -> str:
        if lp.decoded_token is not None and not self.tokens_as_ids:
            return lp.decoded_token
        if self.tokenizer is None or self.tokens_as_ids:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def _chat_logprob(self, token_id: int, entry: dict[int, Logprob]) -> dict:
        # the sampled token's entry: ranked when it is in the top-N (at temperature > 0 not
        # necessarily rank 1), unranked when outside it
        lp = entry[token_id]
        token = self._token(token_id, lp)
        top = [{"token": self._token(t, p), "logprob": p.logprob,
                "bytes": list(self._token(t, p).encode())}
               for t, p in entry.items() if p.rank is not None]
        return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode()),
                "top_logprobs": top}

    def _completion_logprobs(self, entries: list[tuple[int, dict[int, Logprob] | None]]
                             ) -> dict:
        """Entries without logprobs (None: the first prompt token, echoed) keep their token."""
        tokens, token_logprobs, top = [], [], []
        for token_id, entry in entries:
            if entry is None:
                tokens.append(self._token(token_id, Logprob(0.0)))
                token_logprobs.append(None)
                top.append(None)
                continue
            lp = entry[token_id]
            tokens.append(self._token(token_id, lp))
            token_logprobs.append(lp.logprob)
            top.append({self._token(t, p): p.logprob for t, p in entry.items()
                        if p.rank is not None} or None)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
                "text_offset": []}


def prompt_logprobs_json(prompt_logprobs: list[dict[int, Logprob] | None] | None
                         ) -> list[dict | None] | None:
    """RequestOutput.prompt_logprobs as vLLM's server sends them: per prompt token None or
    {token id: {"logprob", "rank", "decoded_token"}}."""
    if prompt_logprobs is None:
        return None
    return [None if entry is None else
            {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for t, lp in entry.items()} for entry in prompt_logprobs]


def usage_json(prompt_tokens: int, states: list[ChoiceState], cached_tokens: int) -> dict:
    completion = sum(s.num_tokens for s in states)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chunk_json(kind: str, request_id: str, created: int, model: str, choice: dict) -> dict:
    return {"id": request_id, "object": kind, "created": created, "model": model,
            "choices": [choice]}


def final_json(kind: str, request_id: str, created: int, model: str,
               states: list[ChoiceState], usage: dict) -> dict:
    return {"id": request_id, "object": kind, "created": created, "model": model,
            "choices": [s.final_choice() for s in states], "usage": usage}
