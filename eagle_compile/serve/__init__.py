"""`eagle31 serve`: an OpenAI-compatible HTTP server over the speculative decoder (DESIGN.md §8).

Needs the `serve` extra (starlette, uvicorn, prometheus-client). One concept per file: `protocol.py` (request
validation, response shapes), `row.py` (one request in the engine), `stops.py` (per-row stops of a batch),
`scheduler.py` (which requests decode together), `engine.py` (the worker thread and the batching rules),
`metrics.py` (Prometheus), `app.py` (routes, streaming), `server.py` (uvicorn, in the foreground or a thread).
"""
