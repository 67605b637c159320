"""Delay (and lose) a network namespace's outgoing packets where the kernel has no `sch_netem`.

    ip netns exec NS python3 scripts/netem.py --queue 0 --delay-ms 100 [--loss 0.05]

Some kernels (this project's test machines among them) are built without `tc qdisc ... netem`.
This does its job from user space: an iptables rule sends the packets to NFQUEUE number
`--queue` (scripts/netns-cluster.sh `shape` adds it, with `--queue-bypass`, so packets flow freely
when this program is not running), and this program holds each one for `--delay-ms` before it
accepts it, or drops it with probability `--loss`. It speaks the kernel's nfnetlink-queue
protocol directly (standard library only), asks for packet metadata only (never the payload),
and runs until killed. Packets leave in the order they came (one delay for all), as netem's do.

Its cost: a netlink message per packet in, one verdict for all the packets that are due out, so
it adds a few hundred microseconds of its own to each packet (a 0.1 ms delay measured 0.45 ms
of round trip here) and holds a stream to ~150 Mbit/s: right for the 100 ms of a slow WAN link
in a fault test, not for microsecond cluster latencies (benchmarks/shaped_links.py shapes the
rate only, in the kernel). It prints `ready` once the queue is bound.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import select
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 1, 2, 3
NFQA_PACKET_HDR = 1
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN = 1, 2, 3
NFQA_VERDICT_HDR = 2
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NF_DROP, NF_ACCEPT = 0, 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2


def _attribute(kind: int, payload: bytes) -> bytes:
    data = struct.pack("HH", 4 + len(payload), kind) + payload
    return data + b"\0" * (-len(data) % 4)


def _message(kind: int, queue: int, attributes: bytes, flags: int = NLM_F_REQUEST) -> bytes:
    body = struct.pack("BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + attributes
    return struct.pack("IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, flags, 0, 0) + body


def _packet_ids(data: bytes) -> list[int]:
    """The ids of the queued packets in one read; raises on a netlink error."""
    ids, offset = [], 0
    while offset + 16 <= len(data):
        length, kind = struct.unpack_from("IH", data, offset)
        if kind == NLMSG_ERROR:
            (code,) = struct.unpack_from("i", data, offset + 16)
            if code:
                raise OSError(-code, f"nfnetlink: {os.strerror(-code)}")
        elif kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            at, end = offset + 20, offset + length  # past nlmsghdr and nfgenmsg
            while at + 4 <= end:
                size, attr = struct.unpack_from("HH", data, at)
                if attr & 0x7FFF == NFQA_PACKET_HDR:
                    ids.append(struct.unpack_from("!I", data, at + 4)[0])
                at += (size + 3) & ~3
                if size < 4:
                    break
        offset += (length + 3) & ~3
        if length < 16:
            break
    return ids


def run(queue: int, delay_s: float, loss: float) -> None:
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.bind((0, 0))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    command = struct.pack("BBH", NFQNL_CFG_CMD_BIND, 0, 0)
    sock.send(_message(NFQNL_MSG_CONFIG, queue, _attribute(NFQA_CFG_CMD, command),
                       NLM_F_REQUEST | NLM_F_ACK))
    _packet_ids(sock.recv(65536))  # the ack, or the reason it failed
    params = struct.pack("!IB", 0, NFQNL_COPY_META) + b"\0" * 3
    config = _attribute(NFQA_CFG_PARAMS, params) + _attribute(
        NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", 65536))
    sock.send(_message(NFQNL_MSG_CONFIG, queue, config, NLM_F_REQUEST | NLM_F_ACK))
    _packet_ids(sock.recv(65536))
    print("ready", flush=True)
    held: collections.deque[tuple[float, int]] = collections.deque()
    while True:
        timeout = max(0.0, held[0][0] - time.monotonic()) if held else None
        readable, _, _ = select.select([sock], [], [], timeout)
        if readable:
            try:
                data = sock.recv(1 << 20)
            except OSError:
                continue  # ENOBUFS: the kernel dropped some; TCP sends them again
            now = time.monotonic()
            held.extend((now + delay_s, packet) for packet in _packet_ids(data))
        now = time.monotonic()
        last = None
        while held and held[0][0] <= now:
            _, last = held.popleft()
            if loss and random.random() < loss:
                sock.send(_message(NFQNL_MSG_VERDICT, queue, _attribute(
                    NFQA_VERDICT_HDR, struct.pack("!II", NF_DROP, last))))
        if last is not None:  # every packet up to `last` still held is due: one verdict
            sock.send(_message(NFQNL_MSG_VERDICT_BATCH, queue, _attribute(
                NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, last))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queue", type=int, default=0, help="the NFQUEUE number")
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--loss", type=float, default=0.0, help="a probability, 0 to 1")
    args = parser.parse_args()
    if not 0 <= args.loss <= 1 or args.delay_ms < 0:
        parser.error("--loss is a probability (0 to 1) and --delay-ms is not negative")
    try:
        run(args.queue, args.delay_ms / 1000, args.loss)
    except OSError as error:
        print(f"netem.py: cannot serve NFQUEUE {args.queue}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
