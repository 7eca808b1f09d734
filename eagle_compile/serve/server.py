"""uvicorn around the app: `serve` blocks (the command line), `BackgroundServer` runs in a thread (tests,
benchmarks) on a free port of 127.0.0.1 and stops, engine included, when its `with` block ends."""

from __future__ import annotations

import threading
import time

import uvicorn

from eagle_compile.serve.app import create_app
from eagle_compile.serve.engine import Engine


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8000) -> None:
    engine.start()
    try:
        uvicorn.run(create_app(engine), host=host, port=port, log_level="info")
    finally:
        engine.stop()


class BackgroundServer:
    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0, start_seconds: float = 30.0) -> None:
        self.engine = engine
        config = uvicorn.Config(create_app(engine), host=host, port=port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="eagle31-uvicorn", daemon=True)
        self.start_seconds = start_seconds

    def __enter__(self) -> BackgroundServer:
        self.engine.start()
        self.thread.start()
        deadline = time.monotonic() + self.start_seconds
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"uvicorn did not start within {self.start_seconds} s")
            time.sleep(0.02)
        return self

    @property
    def url(self) -> str:
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.engine.stop()
