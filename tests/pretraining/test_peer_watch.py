"""`PeerWatch`: a process that vanishes is reported by every other process
within seconds; a process that exits normally is not."""

import socket
import threading
import time

from keras_mhf.pretraining.peer_watch import PeerWatch


class KeyValueStore:
    """The part of a `jax.distributed` client the watch uses."""

    def __init__(self):
        self._values = {}
        self._set = threading.Condition()

    def key_value_set(self, key, value):
        with self._set:
            self._values[key] = value
            self._set.notify_all()

    def blocking_key_value_get(self, key, timeout_ms):
        with self._set:
            assert self._set.wait_for(
                lambda: key in self._values, timeout_ms / 1000
            )
            return self._values[key]


def job(num_processes):
    """The watches of a job's processes in this process, and what each
    reported lost."""
    client, lost = KeyValueStore(), {}
    watches = []
    for index in range(num_processes):
        watch = PeerWatch(index, num_processes, client, "localhost")
        watch._on_lost = lambda i, me=index: lost.setdefault(me, []).append(i)
        watches.append(watch)
    watches[0].begin()
    threads = [threading.Thread(target=w.begin) for w in watches[1:]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    deadline = time.monotonic() + 10
    while len(watches[0]._peers) < num_processes - 1:
        assert time.monotonic() < deadline, "the processes did not connect"
        time.sleep(0.01)
    return watches, lost


def vanish(watch):
    """`watch`'s process dies: its connections close without a goodbye and
    it reports nothing."""
    watch._closing = True
    connections = list(watch._peers.values()) + [watch._socket]
    for connection in filter(None, connections):
        connection.shutdown(socket.SHUT_RDWR)
    if watch.process_id == 0:
        watch._server.close()


def wait_for(condition):
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_lost_process_is_reported_by_every_other_within_seconds():
    watches, lost = job(3)
    started = time.monotonic()
    vanish(watches[1])
    wait_for(lambda: len(lost) == 2)
    assert lost == {0: [1], 2: [1]}
    assert time.monotonic() - started < 5


def test_process_0_lost_is_reported_by_the_others():
    watches, lost = job(3)
    vanish(watches[0])
    wait_for(lambda: len(lost) == 2)
    assert lost == {1: [0], 2: [0]}


def test_a_normal_exit_is_not_a_loss():
    watches, lost = job(3)
    watches[2].close()
    watches[1].close()
    watches[0].close()
    time.sleep(0.5)
    assert lost == {}


def test_a_stranger_is_not_heard():
    watches, lost = job(2)
    host, port, _ = (
        watches[0]._client._values["keras_mhf/peer_watch"].rsplit(":", 2)
    )
    stranger = socket.create_connection((host, int(port)))
    stranger.sendall(b"hello 1 not-the-token\n")
    stranger.close()
    time.sleep(0.5)
    assert lost == {} and len(watches[0]._peers) == 1
