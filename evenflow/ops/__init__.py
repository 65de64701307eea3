"""What an operator runs against a live mesh: `evenflow doctor` (who is the straggler, and why)
and its helpers: the gateway's metrics read back, the straggler rule, the EP ranks' watch,
and an OTLP receiver for traces."""
