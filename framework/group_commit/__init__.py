"""Group commit: handlers' SQL blocks as members of a shared transaction, committed together.

``ctx.sql_transaction(engine)`` in a running worker (PostgreSQL) goes through a
:class:`GroupCommitter`, one per engine in the process. It holds up to ``sql_connections``
connections ("links"). A handler entering the block takes a free link (or waits for one) and runs
as a *member* of the transaction open on it. Members of one transaction run one after another
(a block holds its link until it ends), so a member sees the writes of those before it and row
locks behave as in transactions run one after another.

What a member costs, in round trips to the database:

* nothing of its own in the common case: the *inbox rows* of a transaction's members are written
  with its ``COMMIT``, in one multi-row ``INSERT`` in the same round trip, and when handlers are
  waiting for the link the next transaction's ``BEGIN`` goes along too;
* a *possible duplicate* (``ctx.attempt > 1``: a retry or a redelivery, which an earlier run may
  have committed) first looks itself up in the inbox table (one round trip): found, it raises
  :class:`~framework.effects.AlreadyProcessed` and its block does not run;
* while blocks fail often (more than :data:`SAVEPOINT_ABOVE` of recent blocks, a moving average
  over about 64), every later member opens a ``SAVEPOINT`` first (one round trip), so a failing
  block rolls back alone. Below that a failure costs less than savepoints would: see below.

Outcomes stay per message:

* ``async with`` returns only once the member's transaction committed, so the runtime's publish
  and ack after the handler follow a durable commit, exactly as with one transaction per message;
* a block that raises is rolled back: to its savepoint when it has one; with the whole
  transaction when it is alone in it; otherwise the whole transaction is rolled back and the
  members before it raise :class:`RolledBackWithGroup`, which the runtime answers by running their
  handler again at once (not a failed attempt, no backoff). With 1% of blocks failing and groups
  of about 4 that is about 1.5 extra runs per 100 messages, where savepoints would cost a round
  trip on every message;
* a member whose message turns out to have been processed already (its inbox row collides at
  ``COMMIT``: a copy run concurrently, or one a worker committed before it died) rolls the
  transaction back: that member raises ``AlreadyProcessed``, the others run again;
* a failed ``COMMIT`` (a lost connection) fails every member with :class:`GroupCommitFailed`: a
  failed attempt, retried; the retry is a possible duplicate, so it finds its row if the commit
  had in fact happened. A crash before the commit redelivers every member, and the inbox rows make
  that safe. A handler that catches these errors still fails: the runtime checks the block's outcome.

When a member finishes, its transaction commits at once unless others can join it soon: while
handlers wait for a link, or while the next block is due and done within ``group_commit_wait``
(moving averages of the time between blocks finishing and of a block's time on its link: a
steady load of short blocks), when the link goes back free with its transaction open and the
next block to start joins it (no ``BEGIN`` of its own); a timer commits it ``group_commit_wait``
after its first member finished. At lower rates, or with blocks that take most of the wait,
nothing waits (lingering would delay the first member by the whole wait for hardly a joiner). Nor does
anything linger once every handler the process can run at once (``concurrency``) is a finished
member waiting for a commit: no block could join, so the open transactions commit at once.

The bound on added latency: a finished member waits at most ``group_commit_wait`` plus the rest of
the block running on its link at that moment (a transaction cannot commit half a block).
``group_commit_size=1`` is one transaction per message.

The framework's own statements go to the psycopg connection directly (no SQLAlchemy layers);
the handler's statements go through the SQLAlchemy connection it is given, on the same link.
Group transactions hold row locks longer than one message's: handlers that update rows in
different orders can deadlock across links, and PostgreSQL then fails one statement (after its
``deadlock_timeout``); that handler is retried like any failed attempt.
"""

from framework.group_commit.committer import SAVEPOINT_ABOVE, GroupCommitter
from framework.group_commit.engines import GroupCommits, current
from framework.group_commit.links import GroupCommitFailed, RolledBackWithGroup

__all__ = ["SAVEPOINT_ABOVE", "GroupCommitFailed", "GroupCommits", "GroupCommitter", "RolledBackWithGroup", "current"]
