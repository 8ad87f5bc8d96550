"""`kvjax serve`: the OpenAI-compatible HTTP server over the schedulers of `kvjax.scheduling` (no scheduling of its own).

`app` (routes and formats), `schemas` (request checking, error objects), `engine` (the one scheduler loop),
`metrics` (Prometheus text), `launch` (putting them together under uvicorn).
"""
