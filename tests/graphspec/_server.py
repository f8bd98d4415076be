"""A graphspec server on a free 127.0.0.1 port in a background thread, for tests; stopped on exit."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

from graphspec.engine import Engine
from graphspec.server import create_app


@contextlib.contextmanager
def running_server(engine: Engine, model_name: str = "tiny", **kwargs):
    """Yields the base URL (``http://127.0.0.1:PORT``) of a server over ``engine``; stops it after."""
    import uvicorn

    app = create_app(engine, model_name, **kwargs)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
