"""Oracle drafts for speculative decoding (method "oracle"), for benchmarking only: the
target's own next tokens, each right with a chosen probability, so that the mechanism's
speedup can be measured against the acceptance length with dummy weights
(tools/bench_spec.py).

The continuations are the target's greedy outputs recorded by an earlier run, keyed by prompt.
A call proposes, after the tokens generated so far, the continuation's next min(k, limit)
tokens; each position is right with probability `acceptance`, independently (a seeded RNG),
until the first one that is not, which is replaced by a deliberately wrong token; the positions
after it are proposed as recorded (a verification rejects them whatever they hold). So the
accepted drafts of a verification number A with P(A >= i) = p^i: E[A] = sum_{i=1..k} p^i, and
the mean acceptance length is 1 + E[A].

Why a wrong token rather than stopping before it: every call with a continuation then proposes
drafts, so every decode step is a verification, counted in the scheduler's spec_num_drafts, and
1 + spec_num_accepted_tokens / spec_num_drafts measures 1 + E[A] as it is. Had a wrong first
position proposed nothing, that step would decode without drafts and not be counted, and the
measured length would be the conditional 1 + E[A | A >= 1]. Why all k positions: a real
drafter's verification computes 1 + k tokens whatever it accepts, and a uniform 1 + k batch is
what the verification CUDA graphs are captured for.

Greedy verification is lossless, so outputs are the recorded ones as long as the target's
argmax over a verification's positions equals the recording's. Drafts follow the continuation
by position, not by content: a run that diverged from it (numerics) keeps being offered the
recorded tokens, mostly rejected, and its measured acceptance falls below the expected one.
With dummy weights the logits are near ties and a one-token decode step's numerics (GEMV,
decode attention) flip argmaxes against a 1 + k verification's, so tools/bench_spec.py records
the continuations from a verification run (acceptance 0: every token the first row of a
1 + k batch), whose rows agree with each other.
"""

import json
import random
from collections.abc import Sequence
from pathlib import Path


def wrong_token(token: int) -> int:
    """A token id other than token, in range whatever the vocabulary (vocab_size >= 2)."""
    return token - 1 if token > 0 else 1


def load_continuations(path: str | Path) -> dict[tuple[int, ...], list[int]]:
    """The oracle file: a JSON list of [prompt token ids, continuation token ids] pairs.
    ValueError naming speculative_config.oracle_path if it is not that."""
    name = "speculative_config.oracle_path"
    try:
        pairs = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{name}: cannot read {str(path)!r}: {e}") from e

    def ids(value) -> bool:
        return isinstance(value, list) and all(type(t) is int and t >= 0 for t in value)

    if not (isinstance(pairs, list) and all(
            isinstance(p, list) and len(p) == 2 and ids(p[0]) and p[0] and ids(p[1])
            for p in pairs)):
        raise ValueError(f"{name}: {str(path)!r} must hold a JSON list of [prompt ids, "
                         "continuation ids] pairs (non-empty prompts, token ids >= 0)")
    continuations: dict[tuple[int, ...], list[int]] = {}
    for prompt, continuation in pairs:
        key = tuple(prompt)
        if continuations.get(key, continuation) != continuation:
            raise ValueError(f"{name}: {str(path)!r} gives prompt {prompt[:8]}... two different "
                             "continuations")
        continuations[key] = continuation
    return continuations


def save_continuations(path: str | Path,
                       continuations: dict[tuple[int, ...], list[int]]) -> None:
    """Write what load_continuations reads."""
    Path(path).write_text(json.dumps([[list(p), list(c)] for p, c in continuations.items()]))


class OracleProposer:
    def __init__(self, num_speculative_tokens: int,
                 continuations: dict[tuple[int, ...], list[int]], acceptance: float,
                 seed: int = 0):
        if type(num_speculative_tokens) is not int or num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens: must be an integer >= 1, got "
                             f"{num_speculative_tokens!r}")
        if type(acceptance) not in (int, float) or not 0 <= acceptance <= 1:
            raise ValueError(f"acceptance: must be a number in [0, 1], got {acceptance!r}")
        self.num_speculative_tokens = num_speculative_tokens
        self.acceptance = float(acceptance)
        self.rng = random.Random(seed)
        # prompt length -> {prompt: continuation}, longest first: a call slices token_ids once
        # per distinct length (one in a benchmark) and looks the slice up
        by_length: dict[int, dict[tuple[int, ...], list[int]]] = {}
        for prompt, continuation in continuations.items():
            by_length.setdefault(len(prompt), {})[tuple(prompt)] = list(continuation)
        self._by_length = sorted(by_length.items(), reverse=True)

    def continuation(self, token_ids: Sequence[int]) -> tuple[int, list[int]] | None:
        """(prompt length, continuation) of the longest known prompt that token_ids start
        with; None if there is none."""
        for length, table in self._by_length:
            if length <= len(token_ids):
                found = table.get(tuple(token_ids[:length]))
                if found is not None:
                    return length, found
        return None

    def propose(self, token_ids: Sequence[int], limit: int | None = None) -> list[int]:
        """Drafts to follow token_ids (at most k, and at most limit): the continuation's next
        tokens while each draws right, then one wrong token in place of the first that draws
        wrong; [] for an unknown prompt or one generated to the end of its continuation."""
        k = self.num_speculative_tokens if limit is None else min(limit,
                                                                  self.num_speculative_tokens)
        if k <= 0:
            return []
        if hasattr(token_ids, "tolist"):  # a numpy array, as NgramProposer takes
            token_ids = token_ids.tolist()
        found = self.continuation(token_ids)
        if found is None:
            return []
        prompt_len, continuation = found
        generated = len(token_ids) - prompt_len
        drafts = list(continuation[generated:generated + k])
        for i, token in enumerate(drafts):
            if self.rng.random() >= self.acceptance:
                drafts[i] = wrong_token(token)
                break
        return drafts

    @staticmethod
    def expected_accepted(acceptance: float, k: int) -> float:
        """E[accepted drafts per verification] = sum_{i=1..k} p^i (limits and the end of a
        continuation aside)."""
        return sum(acceptance ** i for i in range(1, k + 1))
