"""A server in a background thread of this process: for tests, benchmarks and notebooks."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator


@contextlib.contextmanager
def serve_in_thread(app, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0) -> Iterator[str]:
    """Run ``app`` with uvicorn until the block ends; yields its base URL. Port 0 picks a free port."""
    import uvicorn

    from .lifecycle import server_config

    if port == 0:
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
    server = uvicorn.Server(server_config(app, host=host, port=port))  # as `specdeploy serve` runs it
    thread = threading.Thread(target=server.run, name="specdeploy-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=timeout)
