"""OpenAI response bodies for completions and chat completions, streamed or whole."""

from echo.outputs import CompletionOutput, Logprob


class ChoiceState:
    """One choice of a response: what has been sent so far and how to format the rest."""

    def __init__(self, index: int, tokenizer, chat: bool, return_token_ids: bool = False):
        self.index, self.tokenizer, self.chat = index, tokenizer, chat
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

    def absorb(self, completion: CompletionOutput) -> None:
        """Take a whole (non-streamed) completion."""
        self.text = completion.text
        self.token_ids = list(completion.token_ids)
        self.num_tokens = len(completion.token_ids)
        self.logprobs = list(completion.logprobs or [])
        self.logprob_token_ids = list(completion.token_ids[:len(self.logprobs)])
        self.finish_reason, self.stop_reason = completion.finish_reason, completion.stop_reason

    def delta(self, completion: CompletionOutput) -> dict | None:
        """The streamed choice for what is new in `completion` (None if nothing is). Once a
        choice's finish chunk is sent, nothing more is: with n > 1 the request's outputs keep
        carrying a finished choice until its siblings finish."""
        if self.finish_reason is not None:
            return None
        sent = len(self.logprobs)
        new_logprobs = (completion.logprobs or [])[sent:]
        new_logprob_ids = list(completion.token_ids[sent:sent + len(new_logprobs)])
        self.logprobs.extend(new_logprobs)
        self.logprob_token_ids.extend(new_logprob_ids)
        new_ids = list(completion.token_ids[self.num_tokens:]) if self.return_token_ids else []
        self.num_tokens = len(completion.token_ids)
        text = completion.delta_text
        self.text += text
        finish = completion.finish_reason
        if not text and finish is None and not new_logprobs and not new_ids:
            return None
        self.finish_reason, self.stop_reason = finish, completion.stop_reason
        return self._choice(text, list(zip(new_logprob_ids, new_logprobs)), finish,
                            completion.stop_reason, delta=True, token_ids=new_ids)

    def role_delta(self) -> dict:
        return {"index": self.index, "delta": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None}

    def final_choice(self) -> dict:
        return self._choice(self.text, list(zip(self.logprob_token_ids, self.logprobs)),
                            self.finish_reason, self.stop_reason,
                            delta=False, token_ids=self.token_ids)

    def _choice(self, text, logprobs: list[tuple[int, dict[int, Logprob]]], finish, stop_reason,
                delta: bool, token_ids: list[int]) -> dict:
        """`logprobs`: (sampled token id, its logprobs dict) per token."""
        choice = {"index": self.index, "logprobs": None, "finish_reason": finish,
                  "stop_reason": stop_reason}
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        if self.chat:
            message = {"content": text} if delta else {"role": "assistant", "content": text}
            choice["delta" if delta else "message"] = message
            if logprobs:
                choice["logprobs"] = {"content": [self._chat_logprob(t, e) for t, e in logprobs]}
        else:
            choice["text"] = text
            if logprobs:
                choice["logprobs"] = self._completion_logprobs(logprobs)
        return choice

    def _token(self, token_id: int, lp: Logprob) -> str:
        if lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([token_id]) if self.tokenizer else f"token_id:{token_id}"

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

    def _completion_logprobs(self, entries: list[tuple[int, dict[int, Logprob]]]) -> dict:
        tokens, token_logprobs, top = [], [], []
        for token_id, entry in entries:
            lp = entry[token_id]
            tokens.append(self._token(token_id, lp))
            token_logprobs.append(lp.logprob)
            top.append({self._token(t, p): p.logprob for t, p in entry.items()
                        if p.rank is not None} or None)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
                "text_offset": []}


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
