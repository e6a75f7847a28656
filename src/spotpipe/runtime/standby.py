"""A node waiting to be placed: its join board, read in order until an answer places it.

A node that joins a running job, and one the job put on standby, waits here. The coordinator
writes to the node's own join board, in order: the plans that will place it, known ahead
(`Prepare`, whose groups the node forms while it waits), and its answers (`JoinAnswer`).
The wait ends in the generation whose Decision places the node, or in None (the job finished,
or a preemption notice came while it waited: it leaves before any plan places a node about to
go), or raises JoinRefused. Reading the board ahead in order, one reader for the node's life,
is what lets a node placed, put on standby and placed again wait for its new answer.
"""

from __future__ import annotations

from collections.abc import Callable

from spotpipe.notices import NoticeWatcher
from spotpipe.protocol import JoinAnswer, Prepare, Refused
from spotpipe.runtime.activity import Activity
from spotpipe.store.mailbox import Outbox
from spotpipe.store.watchers import BoardReader

# how often a node waiting on standby looks at its notices: a SIGTERM's handler only sets a
# flag (taking a lock there could deadlock against the code it interrupted), so the wait
# returns now and then to read it; a notice gives a node 30 s (AWS: 2 min) to go
NOTICE_CHECK_S = 0.25


class JoinRefused(Exception):
    """The job refused this node (token, model or configuration differ): it exits."""


class Standby:
    def __init__(self, answers: BoardReader, incarnation: str, *, outbox: Outbox,
                 notices: NoticeWatcher, activity: Activity, prepare: Callable[[Prepare], None],
                 refused: Callable[[Refused], None]) -> None:
        """`answers`: the reader of this node's join board (writers: the coordinator);
        `incarnation`: this process's, which a refusal must be addressed to."""
        self.answers, self.incarnation = answers, incarnation
        self.outbox, self.notices = outbox, notices
        self.activity, self.prepare, self.refused = activity, prepare, refused

    def wait(self) -> int | None:
        """The generation whose Decision places this node; None: the job finished, or a
        notice came (a `leaving_standby` event says so)."""
        while True:
            with self.activity.waiting():
                item = self.answers.next(NOTICE_CHECK_S)
            if item is None:
                if self.notices.is_set():
                    # nothing here to hand over: leave now, so that no plan places a node
                    # about to go (the coordinator takes a joiner off its list at its
                    # notice, and counts a waiting node's exit out without a plan)
                    self.outbox.event("leaving_standby", source=self.notices.source)
                    return None
                continue
            index, opened = item
            if isinstance(opened, Refused):
                self._unreadable(opened)
                continue
            answer = opened.message
            if isinstance(answer, Prepare):  # the plan that will place this node, known ahead
                self.prepare(answer)
                continue
            assert isinstance(answer, JoinAnswer)
            if answer.outcome == "refused":
                if answer.to != self.incarnation:
                    # the answer to a request another process made in this node's name
                    self.refused(Refused(f"a join refusal of another request ({answer.to!r})",
                                         opened.writer))
                    continue
                raise JoinRefused(answer.message)
            if answer.outcome == "finished":
                return None
            return answer.generation

    def _unreadable(self, why: Refused) -> None:
        """A record on this node's join board that does not open under its key. A node whose
        token differs from the job's learns it so: the job's refusal of its request does not
        open here, and says it is a refusal addressed to this process (its incarnation). This
        node quits on such a record (a forger could write the same; without the key nothing
        here can be checked either way); any other is refused with an event, and it waits on
        (anyone can write into the store: junk on its board says nothing of its token)."""
        self.refused(why)
        said = why.claimed.get("body")
        if (why.claimed.get("type") != JoinAnswer.TYPE or not isinstance(said, dict)
                or said.get("outcome") != "refused" or said.get("to") != self.incarnation):
            return
        message = said.get("message")
        raise JoinRefused(f"{str(message)[:300] if message else 'the job answered'} (the "
                          "answer does not open under this node's key: its SPOTPIPE_JOIN_TOKEN "
                          "differs from the job's)")
