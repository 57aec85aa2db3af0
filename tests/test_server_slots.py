"""POST /slots/{id}?action=save|restore (llama-server's slot files): a saved conversation comes back
into the prefix cache after it was erased, the same greedy reply computing only the prompt's tail;
file names that are not plain names, and damaged files, are refused with 400."""
from __future__ import annotations

import httpx
import pytest

from test_server_harness import assert_error, serve_model, smollm, wait_idle  # noqa: F401 (fixture)

PROMPT = "The GNU General Public License is a free, copyleft license for software and other kinds of works. " * 6


@pytest.fixture()
def live(smollm, tmp_path):
    with serve_model(smollm, slot_save_path=str(tmp_path)) as server:
        server.wait_ready()
        yield server


def _complete(url: str) -> dict:
    r = httpx.post(url + "/completion", json={"prompt": PROMPT, "n_predict": 8, "temperature": 0}, timeout=60)
    return r.json()


def test_save_erase_restore(live, smollm, tmp_path):
    first = _complete(live.url)
    wait_idle(smollm.engine)
    saved = httpx.post(live.url + "/slots/0?action=save", json={"filename": "conv.bin"}).json()
    assert saved["n_saved"] >= first["tokens_evaluated"] and saved["n_written"] == (tmp_path / "conv.bin").stat().st_size
    httpx.post(live.url + "/slots/0?action=erase")
    wait_idle(smollm.engine)
    restored = httpx.post(live.url + "/slots/1?action=restore", json={"filename": "conv.bin"}).json()
    assert restored["n_restored"] >= first["tokens_evaluated"] - 16 and "restore_ms" in restored["timings"]
    computed = smollm.engine.metrics.prompt_tokens_computed
    again = _complete(live.url)
    assert again["content"] == first["content"]
    assert smollm.engine.metrics.prompt_tokens_computed - computed <= 16


@pytest.mark.parametrize("name", ["../x.bin", "/tmp/x.bin", "a/b.bin", "..", "a\\b", ""])
def test_names_that_are_not_plain_file_names_are_refused(live, name):
    for action in ("save", "restore"):
        assert_error(httpx.post(live.url + f"/slots/0?action={action}", json={"filename": name}), 400,
                     param="filename")


def test_damaged_or_missing_files_are_refused(live, smollm, tmp_path):
    _complete(live.url)
    wait_idle(smollm.engine)
    assert httpx.post(live.url + "/slots/0?action=save", json={"filename": "c.bin"}).status_code == 200
    data = bytearray((tmp_path / "c.bin").read_bytes())
    data[-5] ^= 0xFF
    (tmp_path / "c.bin").write_bytes(bytes(data))
    err = assert_error(httpx.post(live.url + "/slots/0?action=restore", json={"filename": "c.bin"}), 400,
                       param="filename")
    assert "checksum" in err["message"]
    (tmp_path / "d.bin").write_bytes(b"not a slot")
    assert "truncated" in assert_error(httpx.post(live.url + "/slots/0?action=restore", json={"filename": "d.bin"}),
                                       400)["message"]
    assert "no saved slot" in assert_error(httpx.post(live.url + "/slots/0?action=restore",
                                                      json={"filename": "none.bin"}), 400)["message"]


def test_a_restarted_server_answers_a_long_prompt_from_disk(tmp_path):
    """Serve with --cache-disk, ask, stop (the pool's pages are written out), serve again: the same
    prompt is served from disk, with the same greedy reply; /metrics counts the disk hits."""
    from ember.app import ModelConfig, load_model

    from test_server_harness import MODEL_CFG

    cfg = ModelConfig(**{**{f: getattr(MODEL_CFG, f) for f in ("model", "device", "threads", "ctx", "slots")},
                         "cache_disk": str(tmp_path / "kv"), "cache_disk_size": 1 << 30})
    replies = []
    for run in range(2):
        model = load_model(cfg)
        try:
            with serve_model(model) as live:
                live.wait_ready()
                replies.append(_complete(live.url))
                metrics = httpx.get(live.url + "/metrics").text
        finally:
            model.close()
    hits = next(float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith('ember:prefix_cache_hits_total{tier="disk"}'))
    assert replies[1]["content"] == replies[0]["content"]
    assert hits >= replies[0]["tokens_evaluated"] - 16 and replies[1]["tokens_cached"] >= hits
    assert len(list((tmp_path / "kv").iterdir())) >= hits // 16
