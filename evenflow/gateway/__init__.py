"""The OpenAI-compatible front end: HTTP + SSE handlers (app.py), request models and error bodies
(protocol.py), the client of the worker fleet (client.py) and the router's pure cost function
and worker registry (router.py). Torch-free. `python -m evenflow.gateway`."""
