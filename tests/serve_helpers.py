"""Running an app of `cellm.serve` on 127.0.0.1 for the official `openai` client."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serving(app: Any) -> Iterator[tuple[str, int]]:
    """Serves `app` in a thread; yields (base URL of the OpenAI routes, port)."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    http = uvicorn.Server(config)
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not http.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert http.started, "the server did not start"
    try:
        yield f"http://127.0.0.1:{port}/v1", port
    finally:
        http.should_exit = True
        thread.join(timeout=10)
