"""KV events on a ZeroMQ PUB socket, in vLLM's wire format (`ember serve --kv-events-endpoint`).

Each message has three frames: the topic, an 8-byte big-endian sequence number counting from
0, and msgpack([timestamp, [events], data_parallel_rank]). Events are arrays led by their type:
["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium],
["BlockRemoved", block_hashes, medium], ["AllBlocksCleared"] (engine/kvblocks.py makes them
from the prefix tree). Needs the `kv-events` extra (pyzmq, msgpack).
"""
from __future__ import annotations

import logging
import threading
import time

from ..engine.kvblocks import BlockEvents
from ..engine.radix import RadixCache

log = logging.getLogger("ember.kv_events")

_COALESCE_S = 0.005  # events of one engine step usually go out in one batch


class KVEventPublisher:
    """Binds `endpoint` and publishes the events of whichever tree is attached."""

    def __init__(self, endpoint: str, topic: str = "", dp_rank: int = 0):
        try:
            import msgpack
            import zmq
        except ImportError as e:
            raise ValueError("KV events need pyzmq and msgpack: pip install 'ember[kv-events]'") from e
        self._pack = msgpack.Packer(use_bin_type=True).pack
        self._socket = zmq.Context.instance().socket(zmq.PUB)
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as e:
            self._socket.close(linger=0)
            raise ValueError(f"cannot publish KV events on {endpoint!r}: {e}") from e
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info("publishing KV events on %s", self.endpoint)
        self.topic, self.dp_rank = topic.encode(), dp_rank
        self.events = BlockEvents()
        self.seq = 0
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="ember-kv-events", daemon=True)
        self._thread.start()

    def attach(self, tree: RadixCache) -> None:
        """Publish the events of `tree` (a model just loaded or woken up) from now on."""
        self.events.follow(tree)

    def detach(self, tree: RadixCache) -> None:
        """The tree is gone with its model (asleep): subscribers drop what they knew."""
        tree.observer = None
        self.events.forget()

    def close(self) -> None:
        self._stop = True
        self.events.ready.set()
        self._thread.join(timeout=2)
        self._socket.close(linger=200)

    def _loop(self) -> None:
        while True:
            self.events.ready.wait()
            if self._stop:
                self._send(self.events.drain())
                return
            time.sleep(_COALESCE_S)
            self._send(self.events.drain())

    def _send(self, events: list[list]) -> None:
        if not events:
            return
        payload = self._pack([time.time(), events, self.dp_rank])
        self._socket.send_multipart([self.topic, self.seq.to_bytes(8, "big"), payload])
        self.seq += 1
