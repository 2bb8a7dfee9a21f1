"""Searches answered by the running daemon: a query embedded by the model it holds, not by a second copy.

The daemon listens on a Unix socket in its home (`Home.socket`, owner-only like the home). A connection
carries one request and one response, each one line of JSON:

    {"embed": "<query>"}  ->  {"vectors_key": "<model key>", "vector": [...]}  or  {"error": "<why>"}

The engine has one user, the worker's thread. The listening threads never touch it: they hand a request
to the worker and wait. The worker answers between two chunks of the document it is processing (the
pipeline's progress callback, where no forward pass is running) and, when idle, at once. A paused job
(its check blocks inside a forward pass) or a long summary decode can hold a query up: after
ANSWER_SECONDS the daemon says it is busy and `npumoed search` loads the model itself.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from npumoe.jobs.errors import Failure, Lost, Stop

log = logging.getLogger(__name__)

ANSWER_SECONDS = 20.0  # the longest a query waits for the worker before the daemon answers that it is busy
CONNECT_SECONDS = 2.0  # a daemon that does not accept within this long is not answering
MAX_REQUEST_BYTES = 64 * 1024
MAX_REPLY_BYTES = 16 * 2**20  # a vector as JSON: about 20 bytes a dimension
MAX_SOCKET_PATH = 100  # AF_UNIX paths: 104 bytes on macOS, 108 on Linux, the final NUL included


class NoAnswer(RuntimeError):
    """The daemon's socket is there but no answer came: the words say why."""


Embed = Callable[[str], tuple[str, np.ndarray]]  # query -> (the index's vectors key, its vector)


@dataclass
class _Request:
    text: str
    done: threading.Event = field(default_factory=threading.Event)
    reply: dict[str, Any] | None = None
    abandoned: bool = False  # its connection gave up waiting: not worth the engine's time


class QueryServer:
    """The daemon's side: listening threads queue requests, `answer` (on the worker's thread) embeds them."""

    def __init__(self, path: Path, wake: Callable[[], None]) -> None:
        self.path = path
        self.wake = wake  # ends the worker's idle wait, so an idle daemon answers at once
        self._pending: queue.Queue[_Request] = queue.Queue()
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None

    def start(self) -> None:
        """Listen. The caller holds the home's lock, so a socket file already there is a dead daemon's."""
        if len(os.fsencode(self.path)) > MAX_SOCKET_PATH:
            raise OSError(f"{self.path} is too long for a Unix socket ({MAX_SOCKET_PATH} bytes at most)")
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.path))
        os.chmod(self.path, 0o600)  # the queries are the person's own: nobody else may ask or listen
        listener.listen(8)
        listener.settimeout(0.5)  # how often the accepting thread looks whether it should stop
        self._listener = listener
        threading.Thread(target=self._accept, name="queries", daemon=True).start()

    def stop(self) -> None:
        self._stopping.set()
        if self._listener is not None:
            self._listener.close()
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def answer(self, embed: Embed) -> None:
        """Answer every waiting request with `embed`; on the worker's thread, where the engine may run."""
        while True:
            try:
                request = self._pending.get_nowait()
            except queue.Empty:
                return
            if request.abandoned:
                continue
            try:
                key, vector = embed(request.text)
                request.reply = {"vectors_key": key, "vector": np.asarray(vector, dtype=np.float32).tolist()}
            except (Stop, Lost, Failure):  # the running job's check said stop: the worker's to act on
                request.reply = {"error": "the daemon is handing its running job back"}
                raise
            except Exception as e:  # the model would not load, or would not embed this: the person hears why
                log.warning("could not answer a search: %s", e)
                request.reply = {"error": f"{type(e).__name__}: {e}"}
            finally:
                request.done.set()

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed by stop()
                return
            threading.Thread(target=self._serve, args=(conn,), name="query", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(CONNECT_SECONDS)
                reply = self._reply(_read_line(conn, MAX_REQUEST_BYTES))
                conn.sendall(json.dumps(reply).encode() + b"\n")
            except OSError as e:  # the client went away: nobody to tell
                log.debug("a search connection failed: %s", e)

    def _reply(self, line: bytes) -> dict[str, Any]:
        try:
            text = json.loads(line)["embed"]
        except (ValueError, KeyError, TypeError):
            return {"error": 'not a request: send one line of JSON, {"embed": "<query>"}'}
        if not isinstance(text, str) or not text.strip():
            return {"error": "the query is empty"}
        request = _Request(text)
        self._pending.put(request)
        self.wake()
        if not request.done.wait(ANSWER_SECONDS):
            request.abandoned = True
            return {"error": f"busy: the worker did not get to the query within {ANSWER_SECONDS:g} s"}
        assert request.reply is not None
        return request.reply


def ask_daemon(path: Path, text: str) -> tuple[str, np.ndarray] | None:
    """The CLI's side: (vectors key, vector) of `text` embedded by the running daemon; None when no daemon
    listens (no socket file). Raises NoAnswer when a socket is there but no answer comes."""
    if not path.exists():
        return None
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise NoAnswer(f"the socket path {path} is too long to connect to")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(CONNECT_SECONDS)
            conn.connect(str(path))
            conn.settimeout(ANSWER_SECONDS + CONNECT_SECONDS)  # the daemon answers "busy" before this runs out
            conn.sendall(json.dumps({"embed": text}).encode() + b"\n")
            reply = json.loads(_read_line(conn, MAX_REPLY_BYTES))
    except (ConnectionRefusedError, FileNotFoundError):
        raise NoAnswer(f"{path} is a stale socket: no daemon listens there") from None
    except TimeoutError:
        raise NoAnswer(f"the daemon did not answer within {ANSWER_SECONDS + CONNECT_SECONDS:g} s") from None
    except (OSError, ValueError) as e:
        raise NoAnswer(f"the daemon's answer could not be read: {e}") from e
    if not isinstance(reply, dict) or "error" in reply or "vector" not in reply:
        why = reply.get("error") if isinstance(reply, dict) else reply
        raise NoAnswer(f"the daemon could not embed the query: {why}")
    return str(reply["vectors_key"]), np.asarray(reply["vector"], dtype=np.float32)


def _read_line(conn: socket.socket, limit: int) -> bytes:
    """One line from `conn`, at most `limit` bytes (a longer one is cut there and fails to parse)."""
    data = b""
    while b"\n" not in data and len(data) < limit:
        more = conn.recv(65536)
        if not more:
            break
        data += more
    return data.split(b"\n", 1)[0]
