"""The wire contract of the mesh: message types and their codec (messages.py, codec.py), NATS
subjects, error codes, the KV hand-off's byte layout (kv_handoff.py), block hashing (the one
definition), and the text <-> token-id contract (tokenizer, chat template, incremental
detokenization). Imports nothing of ours."""
