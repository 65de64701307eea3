"""The OTLP/HTTP trace receiver the tests use (evenflow/bench/otlp_receiver.py)."""

from evenflow.bench.otlp_receiver import OTLPReceiver, ReceivedSpan

__all__ = ["OTLPReceiver", "ReceivedSpan"]
