"""The thread that sends a durable batch's acks on the local lane.

A connection's acks leave in order; failed sends are counted, never retried.
See docs/decisions.md ("A local append lane beside the writer's ROUTER").
"""

from __future__ import annotations

import queue
import socket
import threading
from collections.abc import Callable

INLINE_ACKS = 2
_DONTWAIT = int(socket.MSG_DONTWAIT)  # plain ints: an IntFlag's `&` is a Python call

Frames = list[tuple[bytes, bytes]]  # (connection ident, frame)
Resolve = Callable[[bytes], socket.socket | None]


class LaneAcker:
    """One daemon thread draining a queue of ack batches and sockets to close."""

    def __init__(self, resolve: Resolve) -> None:
        """`resolve(ident)`: the connection's socket, None once the loop closed it."""
        self._resolve = resolve
        self._queue: queue.SimpleQueue[Frames | socket.socket | None] = queue.SimpleQueue()
        self._queued = 0  # written by the loop only
        self._done = 0  # written by this thread only
        self.sent_total = 0
        self.dropped_total = 0
        self._thread = threading.Thread(target=self._run, name="lane-acks", daemon=True)
        self._thread.start()

    @property
    def idle(self) -> bool:
        """Nothing queued or being sent (read by the loop)."""
        return self._done == self._queued

    def send(self, frames: Frames) -> None:
        """Send `frames` in order: here when few and the thread is idle, else on it."""
        if len(frames) <= INLINE_ACKS and self.idle:
            self._send_all(frames)
            return
        self._queued += 1
        self._queue.put(frames)

    def close_socket(self, sock: socket.socket) -> None:
        """Close `sock` after everything queued so far (at once when idle)."""
        if self.idle:
            sock.close()
            return
        self._queued += 1
        self._queue.put(sock)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                if isinstance(item, socket.socket):
                    item.close()
                else:
                    self._send_all(item)
            finally:
                self._done += 1

    def _send_all(self, frames: Frames) -> None:
        resolve = self._resolve
        for ident, frame in frames:
            sock = resolve(ident)
            if sock is None:  # closed meanwhile: its client retries
                self.dropped_total += 1
                continue
            try:
                sock.send(frame, _DONTWAIT)
            except OSError:  # not reading (EAGAIN) or gone: the loop sees its end
                self.dropped_total += 1
            else:
                self.sent_total += 1

    def stop(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, then end the thread."""
        self._queue.put(None)
        self._thread.join(timeout=timeout_s)
