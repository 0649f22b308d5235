"""The TCP proxy of the network-fault tests now ships with the framework (``framework.faults.netproxy``)."""

from framework.faults.netproxy import NetProxy

__all__ = ["NetProxy"]
