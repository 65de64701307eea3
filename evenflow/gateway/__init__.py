"""OpenAI-compatible HTTP + SSE front end, tokenizer/detokenizer, router.

Not built yet: this package is reserved by the layout in DESIGN.md."""
