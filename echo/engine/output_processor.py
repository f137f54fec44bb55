"""Frontend-side request state: detokenize, apply stop strings, fan n > 1 out and back in.

The core only sees token ids; this turns its EngineCoreOutputs into RequestOutputs. A stop
string is found here (the core never sees text), so the request is then reported back to the
caller as one to abort in the core.
"""

import dataclasses
from dataclasses import dataclass, field

import msgspec

from echo.core.step_results import EngineCoreOutput, LogprobsEntry, PromptLogprobs
from echo.engine.detokenizer import Detokenizer, make_detokenizer
from echo.engine.messages import EngineCoreRequest
from echo.outputs import CompletionOutput, Logprob, RequestOutput
from echo.sampling_params import SamplingParams


@dataclass
class _Child:
    """One sampled sequence of a request (a request with n > 1 has n of them)."""

    parent: "_Parent"
    completion: CompletionOutput
    params: SamplingParams
    detokenizer: Detokenizer | None
    # how much text / how many tokens earlier outputs reported (for deltas)
    sent_text: int = 0
    sent_tokens: int = 0

    def snapshot(self) -> CompletionOutput:
        """A copy for the caller, with what is new since the last snapshot. While unfinished,
        text that could be the start of a stop string is held back."""
        comp = self.completion
        end = len(comp.text)
        if not comp.finished and self.params.stop:
            end = max(self.sent_text, end - max(len(s) for s in self.params.stop) + 1)
        out = dataclasses.replace(
            comp, token_ids=list(comp.token_ids),
            logprobs=list(comp.logprobs) if comp.logprobs is not None else None,
            delta_text=comp.text[self.sent_text:end],
            delta_token_ids=comp.token_ids[self.sent_tokens:])
        self.sent_text, self.sent_tokens = end, len(comp.token_ids)
        return out


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[_Child] = field(default_factory=list)
    child_ids: list[str] = field(default_factory=list)  # the core's ids, parallel to children
    num_cached_tokens: int = 0
    error: str | None = None
    queue_time: float | None = None
    # [None] + one dict per later prompt token as they arrive, when prompt logprobs were asked
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        children = self.children
        if len(children) == 1:  # the usual case, without a generator: this runs per step
            return children[0].completion.finish_reason is not None
        return all(c.completion.finished for c in children)


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}#{index}"


class OutputProcessor:
    def __init__(self, tokenizer, stream: bool = True):
        """stream=False (offline batches): outputs are made only when a request finishes, and
        text is decoded once at the end unless stop strings need it token by token."""
        self.tokenizer = tokenizer
        self.stream = stream
        self._children: dict[str, _Child] = {}
        self._parents: dict[str, _Parent] = {}
        self._token_texts: dict[int, str] = {}  # one token's text, for logprobs

    def has_unfinished(self) -> bool:
        return bool(self._parents)

    def child_ids(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        return list(parent.child_ids) if parent is not None else []

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float,
                    priority: int = 0) -> list[EngineCoreRequest]:
        """Register a request; return the core requests (one per sample) to send."""
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        parent = _Parent(request_id, prompt, list(prompt_token_ids))
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        self._parents[request_id] = parent
        core_requests = []
        for i in range(params.n):
            child_params = params
            if params.n > 1:  # each sample differs; a given seed still reproduces all of them
                seed = None if params.seed is None else params.seed + i
                child_params = msgspec_replace(params, n=1, seed=seed)
            detok = None
            if self.tokenizer is not None and (self.stream or params.stop):
                detok = make_detokenizer(self.tokenizer, prompt_token_ids,
                                               params.skip_special_tokens)
            child_id = child_request_id(request_id, i, params.n)
            child = _Child(parent, CompletionOutput(index=i), child_params, detok)
            if params.logprobs is not None:
                child.completion.logprobs, child.completion.cumulative_logprob = [], 0.0
            parent.children.append(child)
            parent.child_ids.append(child_id)
            self._children[child_id] = child
            core_requests.append(EngineCoreRequest(child_id, list(prompt_token_ids),
                                                   child_params, arrival_time, priority))
        return core_requests

    def process_outputs(self, outputs: list[EngineCoreOutput]
                        ) -> tuple[list[RequestOutput], list[str]]:
        """Apply core outputs. Returns the RequestOutputs that changed, and child ids that a
        stop string finished (to abort in the core)."""
        changed: dict[str, _Parent] = {}
        to_abort: list[str] = []
        for out in outputs:
            child = self._children.get(out.request_id)
            if child is None or child.completion.finished:
                continue  # aborted here already; the core's late tokens are dropped
            if out.prompt_logprobs is not None:
                self._add_prompt_logprobs(child.parent, out.prompt_logprobs)
                if not out.new_token_ids and not out.finished:
                    continue  # a prefill chunk's: nothing to report yet
            if self._apply(child, out):
                to_abort.append(out.request_id)
            changed[child.parent.request_id] = child.parent
        results = []
        for parent in changed.values():
            finished = parent.finished
            if self.stream or finished:
                results.append(self._make_output(parent))
            if finished:
                self._forget(parent)
        return results, to_abort

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request here (the caller aborts its children in the core)."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        for child in parent.children:
            if not child.completion.finished:
                child.completion.finish_reason = "abort"
        result = self._make_output(parent)
        self._forget(parent)
        return result

    def _forget(self, parent: _Parent) -> None:
        self._parents.pop(parent.request_id, None)
        for cid in parent.child_ids:
            self._children.pop(cid, None)

    def _apply(self, child: _Child, out: EngineCoreOutput) -> bool:
        """Returns True when a stop string ended the request (the core must abort it)."""
        comp = child.completion
        if out.num_cached_tokens:
            child.parent.num_cached_tokens = out.num_cached_tokens
        if out.error:
            child.parent.error = out.error
        if out.queue_time is not None and child.parent.queue_time is None:
            child.parent.queue_time = out.queue_time
        new = out.new_token_ids
        # several tokens at once (accepted drafts) with stop strings: one at a time, so the
        # output ends at the token that completed a stop string, as without speculation
        pieces = ([new[i:i + 1] for i in range(len(new))]
                  if len(new) > 1 and child.detokenizer is not None and child.params.stop
                  else [new])
        done = 0
        for piece in pieces:
            comp.token_ids.extend(piece)
            if comp.logprobs is not None:
                for token, entry in zip(piece, out.new_logprobs[done:done + len(piece)]):
                    comp.logprobs.append(self._logprob_dict(token, entry))
                    comp.cumulative_logprob += entry.logprob
            done += len(piece)
            if child.detokenizer is not None:
                delta = child.detokenizer.add_tokens(piece)
                if out.finished and done == len(new):
                    delta += child.detokenizer.flush()
                if self._append_text(child, delta):
                    return True
        if child.detokenizer is None and out.finished and self.tokenizer is not None:
            comp.text = self.tokenizer.decode(comp.token_ids,
                                              skip_special_tokens=child.params.skip_special_tokens,
                                              clean_up_tokenization_spaces=False)
        if out.finished:
            comp.finish_reason, comp.stop_reason = out.finish_reason, out.stop_reason
        return False

    def _append_text(self, child: _Child, delta: str) -> bool:
        comp, params = child.completion, child.params
        if not delta:
            return False
        start = max(0, len(comp.text) - max((len(s) for s in params.stop), default=0) + 1)
        comp.text += delta
        for stop in params.stop:
            at = comp.text.find(stop, start)
            if at >= 0:
                end = at + len(stop) if params.include_stop_str_in_output else at
                comp.text = comp.text[:end]
                comp.finish_reason, comp.stop_reason = "stop", stop
                return True
        return False

    def _logprob_dict(self, token: int, entry: LogprobsEntry) -> dict[int, Logprob]:
        *texts, own = self._decode_each([*entry.top_token_ids, token])
        result = {t: Logprob(lp, rank + 1, text) for rank, (t, lp, text) in
                  enumerate(zip(entry.top_token_ids, entry.top_logprobs, texts))}
        if token not in result:
            result[token] = Logprob(entry.logprob, None, own)
        return result

    def _add_prompt_logprobs(self, parent: _Parent, chunk: PromptLogprobs) -> None:
        """Append a chunk's entries. Chunks arrive in prompt order; entries already held are
        skipped: every sample of n > 1 computes them, and so does a request recomputed after
        preemption."""
        held = parent.prompt_logprobs
        if held is None:
            return
        skip = len(held) - chunk.start
        if skip < 0 or skip >= len(chunk.logprobs):
            return
        prompt = parent.prompt_token_ids
        tokens = prompt[chunk.start + skip:chunk.start + len(chunk.logprobs)]
        tops = chunk.top_token_ids[skip:] if chunk.top_token_ids else [[]] * len(tokens)
        top_lps = chunk.top_logprobs[skip:] if chunk.top_logprobs else [[]] * len(tokens)
        text = self._decode_each([t for token, ids in zip(tokens, tops) for t in (token, *ids)])
        at = 0
        for token, lp, rank, ids, lps in zip(tokens, chunk.logprobs[skip:], chunk.ranks[skip:],
                                             tops, top_lps):
            # the prompt token first, as vLLM orders them
            entry = {token: Logprob(lp, rank, text[at])}
            for r, (t, tlp) in enumerate(zip(ids, lps), 1):
                if t not in entry:
                    entry[t] = Logprob(tlp, r, text[at + r])
            held.append(entry)
            at += 1 + len(ids)

    def _decode_each(self, token_ids: list[int]) -> list[str | None]:
        """Each token's own text, through a cache bounded by the vocabulary: logprobs name the
        same tokens again and again (each sampled or prompt token and its top-N)."""
        if self.tokenizer is None:
            return [None] * len(token_ids)
        cache = self._token_texts
        missing = list({t for t in token_ids if t not in cache})
        if missing:
            cache.update(zip(missing, self.tokenizer.batch_decode([[t] for t in missing])))
        return [cache[t] for t in token_ids]

    def _make_output(self, parent: _Parent) -> RequestOutput:
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=[c.snapshot() for c in parent.children],
            finished=parent.finished,
            num_cached_tokens=parent.num_cached_tokens,
            error=parent.error,
            queue_time=parent.queue_time,
            # complete by now (an output carrying only a prefill chunk makes no RequestOutput)
            # and never changed after: shared, not copied every step
            prompt_logprobs=parent.prompt_logprobs,
        )


def msgspec_replace(params: SamplingParams, **changes) -> SamplingParams:
    return msgspec.structs.replace(params, **changes)
