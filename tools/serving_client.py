"""One streamed request to an OpenAI-compatible server, timed chunk by chunk: a small
server-sent-events parser and the request function tools/bench_serving.py runs many of.
"""

import json
from collections.abc import Callable

import httpx
from serving_metrics import RequestRecord


class SSEDecoder:
    """Incremental server-sent-events parser: feed text as it arrives in any pieces, get the
    `data` of each completed event (multi-line data joined with newlines; comments, `event:`,
    `id:` and `retry:` fields ignored). Lines end with LF or CRLF."""

    def __init__(self) -> None:
        self._partial = ""  # an incomplete line carried to the next feed
        self._data: list[str] = []  # data lines of the event being read

    def feed(self, text: str) -> list[str]:
        *lines, self._partial = (self._partial + text).split("\n")
        events = []
        for line in lines:
            line = line.removesuffix("\r")
            if not line:  # a blank line ends the event
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
                continue
            name, _, value = line.partition(":")
            if name == "data":
                self._data.append(value.removeprefix(" "))
        return events

    def flush(self) -> list[str]:
        """The last event when the stream ended without its blank line."""
        events = self.feed("\n\n") if self._partial or self._data else []
        self._partial, self._data = "", []
        return events


def chunk_text(chunk: dict) -> str:
    """The output text a completions or chat-completions chunk carries (reasoning included)."""
    text = ""
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        text += (choice.get("text") or delta.get("content") or delta.get("reasoning_content")
                 or delta.get("reasoning") or "")
    return text


class StreamError(Exception):
    """The server reported an error inside the stream."""


async def send_request(client: httpx.AsyncClient, url: str, payload: dict,
                       headers: dict[str, str], prompt_tokens: int, bench_start: float,
                       clock: Callable[[], float]) -> RequestRecord:
    """POST a streaming request and time it with `clock` (seconds; bench_start was read from
    it): TTFT at the first chunk with output, one inter-chunk gap for each later one, latency
    at the end of the response. Token counts come from the final usage chunk when the server
    sends one. Never raises: errors are recorded."""
    record = RequestRecord(prompt_tokens=prompt_tokens)
    start = clock()
    record.start = start - bench_start
    arrivals: list[float] = []
    usage: dict = {}
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                raise StreamError(f"HTTP {response.status_code}: {body[:300]}")
            decoder = SSEDecoder()
            async for text in response.aiter_text():
                now = clock()
                for data in decoder.feed(text):
                    _absorb(data, now, arrivals, usage)
            for data in decoder.flush():
                _absorb(data, clock(), arrivals, usage)
        record.latency = clock() - start
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        record.latency = clock() - start
        record.error = str(e) if isinstance(e, StreamError) else f"{type(e).__name__}: {e}"
        return record
    record.output_tokens = usage.get("completion_tokens") or len(arrivals)
    record.prompt_tokens = usage.get("prompt_tokens") or prompt_tokens
    if not arrivals:  # no visible text (e.g. only special tokens): the end is the first token
        arrivals = [start + record.latency]
    record.ttft = arrivals[0] - start
    record.itl = [b - a for a, b in zip(arrivals, arrivals[1:])]
    if record.output_tokens == 0:
        record.error = "empty output"
    return record


def _absorb(data: str, now: float, arrivals: list[float], usage: dict) -> None:
    if data == "[DONE]":
        return
    chunk = json.loads(data)
    if chunk.get("error"):
        error = chunk["error"]
        raise StreamError(str(error.get("message", error) if isinstance(error, dict) else error))
    # a token arrives with text, or as ids alone (return_token_ids, a model without a tokenizer)
    if chunk_text(chunk) or any(c.get("token_ids") for c in chunk.get("choices") or []):
        arrivals.append(now)
    if chunk.get("usage"):  # the last one wins (some servers send running totals)
        usage.update(chunk["usage"])
