"""Benchmarks behind ``make bench``: throughput, latency and memory of one worker process, each next
to the raw redis-py ceiling measured in the same run, plus the outbox relay and the Spark bridge.

Run ``python -m benchmarks --help``; ``benchmarks/README.md`` says what each one measures and how.
"""
