"""What callers construct: the offline `LLM` API (llm.py), the mock engine (mock.py) and
`build_engine` (factory.py)."""
