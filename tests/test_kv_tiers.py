"""The tiers below the KV pool: host memory and a folder of page files. Units of each tier on real
page bytes, then the engine on a real model: pages evicted from the pool come back from RAM and
from disk (tokens computed counted, greedy output identical), and a restarted engine answers a
repeated prompt from disk."""
from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from ember.engine.kvdisk import HEADER, DiskTier
from ember.engine.tiers import RamTier, TierConfig, chain_keys
from ember.sampler import SamplingParams

ID = b"model-a".ljust(32, b"\0")


def page(seed: int, n: int = 4096) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_chain_keys_name_a_page_by_its_whole_prefix():
    a = chain_keys(b"s", list(range(40)), 16)
    b = chain_keys(b"s", [99] + list(range(1, 40)), 16)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # a change in page 0 changes every later key
    assert chain_keys(b"s", list(range(32)) + [7] * 8, 16) == a  # the partial page has no key
    assert chain_keys(b"t", list(range(40)), 16)[0] != a[0]  # another model or KV type: other keys


def test_ram_tier_pushes_out_least_recently_used():
    ram = RamTier(3 * 4096)
    assert [ram.put(bytes([i]), page(i)) for i in range(3)] == [[], [], []]
    ram.get(bytes([0]))
    out = ram.put(b"\x09", page(9))
    assert [k for k, _ in out] == [b"\x01"] and len(ram) == 3 and ram.nbytes == 3 * 4096


def test_disk_tier_round_trip_and_lru_across_restarts(tmp_path):
    disk = DiskTier(tmp_path, 3 * (4096 + HEADER.size), ID)
    for i in range(3):
        assert disk.put(bytes([i]) * 16, page(i))
    os.utime(disk.path(b"\x00" * 16), ns=(1, 1))  # oldest use on disk: removed first after a restart
    again = DiskTier(tmp_path, 3 * (4096 + HEADER.size), ID)
    assert len(again) == 3
    assert again.put(b"\x05" * 16, page(5)) and not again.path(b"\x00" * 16).exists()
    np.testing.assert_array_equal(again.get(b"\x01" * 16, 4096), page(1))
    assert not again.put(b"\x06" * 16, page(6, 10 ** 5))  # larger than the whole budget: not kept
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(again.path(bytes([i]) * 16).name for i in (1, 2, 5))


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "empty"])
def test_bad_page_files_are_skipped_with_a_warning(tmp_path, caplog, damage):
    disk = DiskTier(tmp_path, 1 << 20, ID)
    key = b"\x01" * 16
    disk.put(key, page(1))
    path = disk.path(key)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-10] ^= 1
    elif damage == "truncate":
        data = data[:-100]
    elif damage == "empty":
        data = b""
    path.write_bytes(bytes(data))
    reader = DiskTier(tmp_path, 1 << 20, b"model-b" if damage == "foreign" else ID)
    with caplog.at_level(logging.WARNING, logger="ember.engine"):
        assert reader.get(key, 4096) is None
    assert "skipped" in caplog.text and not path.exists() and len(reader) == 0


def test_unwritable_folders(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="not writable"):
        DiskTier(blocker / "kv", 1 << 20, ID)
    disk = DiskTier(tmp_path / "kv", 1 << 20, ID)
    os.rmdir(tmp_path / "kv")  # the folder gone (or full): a write fails, the page is dropped, no crash
    with caplog.at_level(logging.WARNING, logger="ember.engine"):
        assert not disk.put(b"\x02" * 16, page(2))
    assert "cannot write" in caplog.text and len(disk) == 0
    with pytest.raises(ValueError, match="positive size"):
        TierConfig(disk_dir=str(tmp_path), disk_bytes=0)


# ---- the engine ----

GREEDY = SamplingParams(temperature=0)


def _open(tmp, **tiers):
    from ember.engine import LLM

    return LLM("smollm2", device="cpu", threads=2, ctx=512, slots=1, kv_tokens=512, **tiers)


def _run(llm, ids):
    before = llm.engine.metrics.prompt_tokens_computed
    c = llm.generate(ids, 6, GREEDY)
    return c.token_ids, llm.engine.metrics.prompt_tokens_computed - before


@pytest.fixture(scope="module")
def prompts(llm):
    ids = llm("smollm2").tokenize(open(os.path.join(os.path.dirname(__file__), "data", "GPL-3.txt")).read())
    return ids[:400], ids[1000:1400]


def _tier_metrics(engine) -> dict:
    from prometheus_client import CollectorRegistry, generate_latest

    from ember.server.metrics import EngineView, tier_families

    class Tiers:
        def collect(self):
            yield from tier_families(EngineView(engine.metrics, 0, 0, engine.kv_usage(), engine.tiers,
                                                engine.cache.page_nbytes))

    registry = CollectorRegistry()
    registry.register(Tiers())
    lines = generate_latest(registry).decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if not line.startswith("#")}


def test_evicted_pages_come_back_from_ram_and_disk(tmp_path, prompts):
    a, b = prompts
    llm = _open(tmp_path, cache_ram=2 << 20, cache_disk=tmp_path, cache_disk_size=64 << 20)
    try:
        first, computed = _run(llm, a)
        assert computed == len(a)
        assert _run(llm, b)[1] == len(b)  # a's pages leave the pool of 512 tokens
        again, computed = _run(llm, a)
        st = llm.engine.tiers.stats
        assert again == first and computed <= 16  # only the last page is computed again
        assert st.hits["ram"] > 0 and st.hits["disk"] > 0 and st.hits["ram"] + st.hits["disk"] == (len(a) - 1) // 16
        values = _tier_metrics(llm.engine)
        assert values['ember:prefix_cache_hits_total{tier="ram"}'] == st.hits["ram"] * 16
        assert values['ember:kv_tier_pages{tier="disk"}'] == len(llm.engine.tiers.disk) > 0
        assert values['ember:kv_tier_moved_bytes_total{direction="out",tier="disk"}'] == st.bytes_out["disk"] > 0
    finally:
        llm.close()
    # a restarted engine with the same folder: the prompts come from disk
    llm = _open(tmp_path, cache_disk=tmp_path, cache_disk_size=64 << 20)
    try:
        again, computed = _run(llm, a)
        assert again == first and computed <= 16 and llm.engine.tiers.stats.hits["disk"] == (len(a) - 1) // 16
    finally:
        llm.close()
    # another KV type is another identity: nothing of it is used
    llm = _open(tmp_path, cache_disk=tmp_path, cache_disk_size=64 << 20, cache_type_k="q8_0")
    try:
        assert _run(llm, a)[1] == len(a)
    finally:
        llm.close()
