"""Rank 0 of a real job tries its own rendezvous store as a stranger would, then as a rank."""

import os
from datetime import timedelta

import torch.distributed as dist

import tandem as td
from tandem import rendezvous

td.init()
host, port = os.environ["TANDEM_MASTER_ADDR"], int(os.environ["TANDEM_MASTER_PORT"])
if td.rank() == 0:
    # torch's own client, with no key: it must learn nothing, not even that a key exists.
    try:
        raw = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                            timeout=timedelta(seconds=3))
        print(f"raw client: {raw.list_keys()!r} {raw.get('tandem/0/0/rank_0')!r}")
    except Exception as error:
        print(f"raw client refused: {type(error).__name__}")
    try:
        rendezvous.StoreClient(host, port, "not-the-key", timeout=5).num_keys()
        print("wrong key: answered")
    except rendezvous.AuthenticationFailed as error:
        print(f"wrong key refused: {error}")
    ours = rendezvous.StoreClient(host, port, os.environ["TANDEM_STORE_KEY"], timeout=5)
    print(f"right key: {ours.num_keys()} keys")
    ours.close()
td.barrier()
td.shutdown()
