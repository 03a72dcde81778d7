"""Stops every process of a multi-process job within seconds when one is lost.

Backend-specific module (JAX). A process of a `jax.distributed` job that is
SIGKILLed (or runs out of memory, or loses its host) sends nothing; the
others block in their next collective until JAX's coordination service
misses its heartbeats (100 s) and aborts them with a C++ fatal error and a
stack trace. `PeerWatch` notices at once: every process keeps a TCP
connection to process 0, which the operating system closes when a process
dies however it dies. A connection that closes without the process's
goodbye (sent at a normal exit) means that process was lost: process 0
tells the others, and each prints one line naming the lost process and
exits 1. Nothing is written on the way out, so the run's last complete
checkpoint stays its last, and rerunning the same command in every process
resumes from it. A host that vanishes without closing its connections is
still caught by JAX's heartbeats.

Process 0 listens on a free port of its coordinator host and publishes the
address and a random token in the job's key-value store; only processes
that know the token are heard.

Example:

```python
watch = PeerWatch.start(process_id, num_processes, "host:1234")
```
"""

import atexit
import os
import secrets
import socket
import sys
import threading

_KEY = "keras_mhf/peer_watch"
_CONNECT_TIMEOUT_MS = 120_000
EXIT_CODE = 1


class PeerWatch:
    """The watch of one process of a job (see the module docstring).

    Args:
        process_id: this process's index in the job.
        num_processes: the job's process count.
        client: the job's `jax.distributed` client (its key-value store).
        coordinator_host: the host process 0 runs on.
        on_lost: called with the lost process's index (default: print the
            line and exit); tests pass their own.
    """

    def __init__(
        self, process_id, num_processes, client, coordinator_host, on_lost=None
    ):
        self.process_id = int(process_id)
        self.num_processes = int(num_processes)
        self._client = client
        self._host = coordinator_host
        self._on_lost = on_lost or self._stop
        self._peers = {}  # process 0: index -> socket
        self._lock = threading.Lock()
        self._closing = False
        self._socket = None

    @classmethod
    def start(cls, process_id, num_processes, coordinator_address, client=None):
        """Starts the watch of this process of a joined `jax.distributed`
        job (`client`: its client, by default JAX's); `None` for a single
        process."""
        if int(num_processes) < 2:
            return None
        if client is None:
            from jax._src import distributed

            client = distributed.global_state.client
        host = coordinator_address.rsplit(":", 1)[0].strip("[]")
        watch = cls(process_id, num_processes, client, host)
        watch.begin()
        atexit.register(watch.close)
        return watch

    # --- Connecting ---------------------------------------------------------

    def begin(self):
        """Listens (process 0) or connects to process 0 (the others)."""
        if self.process_id == 0:
            server = socket.create_server(("", 0))
            token = secrets.token_hex(16)
            port = server.getsockname()[1]
            self._client.key_value_set(_KEY, f"{self._host}:{port}:{token}")
            self._token, self._server = token, server
            threading.Thread(
                target=self._accept, name="peer-watch-accept", daemon=True
            ).start()
        else:
            value = self._client.blocking_key_value_get(
                _KEY, _CONNECT_TIMEOUT_MS
            )
            host, port, token = value.rsplit(":", 2)
            self._socket = socket.create_connection((host, int(port)))
            self._socket.sendall(f"hello {self.process_id} {token}\n".encode())
            self._listen(self._socket, 0)

    def _accept(self):
        while True:
            try:
                connection, _ = self._server.accept()
            except OSError:
                return  # closed
            reader = connection.makefile("r")
            words = reader.readline().split()
            if (
                len(words) != 3
                or words[0] != "hello"
                or words[2] != self._token
                or not words[1].isdigit()
            ):
                connection.close()  # not one of the job's processes
                continue
            index = int(words[1])
            with self._lock:
                self._peers[index] = connection
            self._listen(connection, index, reader)

    def _listen(self, connection, index, reader=None):
        reader = reader or connection.makefile("r")
        threading.Thread(
            target=self._read,
            args=(reader, index),
            name=f"peer-watch-{index}",
            daemon=True,
        ).start()

    def _read(self, reader, index):
        """Reads `index`'s messages until its goodbye or its loss."""
        while True:
            try:
                line = reader.readline()
            except OSError:
                line = ""
            words = line.split()
            if words == ["bye"]:
                return
            if len(words) == 2 and words[0] == "lost" and words[1].isdigit():
                self._lost(int(words[1]))  # process 0 saw it first
                return
            if not line:
                self._lost(index)
                return

    # --- Losing and leaving -------------------------------------------------

    def _lost(self, index):
        with self._lock:
            if self._closing:
                return
            self._closing = True
            peers = list(self._peers.items())
        for other, connection in peers:  # process 0 tells the others
            if other != index:
                try:
                    connection.sendall(f"lost {index}\n".encode())
                except OSError:
                    pass
        self._on_lost(index)

    def _stop(self, index):
        sys.stderr.write(
            f"keras-mhf: process {index} of this {self.num_processes}-process "
            "job was lost (it stopped without a word: killed, out of memory "
            f"or its host went down), so process {self.process_id} stops too. "
            "Rerun the same command in every process: the run resumes from "
            "its last complete checkpoint.\n"
        )
        sys.stderr.flush()
        os._exit(EXIT_CODE)

    def close(self):
        """Says goodbye (a normal exit: not a loss) and stops watching."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            connections = list(self._peers.values())
        if self._socket is not None:
            connections.append(self._socket)
        for connection in connections:
            try:
                connection.sendall(b"bye\n")
                connection.close()
            except OSError:
                pass
        if self.process_id == 0:
            self._server.close()
