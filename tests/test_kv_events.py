"""KV events: the prefix tree's full pages as vLLM-format block events, rebuilt by a subscriber
(in-process from the observer, and over ZeroMQ from `ember serve --kv-events-endpoint`)."""
from __future__ import annotations

import random
import time

import httpx
import pytest

from ember.engine.kvblocks import BlockEvents, block_hash, tree_blocks
from ember.engine.pages import PagePool
from ember.engine.radix import RadixCache


class Subscriber:
    """What a KV-aware router keeps of one worker: block hash -> parent hash."""

    def __init__(self):
        self.blocks: dict[int, int | None] = {}

    def apply(self, event: list) -> None:
        kind = event[0]
        if kind == "BlockStored":
            _, hashes, parent, tokens, block_size, lora_id, medium = event
            assert len(tokens) == block_size * len(hashes) and lora_id is None
            assert parent is None or parent in self.blocks, "a block stored before its parent"
            for i, h in enumerate(hashes):
                assert h == block_hash(parent, tokens[i * block_size:(i + 1) * block_size])
                assert h not in self.blocks, "a block stored twice"
                self.blocks[h], parent = parent, h
        elif kind == "BlockRemoved":
            for h in event[1]:
                assert not any(p == h for p in self.blocks.values()), "a block removed before its children"
                del self.blocks[h]
        else:
            assert event == ["AllBlocksCleared"]
            self.blocks.clear()


def _workload(tree: RadixCache, pool: PagePool, rng: random.Random, rounds: int) -> None:
    """Conversations that grow, branch mid-page and get evicted."""
    convs: list[list[int]] = []
    for _ in range(rounds):
        if convs and rng.random() < 0.7:
            base = rng.choice(convs)
            toks = base[:rng.randrange(len(base) + 1)] + [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
        else:
            toks = [rng.randrange(50) for _ in range(rng.randrange(1, 40))]
        need = pool.pages_for(len(toks))
        if pool.n_free < need:
            tree.evict(need - pool.n_free)
        if pool.n_free < need:
            continue
        pages = [pool.allocate() for _ in range(need)]
        tree.insert(toks, pages)
        pool.release(pages)
        convs.append(toks)
        if rng.random() < 0.2:
            tree.match(rng.choice(convs))  # splits an edge somewhere


def test_events_rebuild_the_tree_through_inserts_splits_and_evictions():
    pool = PagePool(24, 4)
    tree, events, sub = RadixCache(pool), BlockEvents(), Subscriber()
    events.follow(tree)
    rng = random.Random(7)
    for _ in range(20):
        _workload(tree, pool, rng, 15)
        for ev in events.drain():
            sub.apply(ev)
        assert sub.blocks == tree_blocks(tree)
    assert sub.blocks, "the workload left nothing cached"
    tree.clear()
    for ev in events.drain():
        sub.apply(ev)
    assert sub.blocks == {} == tree_blocks(tree)


def test_following_a_tree_that_holds_blocks_announces_them():
    pool = PagePool(16, 4)
    tree = RadixCache(pool)
    _workload(tree, pool, random.Random(3), 12)
    events, sub = BlockEvents(), Subscriber()
    sub.blocks[12345] = None  # what a subscriber knew from an earlier life of the worker
    events.follow(tree)
    for ev in events.drain():
        sub.apply(ev)
    assert sub.blocks == tree_blocks(tree) and 12345 not in sub.blocks


def test_blocks_are_named_by_their_whole_prefix():
    assert block_hash(None, [1, 2]) != block_hash(None, [2, 1])
    assert block_hash(block_hash(None, [1]), [5]) != block_hash(block_hash(None, [2]), [5])
    assert 0 <= block_hash(None, [3] * 16) < 1 << 64


def test_served_engine_publishes_vllm_format_over_zmq():
    zmq = pytest.importorskip("zmq", reason="the kv-events extra (pyzmq) is not installed")
    msgpack = pytest.importorskip("msgpack", reason="the kv-events extra (msgpack) is not installed")
    from test_server_harness import MODEL_CFG, LiveServer, free_port, wait_idle
    from ember.app import ServerConfig, create_app, load_model

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sub_socket = zmq.Context.instance().socket(zmq.SUB)
    sub_socket.setsockopt(zmq.SUBSCRIBE, b"")
    sub_socket.connect(endpoint)
    # 2 slots of 96 tokens: 12 pages of 16, so the prompts below evict each other
    model_cfg = MODEL_CFG.__class__(MODEL_CFG.model, device="cpu", threads=2, ctx=96, slots=2)
    app = create_app(ServerConfig(kv_events_endpoint=endpoint, kv_events_topic="kv"), lambda: load_model(model_cfg))
    with LiveServer(app) as live:
        live.wait_ready(60)
        engine = live.state.model.engine
        system = "You are a terse assistant. Answer in one short sentence. " * 2
        prompts = [system + q for q in ("Name a colour.", "Name a fruit.", "Name a city.")]
        prompts += ["Count: " + " ".join(str(i) for i in range(n, n + 25)) for n in (0, 40, 80)]
        with httpx.Client(timeout=120) as client:
            for prompt in prompts + prompts[:2]:
                r = client.post(live.url + "/completion", json={"prompt": prompt, "n_predict": 4, "temperature": 0})
                assert r.status_code == 200, r.text
        wait_idle(engine)
        time.sleep(0.2)
        expected = tree_blocks(engine.tree)
        sub, seqs, kinds = Subscriber(), [], set()
        while sub_socket.poll(1000):
            topic, seq, payload = sub_socket.recv_multipart()
            ts, events, dp_rank = msgpack.unpackb(payload)
            assert topic == b"kv" and len(seq) == 8 and dp_rank == 0 and abs(ts - time.time()) < 600
            seqs.append(int.from_bytes(seq, "big"))
            for ev in events:
                kinds.add(ev[0])
                sub.apply(ev)
    sub_socket.close(linger=0)
    # A subscriber that connects while the server starts can miss the first message, the loaded
    # model's AllBlocksCleared (ZeroMQ drops what a PUB sends before the connection is up; it says
    # nothing about an empty tree): from the first one heard, none may be missing.
    assert seqs and seqs[0] <= 1 and seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs[:4]
    assert {"BlockStored", "BlockRemoved"} <= kinds and (seqs[0] == 1 or "AllBlocksCleared" in kinds), kinds
    assert sub.blocks == expected and expected


def test_an_address_zmq_cannot_bind_is_a_clear_error():
    pytest.importorskip("zmq", reason="the kv-events extra (pyzmq) is not installed")
    from ember.app import ServerConfig, create_app

    with pytest.raises(ValueError, match="cannot publish KV events on 'bogus://x'"):
        create_app(ServerConfig(kv_events_endpoint="bogus://x"), lambda: None)
