"""The waiting queue of scheduling_policy="priority": a heap by (priority, arrival).

Under fcfs the scheduler's waiting queue is a plain deque. This class offers the few deque
operations the scheduler uses, so the scheduler's code is the same for both; but here the
order is the key's, not where a request was put: append and appendleft (a preempted request's
requeue) both insert by (priority, arrival_time), ties in the order of insertion. Peeking is
O(1), inserting and popping O(log n); remove (a preempted request that finishes with its token
in flight) is O(n), as deque.remove; aborts rebuild the queue without the aborted requests.
"""

import heapq
import itertools
from collections.abc import Iterable, Iterator

from echo.core.request import Request


def priority_key(request: Request) -> tuple[int, float]:
    """The order of the priority policy: lower priority value first, then earlier arrival."""
    return request.priority, request.arrival_time


class PriorityWaitingQueue:
    def __init__(self, requests: Iterable[Request] = ()):
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()  # ties: insertion order (never compares Requests)
        for request in requests:
            self.append(request)

    def append(self, request: Request) -> None:
        heapq.heappush(self._heap, (*priority_key(request), next(self._seq), request))

    appendleft = append  # a requeued request goes where its key puts it

    def popleft(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def __getitem__(self, index: int) -> Request:
        if index != 0:
            raise IndexError("only the head of a priority queue can be read")
        return self._heap[0][-1]

    def remove(self, request: Request) -> None:
        for i, entry in enumerate(self._heap):
            if entry[-1] is request:
                last = self._heap.pop()
                if i < len(self._heap):
                    self._heap[i] = last
                    heapq.heapify(self._heap)
                return
        raise ValueError(f"{request.request_id!r} is not waiting")

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In the order they would be admitted."""
        return (entry[-1] for entry in sorted(self._heap))
