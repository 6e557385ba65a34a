"""The HTTP front: the OpenAI-compatible app (`app.build_app`), its wire format (`protocol`,
`responses`, `streams_api`), the request guard (`middleware`) and uvicorn's server (`uvicorn_server`)."""

__all__ = ["app", "protocol", "responses", "streams_api", "middleware", "uvicorn_server"]
