"""The thread that sends a durable batch's acks on the writer's local lane
(actors/writer/lane.py) while the writer's loop goes on with the next batch.

A packet sent to a client asleep in its `recv` wakes it, and the sender pays
for the wake-up: 18 us a send on this VM (an idle vCPU woken through the
hypervisor), against ~1 us of Python to encode the ack. At 64 appenders a
batch answers ~30 of them, so its acks were a quarter of the loop's time
(py-spy, docs/performance.md "perf13"). ZeroMQ's ROUTER pays the same on its
I/O thread; the lane pays it here, on a thread of its own, one hand-off a
batch. A batch of `INLINE_ACKS` acks or fewer (a lone appender's) is sent by
the loop itself when this thread is idle: a hand-off costs a wake-up too.

Ordering and lifetime: every send of a connection goes through this thread
once it is busy (what the loop sends meanwhile waits in the same queue), so
a connection's acks leave in the order the loop made them; and a connection
the loop closes while this thread may still send on it is closed by this
thread, after what was queued before it, so its fd cannot be reused by a new
connection under a queued ack. Failed sends are counted, never retried: the
client's retry (same msg_id, same key) is answered again."""

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
