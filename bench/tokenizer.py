"""Tokenizer speed on the real vocabularies, with llama.cpp's llama-tokenize as the peer in the
same run. Writes bench/results/tokenizer.json.

    python bench/tokenizer.py [--models smollm2 gemma3-270m] [--chars 100000] [--repeat 5] [--no-peer]

Text: the GPL-3 text of tests/data, repeated and cut to --chars characters. Per model:
  ember: opening the file, building the tokenizer from its metadata, encoding the text (best of
         --repeat, each time on a fresh tokenizer, so the chunk cache starts empty);
  peer:  llama-tokenize on the text and on one character, whole processes (best of --repeat);
         its encoding time is the difference, its whole time the first.
Both must give the same ids. Ratios are ember / peer (below 1: ember is faster).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer  # noqa: E402

from ember import hub  # noqa: E402
from ember.gguf_loader import GGUFFile  # noqa: E402
from ember.tokenizer import Tokenizer  # noqa: E402

HERE = Path(__file__).resolve().parent
TEXT = HERE.parent / "tests" / "data" / "GPL-3.txt"


def best(fn, repeat: int) -> tuple[float, object]:
    """Shortest of `repeat` runs of fn, and its last result."""
    times, result = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), result


def ember_times(path: Path, text: str, repeat: int) -> dict:
    open_s, f = best(lambda: GGUFFile(path), repeat)
    build_s, _ = best(lambda: Tokenizer.from_metadata(f.metadata), repeat)
    fresh = [Tokenizer.from_metadata(f.metadata) for _ in range(repeat)]
    encode_s, ids = best(lambda: fresh.pop().encode(text), repeat)
    f.close()
    return {"open_s": open_s, "build_s": build_s, "encode_s": encode_s,
            "whole_s": open_s + build_s + encode_s, "ids": ids}


def peer_times(path: Path, text: str, repeat: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        full, one = Path(tmp) / "text.txt", Path(tmp) / "one.txt"
        full.write_text(text)
        one.write_text(text[0])

        def tokenize(file: Path):
            proc, build = peer.run("llama-tokenize", ["-m", str(path), "-f", str(file), "--ids", "--log-disable"])
            if proc.returncode:
                raise RuntimeError(f"llama-tokenize failed: {proc.stderr[-500:]}")
            return json.loads(proc.stdout.strip().splitlines()[-1]), build

        whole_s, (ids, build) = best(lambda: tokenize(full), repeat)
        empty_s, _ = best(lambda: tokenize(one), repeat)
    return {"whole_s": whole_s, "encode_s": max(whole_s - empty_s, 1e-9), "build": build, "ids": ids}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    ap.add_argument("--chars", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-peer", action="store_true")
    args = ap.parse_args()
    text = (TEXT.read_text() * (args.chars // len(TEXT.read_text()) + 1))[:args.chars]
    use_peer = not args.no_peer and peer.available()
    results = {"chars": len(text), "models": {}}
    print(f"{'model':14} {'ember encode':>13} {'peer encode':>12} {'ratio':>6}   {'ember whole':>12} "
          f"{'peer whole':>11} {'ratio':>6}  same ids")
    for name in args.models:
        path = hub.resolve(name)
        ours = ember_times(path, text, args.repeat)
        row = {"ember": {k: v for k, v in ours.items() if k != "ids"}, "tokens": len(ours["ids"])}
        if use_peer:
            theirs = peer_times(path, text, args.repeat)
            row["peer"] = {k: v for k, v in theirs.items() if k != "ids"}
            row["same_ids"] = theirs["ids"] == ours["ids"]
            row["encode_ratio"] = ours["encode_s"] / theirs["encode_s"]
            row["whole_ratio"] = ours["whole_s"] / theirs["whole_s"]
            print(f"{name:14} {ours['encode_s'] * 1e3:11.1f}ms {theirs['encode_s'] * 1e3:10.1f}ms "
                  f"{row['encode_ratio']:6.2f}   {ours['whole_s'] * 1e3:10.1f}ms {theirs['whole_s'] * 1e3:9.1f}ms "
                  f"{row['whole_ratio']:6.2f}  {row['same_ids']}")
        else:
            print(f"{name:14} {ours['encode_s'] * 1e3:11.1f}ms {'-':>12} {'-':>6}   {ours['whole_s'] * 1e3:10.1f}ms")
        results["models"][name] = row
    out = HERE / "results" / "tokenizer.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
