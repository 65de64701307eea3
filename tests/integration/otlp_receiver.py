"""The OTLP/HTTP trace receiver the tests use (evenflow/ops/otlp_receiver.py)."""

from evenflow.ops.otlp_receiver import OTLPReceiver, ReceivedSpan

__all__ = ["OTLPReceiver", "ReceivedSpan"]
