"""A loopback TCP forwarder: how a pod IP reaches a process that listens elsewhere.

Pod IPs come from a loopback CIDR; a process that binds every interface on a fixed port (the
simulator, the endpoint picker) gets a free port instead, and the runner forwards
<pod IP>:<container port> to it.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class Forwarder:
    """Accept on (ip, port) and copy bytes both ways to 127.0.0.1:target."""

    def __init__(self, ip: str, port: int, target: int):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((ip, port))
        self.sock.listen(64)
        self.target = target
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            up = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            up.settimeout(None)
        except OSError:
            conn.close()
            return

        def pump(a: socket.socket, b: socket.socket) -> None:
            try:
                while data := a.recv(65536):
                    b.sendall(data)
            except OSError:
                pass
            finally:
                with contextlib.suppress(OSError):
                    b.shutdown(socket.SHUT_WR)

        t = threading.Thread(target=pump, args=(up, conn), daemon=True)
        t.start()
        pump(conn, up)
        t.join()
        conn.close()
        up.close()

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
