"""The example shop: six services built the way a team would build them, one small module each.

``orders`` (an HTTP API writing rows and events through the outbox, and a service following each
order's state), ``billing`` (charges exactly once with the SQL inbox, a flaky gateway retried with
jittered backoff, invalid cards dead-lettered), ``inventory`` (stock reserved per SKU in order
across processes, never negative), ``shipping`` (a saga per order: ship, or cancel with
compensating commands), ``notifications`` (a command queue, a flaky mailer, a daily digest) and
``analytics`` (Spark over the event log, exported to Parquet). :mod:`.messages` is the contract
they share, :mod:`.db` their tables. ``make demo`` runs them all (``example_services/demo``).
"""
