"""A slowloris client: connections that start a request head and never finish it, each
trickling a header line now and then so that no idle timer ever cuts it.

Used in-process by `test_connections.py`, and as a process of its own for the 20,000
connection run (`python -m tests.hostile.slowloris PORT COUNT SECONDS`: prints one JSON
line of counts), so that the attacker's descriptors are not the test's.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from dataclasses import dataclass, field

HEAD = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n"  # never ends with the blank line


@dataclass
class Slowloris:
    port: int
    source: str = "127.0.0.1"
    open: list[socket.socket] = field(default_factory=list)
    answers: list[bytes] = field(default_factory=list)  # what the server sent a refused connection
    closed: int = 0  # connections the server closed (refused, or cut)
    failed: int = 0  # connections that could not even be made

    def connect(self, count: int) -> None:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.settimeout(10)
            try:
                s.bind((self.source, 0))
                s.connect(("127.0.0.1", self.port))
                s.sendall(HEAD)
            except OSError:
                s.close()
                self.failed += 1
                continue
            s.setblocking(False)
            self.open.append(s)

    def trickle(self) -> None:
        """One header line on every connection still open; drop those the server closed."""
        kept = []
        for s in self.open:
            if self._closed_by_server(s):
                s.close()
                self.closed += 1
                continue
            try:
                s.send(b"X-a: b\r\n")
            except OSError:
                s.close()
                self.closed += 1
                continue
            kept.append(s)
        self.open = kept

    def _closed_by_server(self, s: socket.socket) -> bool:
        try:
            data = s.recv(65536)
        except BlockingIOError:
            return False
        except OSError:
            return True
        if data:
            self.answers.append(data)
        return True  # an answer (the refusal) or the end of the stream

    def close(self) -> None:
        for s in self.open:
            s.close()
        self.open = []


def main() -> None:
    port, count, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    attack = Slowloris(port)
    attack.connect(count)
    most_open = len(attack.open)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        attack.trickle()
        most_open = max(most_open, len(attack.open))
        time.sleep(1)
    refused = sum(a.startswith(b"HTTP/1.1 429") for a in attack.answers)
    out = {"made": count - attack.failed, "failed": attack.failed, "open_at_end": len(attack.open)}
    print(json.dumps({**out, "refused_429": refused, "closed": attack.closed}), flush=True)
    attack.close()


if __name__ == "__main__":
    main()
