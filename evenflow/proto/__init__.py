"""The wire contract of the mesh: block hashing (the one definition), and the text <-> token-id
contract (tokenizer, chat template, incremental detokenization). Imports nothing of ours."""
