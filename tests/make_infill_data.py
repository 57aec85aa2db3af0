"""Writes tests/data/infill.json: llama-server's /infill replies (greedy, 16 tokens, with the
prompt's length) on tests/encoders.py's FIM model, for test_server_infill.py.

    LLAMA_CPP_DIR=../shared/llama.cpp python tests/make_infill_data.py
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "bench"))
import peer  # noqa: E402
from encoders import write_fim_model  # noqa: E402

OUT = HERE / "data" / "infill.json"
PORT = 8432
CTX = 4096
CASES = [
    {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n\nprint(add(1, 2))\n"},
    {"input_prefix": "for i in range(10):\n", "input_suffix": "    print(i)\n", "prompt": "    # loop"},
    {"input_prefix": "import os\n", "input_suffix": "",
     "input_extra": [{"filename": "util.py", "text": "def helper():\n    return 42\n"},
                     {"text": "x = helper()\n"}]},
    {"input_prefix": ["the prefix ", 42, " and more"], "input_suffix": "the end"},
]


def main() -> None:
    import httpx

    with tempfile.TemporaryDirectory() as tmp:
        model = write_fim_model(Path(tmp) / "fim.gguf")
        proc = peer.popen("llama-server", ["-m", str(model), "--port", str(PORT), "-t", "2", "-c", str(CTX),
                                           "-np", "1"])
        try:
            url = f"http://127.0.0.1:{PORT}"
            for _ in range(600):
                try:
                    if httpx.get(url + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            out = []
            for case in CASES:
                body = {**case, "n_predict": 16, "temperature": 0, "return_tokens": True, "cache_prompt": False}
                r = httpx.post(url + "/infill", json=body, timeout=120).json()
                out.append({"request": case, "tokens": r["tokens"], "content": r["content"],
                            "prompt_tokens": r["tokens_evaluated"], "prompt": r["prompt"]})
                print(out[-1])
        finally:
            proc.terminate()
            proc.wait()
    OUT.write_text(json.dumps({"n_ctx": CTX, "cases": out}, indent=1) + "\n")


if __name__ == "__main__":
    main()
