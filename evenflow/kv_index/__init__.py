"""Global KV-block index: events in (NATS) -> Redis; one-round-trip prefix match.

Not built yet: this package is reserved by the layout in DESIGN.md."""
