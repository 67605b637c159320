"""The rendezvous store: only clients that hold the job's key can read or write it.

The store and its client are plain Python over real loopback sockets (threads stand in for
ranks where no process is needed); one real `tandem run` job checks that its own store refuses
torch's raw client and a wrong key while its ranks meet through it.
"""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest

from tandem import rendezvous
from tandem.rendezvous import AuthenticationFailed, StoreClient, StoreServer, StoreTimeout

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def server():
    with StoreServer("127.0.0.1", 0) as hosted:
        yield hosted


def _client(server: StoreServer, timeout: float = 5.0) -> StoreClient:
    return StoreClient("127.0.0.1", server.port, server.key, timeout)


def test_every_request_of_the_store(server):
    client = _client(server)
    client.set("a", b"1")
    client.set("text", "x")
    assert client.get("a") == b"1" and client.get("text") == b"x"
    assert client.add("n", 2) == 2 and client.add("n", 3) == 5 and client.get("n") == b"5"
    assert client.check(["a", "n"]) and not client.check(["a", "missing"])
    # compare_set as torch's TCPStore: set when the value is the expected one (or absent and
    # nothing expected), else answer what is there.
    assert client.compare_set("c", b"", b"first") == b"first"
    assert client.compare_set("c", b"other", b"second") == b"first"
    assert client.compare_set("c", b"first", b"second") == b"second"
    assert client.compare_set("absent", b"expected", b"x") == b"expected"
    client.append("log", b"ab")
    client.append("log", b"cd")
    client.multi_set(["m1", "m2"], [b"1", b"2"])
    assert client.multi_get(["m1", "m2", "log"]) == [b"1", b"2", b"abcd"]
    assert client.num_keys() == 7  # a, text, n, c, log, m1, m2
    assert client.delete_key("a") and not client.delete_key("a")
    assert server.get("n") == b"5" and server.get("a") is None
    client.close()


def test_a_get_waits_for_the_key_and_a_missing_key_times_out(server):
    waiter, setter = _client(server), _client(server)
    setting = threading.Timer(0.2, setter.set, args=("late", b"here"))
    setting.start()
    try:
        assert waiter.get("late", timeout=10) == b"here"
    finally:
        setting.join()
    with pytest.raises(StoreTimeout, match=r"keys \['never'\] were not set within 0.3 s"):
        waiter.wait(["late", "never"], timeout=0.3)


def test_threads_of_one_client_do_not_wait_for_each_other(server):
    """The watchdog's thread reads the board while the main thread waits in a `get`."""
    client = _client(server)
    blocked = threading.Thread(target=lambda: client.get("gate", timeout=10), daemon=True)
    blocked.start()
    assert client.add("other", 1) == 1  # would wait for the gate on a shared connection
    client.set("gate", b"open")
    blocked.join(10)
    assert not blocked.is_alive()


def test_a_wrong_key_is_refused_and_the_server_is_told(server):
    refused, told = [], threading.Event()

    def on_refused(where: str, why: str) -> None:
        refused.append((where, why))
        told.set()

    with StoreServer("127.0.0.1", 0, key="right", on_refused=on_refused) as s:
        with pytest.raises(AuthenticationFailed,
                           match=rf"127.0.0.1:{s.port} refused the handshake: the peer does not "
                                 "know this job's secret"):
            StoreClient("127.0.0.1", s.port, "wrong", timeout=5)
        assert told.wait(10)  # the server checks our proof as we check its own
        assert len(refused) == 1 and "does not know this job's secret" in refused[0][1]
        assert s.get("anything") is None


def test_a_client_handed_over_leaves_the_store_and_a_store_without_a_taker_refuses():
    """Node 0's agents join at the store's one port: a client that asks is handed over, its
    connection now the taker's (it talks to it, not to the store); a store with no taker says
    so, and still serves the client."""
    taken: queue.SimpleQueue = queue.SimpleQueue()
    with StoreServer("127.0.0.1", 0, on_hand_over=lambda conn, where: taken.put(
            (conn, where))) as hosted:
        conn = _client(hosted).hand_over()
        theirs, where = taken.get(timeout=10)  # the store's thread hands it over after its "ok"
        assert where.startswith("127.0.0.1:")
        conn.send(("hello", {"node_rank": 1}))
        assert theirs.recv() == ("hello", {"node_rank": 1})
        conn.close()
        theirs.close()
    plain = StoreServer("127.0.0.1", 0)
    with plain:
        client = _client(plain)
        with pytest.raises(RuntimeError, match="unknown request 'hand_over'"):
            client.hand_over()
        client.set("still", b"served")
        assert plain.get("still") == b"served"


def test_torchs_raw_client_gets_nothing(server):
    import torch.distributed as dist

    server.set("tandem/control", b"127.0.0.1:1234")
    with pytest.raises(Exception) as caught:
        raw = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                            timeout=timedelta(seconds=3))
        raw.get("tandem/control")
    assert "1234" not in str(caught.value)


def test_a_stranger_that_sends_junk_or_nothing_is_dropped(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=15) as junk:
        junk.sendall(b"\x00\x00\x00\x05hello" * 4)
        received = b""
        try:
            while chunk := junk.recv(4096):  # the server hangs up after its greeting
                received += chunk
        except ConnectionResetError:
            pass  # hung up with our junk unread
    assert b"tandem-store/1" in received and len(received) < 100  # a nonce, no key or value
    client = _client(server)  # and it still serves the job
    client.set("k", b"v")
    assert client.get("k") == b"v"


def test_a_store_that_went_away_is_a_clear_error_not_a_hang():
    server = StoreServer("127.0.0.1", 0)
    client = _client(server)
    client.set("k", b"v")
    server.close()
    with pytest.raises(ConnectionError, match=f"lost the rendezvous store at 127.0.0.1:{server.port}"):
        client.get("k", timeout=1)
    with pytest.raises(ConnectionError, match=f"cannot reach the rendezvous store at "
                                              f"127.0.0.1:{server.port} within 1 s"):
        StoreClient("127.0.0.1", server.port, server.key, timeout=1)


@pytest.mark.parametrize("host", [StoreServer, rendezvous.host_store],
                         ids=["launcher's store", "rank 0's TCPStore"])
def test_a_taken_port_is_a_clear_error(host):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(rendezvous.PortInUseError, match=f"127.0.0.1:{port}: the port is in use"):
            host("127.0.0.1", port)


def test_a_multi_node_store_key_comes_from_the_secret_and_hides_it():
    key = rendezvous.store_key("s3cret")
    assert key == rendezvous.store_key("s3cret") != rendezvous.store_key("other")
    assert "s3cret" not in key and len(key) == 64


@pytest.mark.timeout(120)
def test_a_real_jobs_store_refuses_strangers():
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "tandem", "run", "-np", "2", "--backend", "gloo",
         str(ROOT / "tests" / "scripts" / "store_strangers.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=100,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[0] raw client refused:" in done.stdout, done.stdout
    assert "[0] wrong key refused: the rendezvous store at 127.0.0.1:" in done.stdout
    found = [line for line in done.stdout.splitlines() if "right key:" in line]
    assert found and int(found[0].split()[-2]) > 0, done.stdout  # the ranks' own keys


@pytest.mark.timeout(120)
def test_a_job_no_launcher_started_keys_its_store_with_tandem_store_key():
    """The manual template (also SLURM, torchrun without its agent's store): rank 0 hosts the
    store, authenticated when every rank is given the same TANDEM_STORE_KEY."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "PMI_", "OMPI_"))}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")])),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TANDEM_STORE_KEY="shared-key")
    script = str(ROOT / "tests" / "scripts" / "keyed_manual_rank.py")
    ranks = [subprocess.Popen([sys.executable, script, str(rank)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in (0, 1)]
    try:
        outputs = [rank.communicate(timeout=100) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    for rank, (out, err) in zip(ranks, outputs, strict=True):
        assert rank.returncode == 0, out + err
    assert "raw client refused" in outputs[0][0], outputs[0][0]
    assert "rank 0 total 2" in outputs[0][0] and "rank 1 total 2" in outputs[1][0]
