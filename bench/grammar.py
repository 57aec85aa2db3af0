"""Grammar engine speed: token-mask time and compile time on the real vocabularies, with
llama.cpp's GBNF (llama-server) as the peer in the same run. Writes bench/results/grammar.json.

    python bench/grammar.py [--models smollm2 gemma3-270m] [--peer-tokens 48] [--no-peer]

Grammars: the JSON-schema corpus (bench/schemas, converted by ember.gbnf.schema), generic
JSON, arithmetic and a C-like language. Token sequences are real tokenizations of text each
grammar accepts: the corpus' examples (compact and indented), generated expressions, C
snippets, and the peer's own constrained outputs. Every step times fill_mask through the
Python API (what the engine pays), single thread, garbage collection paused:
  cold  - a freshly compiled grammar, first time through (every mask state computed once),
  warm  - the same sequences again (masks cached per grammar, as for a schema seen before).
Compile = Grammar.parse + compile for the vocabulary, nothing cached.

The peer, llama.cpp: tokens/s of llama-server's /completion with and without the grammar (ours
as `grammar`; for schemas also `json_schema` through llama.cpp's own converter), and, since
tokens/s on a loaded machine mixes the model's time in, llama-completion's own "sampling time"
per token with our grammar and without any (its grammar cost = the difference). llama.cpp's
outputs under our grammar are replayed through ember too: every token must be accepted.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer  # noqa: E402

from ember import hub  # noqa: E402
from ember.gbnf import Grammar, TokenVocab  # noqa: E402
from ember.gguf_loader import GGUFFile  # noqa: E402
from ember.tokenizer import Tokenizer  # noqa: E402

HERE = Path(__file__).resolve().parent
SCHEMAS, RESULTS = HERE / "schemas", HERE / "results"

JSON_GBNF = r'''root   ::= value
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= "-"? ([0-9] | [1-9] [0-9]{0,15}) ("." [0-9]+)? ([eE] [-+]? [0-9]{1,3})? ws
ws     ::= | " " | "\n" [ \t]{0,40}
'''

ARITH_GBNF = r'''root   ::= expr
expr   ::= term (ws [-+] ws term)*
term   ::= factor (ws [*/%] ws factor)*
factor ::= "-"? (number | "(" ws expr ws ")" | func "(" ws expr (ws "," ws expr)* ws ")")
func   ::= "sqrt" | "sin" | "cos" | "max" | "min" | "abs" | "log"
number ::= [0-9]+ ("." [0-9]+)?
ws     ::= " "?
'''

C_GBNF = r'''root    ::= ws (decl ws)*
decl    ::= type ws ident ws ( "(" ws params? ws ")" ws block | ("=" ws expr ws)? ";" )
params  ::= param (ws "," ws param)*
param   ::= type ws ident (ws "[" ws "]")?
type    ::= ("const" ws)? ("unsigned" ws)? base (ws "*")*
base    ::= "int" | "char" | "float" | "double" | "void" | "long" | "size_t" | "struct" ws ident
block   ::= "{" ws (stmt ws)* "}"
stmt    ::= block | "return" (ws expr)? ws ";" | "break" ws ";" | "continue" ws ";" |
            "if" ws "(" ws expr ws ")" ws stmt (ws "else" ws stmt)? |
            "while" ws "(" ws expr ws ")" ws stmt |
            "for" ws "(" ws (local | expr ws ";") ws expr? ws ";" ws expr? ws ")" ws stmt |
            local | expr ws ";"
local   ::= type ws ident (ws "[" ws expr ws "]")? (ws "=" ws expr)? ws ";"
expr    ::= cond (ws ("=" | "+=" | "-=" | "*=" | "/=" | "%=" | "|=" | "&=" | "^=" | "<<=" | ">>=") ws expr)?
cond    ::= binary (ws "?" ws expr ws ":" ws cond)?
binary  ::= unary (ws binop ws unary)*
binop   ::= "||" | "&&" | "==" | "!=" | "<=" | ">=" | "<<" | ">>" | [<>+*/%&|^] | "-"
unary   ::= ("!" | "-" | "~" | "*" | "&" | "++" | "--" | "(" ws type ws ")")* postfix
postfix ::= primary (ws ("[" ws expr ws "]" | "(" ws (expr (ws "," ws expr)*)? ws ")" | "." ident | "->" ident | "++" | "--"))*
primary ::= ident | number | string | char | "sizeof" ws "(" ws type ws ")" | "(" ws expr ws ")"
ident   ::= [a-zA-Z_] [a-zA-Z0-9_]*
number  ::= [0-9]+ ("." [0-9]+)? [fFuUlL]? | "0x" [0-9a-fA-F]+
string  ::= "\"" ([^"\\\n] | "\\" [^\n])* "\""
char    ::= "'" ([^'\\\n] | "\\" [^\n]) "'"
ws      ::= ([ \t\n] | "//" [^\n]* "\n")*
'''

C_SNIPPETS = [
    '''int add(int a, int b) {
    return a + b;
}
''',
    '''// count the set bits of x
unsigned int popcount(unsigned int x) {
    unsigned int n = 0;
    while (x) {
        n += x & 1;
        x >>= 1;
    }
    return n;
}
''',
    '''static_buffer_size = 4096;
double mean(const double *xs, size_t n) {
    double sum = 0.0;
    for (size_t i = 0; i < n; i++) {
        sum += xs[i];
    }
    return n ? sum / n : 0.0;
}
''',
    '''struct node *find(struct node *head, int key) {
    while (head != 0 && head->key != key) {
        head = head->next;
    }
    return head;
}

int main(int argc, char **argv) {
    char buf[64];
    if (argc < 2) {
        printf("usage: %s file\\n", argv[0]);
        return 1;
    }
    int n = atoi(argv[1]);
    for (int i = 0; i < n; i++) {
        buf[i % 64] = 'a' + (i % 26);
    }
    return 0;
}
''',
]
C_SNIPPETS[2] = C_SNIPPETS[2].replace("static_buffer_size", "int static_buffer_size")


def arithmetic(rng: random.Random, depth: int = 0) -> str:
    """A random expression the arithmetic grammar accepts."""
    r = rng.random()
    if depth > 3 or r < 0.35:
        return str(rng.randint(0, 9999)) if rng.random() < 0.7 else f"{rng.randint(0, 99)}.{rng.randint(0, 999)}"
    if r < 0.55:
        return f"({arithmetic(rng, depth + 1)})"
    if r < 0.7:
        f = rng.choice(["sqrt", "sin", "cos", "abs", "log"])
        return f"{f}({arithmetic(rng, depth + 1)})"
    op = rng.choice([" + ", " - ", " * ", " / ", "+", "*", " % "])
    return arithmetic(rng, depth + 1) + op + arithmetic(rng, depth + 1)


def grammar_set() -> list[dict]:
    """[{name, kind, gbnf, texts, schema}]: the corpus' schemas, then the generic grammars."""
    from ember.gbnf.schema import schema_to_gbnf
    out, all_examples = [], []
    for path in sorted(SCHEMAS.glob("*.json")):
        if path.name.count(".") != 1:
            continue
        schema = json.loads(path.read_text())
        examples_path = path.with_name(path.stem + ".examples.json")
        examples = json.loads(examples_path.read_text()) if examples_path.exists() else []
        texts = [json.dumps(e, indent=i, ensure_ascii=False) for e in examples for i in (None, 2)]
        all_examples += texts
        out.append(dict(name=path.stem, kind="schema", gbnf=schema_to_gbnf(schema), texts=texts, schema=schema))
    rng = random.Random(0)
    out.append(dict(name="json", kind="generic", gbnf=JSON_GBNF, texts=all_examples, schema=None))
    out.append(dict(name="arithmetic", kind="generic", gbnf=ARITH_GBNF, texts=[arithmetic(rng) for _ in range(40)],
                    schema=None))
    out.append(dict(name="c-like", kind="generic", gbnf=C_GBNF, texts=C_SNIPPETS, schema=None))
    return out


# --- ember

def load_vocab(model: str) -> tuple[Tokenizer, TokenVocab, float]:
    tok = Tokenizer.from_metadata(GGUFFile(hub.resolve(model, fetch=False)).metadata)
    t0 = time.perf_counter()
    vocab = TokenVocab(tok.token_bytes, [i for i, a in enumerate(tok.vocab.attr_list) if a & (1 | 2 | 8)],
                       tok.eog_ids, lookup=lambda s: tok.encode(s, add_special=False, parse_special=True))
    return tok, vocab, time.perf_counter() - t0


def compile_ms(text: str, vocab: TokenVocab, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        Grammar.parse(text, cache=False).compile(vocab, cache=False)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def replay(compiled, vocab: TokenVocab, sequences: list[tuple[list[int], bool]], words: np.ndarray):
    """(fill_mask µs per step, accept_token µs per step, sequences refused); a sequence is
    (token ids, whether the grammar must be able to end after them)."""
    masks, accepts, refused = [], [], 0
    eos = next(iter(vocab.eog_ids))
    clock = time.perf_counter_ns
    for ids, complete in sequences:
        m = compiled.matcher()
        for t in ids + [eos] * complete:
            t0 = clock()
            m.fill_mask(words)
            t1 = clock()
            ok = (int(words[t >> 5]) >> (t & 31)) & 1 and m.accept_token(t)
            accepts.append((clock() - t1) / 1e3)
            masks.append((t1 - t0) / 1e3)
            if not ok:
                refused += 1
                break
    return masks, accepts, refused


def summary(xs: list[float]) -> dict:
    if not xs:
        return {}
    a = np.asarray(xs)
    return {"n": len(a), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean()), "max": float(a.max())}


def bench_ember(model: str, grammars: list[dict], peer_texts: dict, reps: int) -> dict:
    tok, vocab, vocab_s = load_vocab(model)
    words = np.empty(vocab.n_words, np.uint32)
    rows, cold_all, warm_all, accept_all, compile_tool = [], [], [], [], []
    for g in grammars:
        texts = [(t, True) for t in g["texts"]] + peer_texts.get(g["name"], [])
        sequences = [(tok.encode(t, add_special=False), complete) for t, complete in texts]
        gc.collect()
        gc.disable()
        try:
            ctimes = compile_ms(g["gbnf"], vocab, reps)
            compiled = Grammar.parse(g["gbnf"], cache=False).compile(vocab, cache=False)
            cold, acc, refused = replay(compiled, vocab, sequences, words)
            warm, _, _ = replay(compiled, vocab, sequences, words)
        finally:
            gc.enable()
        stats = compiled.stats()
        cold_all += cold
        warm_all += warm
        accept_all += acc
        if g["kind"] == "schema":
            compile_tool.append(statistics.median(ctimes))
        rows.append({"grammar": g["name"], "kind": g["kind"], "compile_ms": statistics.median(ctimes),
                     "automaton_states": compiled.grammar.program.n_nodes, "sequences": len(sequences),
                     "refused": refused, "cold": summary(cold), "warm": summary(warm), "engine": stats})
        c, w = rows[-1]["cold"], rows[-1]["warm"]
        print(f"  {model:12s} {g['name']:28s} compile {rows[-1]['compile_ms']:6.2f} ms  steps {c.get('n', 0):5d}  "
              f"cold p50 {c.get('p50', 0):6.1f} p99 {c.get('p99', 0):7.1f}  warm p50 {w.get('p50', 0):5.1f} "
              f"p99 {w.get('p99', 0):6.1f} µs  refused {refused}", flush=True)
    return {"model": model, "n_vocab": vocab.n_vocab, "trie_nodes": vocab.trie_nodes, "vocab_build_s": vocab_s,
            "mask_us": {"cold": summary(cold_all), "warm": summary(warm_all), "all": summary(cold_all + warm_all)},
            "accept_us": summary(accept_all),
            "compile_ms_tool_schemas": {"median": statistics.median(compile_tool), "p90": float(np.percentile(compile_tool, 90)),
                                        "max": max(compile_tool), "n": len(compile_tool)},
            "grammars": rows}


# --- llama.cpp through llama-server

class Server:
    def __init__(self, model_path: Path, threads: int):
        self.port = free_port()
        base = peer.llama_cpp_dir()
        exe = base / "lib" / "llama-server.real"
        env = dict(os.environ, LD_LIBRARY_PATH=f"{base / 'lib-avx2'}:{base / 'lib'}")  # the AVX-512 build faults here
        self.proc = subprocess.Popen([str(exe), "-m", str(model_path), "-t", str(threads), "--port", str(self.port),
                                      "-np", "1", "--no-webui", "-c", "2048"], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if json.loads(self.get("/health")).get("status") == "ok":
                    return
            except (OSError, ValueError):
                time.sleep(0.3)
        self.close()
        raise RuntimeError("llama-server did not start")

    def get(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
            return r.read().decode()

    def complete(self, body: dict) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=900) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            return {"error": e.read().decode(errors="replace")[:300]}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PROMPTS = {"schema": "Answer with JSON arguments for the tool `{name}`:\n", "generic": "Write {name}:\n"}


def bench_peer(model: str, grammars: list[dict], n_predict: int, threads: int) -> tuple[dict, dict]:
    """(peer results, constrained outputs by grammar)."""
    server = Server(hub.resolve(model, fetch=False), threads)
    rows, outputs, plain, timed = [], {}, [], {}
    try:
        base = {"n_predict": n_predict, "temperature": 1.0, "seed": 1, "cache_prompt": False}
        for i, g in enumerate(grammars):
            prompt = PROMPTS[g["kind"]].format(name=g["name"])
            runs = {"grammar": dict(base, prompt=prompt, grammar=g["gbnf"])}
            if i % 5 == 0 or g["kind"] == "generic":  # the plain speed does not depend on the grammar
                runs["plain"] = dict(base, prompt=prompt, ignore_eos=True)
            if g["schema"] is not None:
                runs["json_schema"] = dict(base, prompt=prompt, json_schema=g["schema"])
            row = {"name": g["name"]}
            for kind, body in runs.items():
                r = server.complete(body)
                t = r.get("timings", {})
                row[kind] = {"tokens": t.get("predicted_n"), "tok_s": t.get("predicted_per_second"),
                             "ms_per_token": t.get("predicted_per_token_ms"), "error": r.get("error")}
                if kind == "plain" and t.get("predicted_per_token_ms"):
                    plain.append(t["predicted_per_token_ms"])
                if kind == "grammar" and r.get("content"):  # llama.cpp's text under our grammar
                    outputs.setdefault(g["name"], []).append((r["content"], r.get("stop_type") == "eos"))
                if kind in ("grammar", "json_schema") and t.get("predicted_per_token_ms"):
                    timed.setdefault(kind, []).append(t["predicted_per_token_ms"])
            rows.append(row)
            print(f"  {model:12s} {g['name']:28s} " + "  ".join(
                f"{k} {v['tok_s'] or 0:6.1f} tok/s" + (" ERR" if v["error"] else "") for k, v in row.items()
                if k != "name"), flush=True)
    finally:
        server.close()
    plain_ms = statistics.median(plain) if plain else None
    overhead = {k: (statistics.median(v) - plain_ms if plain_ms else None) for k, v in timed.items()}
    return {"model": model, "threads": threads, "n_predict": n_predict, "plain_ms_per_token": plain_ms,
            "ms_per_token": {k: statistics.median(v) for k, v in timed.items()},
            "grammar_overhead_ms_per_token": overhead, "runs": rows}, outputs


_SAMPLING = re.compile(r"sampling time =\s*([0-9.]+) ms")
_RUNS = re.compile(r" eval time =\s*[0-9.]+ ms /\s*([0-9]+) runs")


def completion_sampling(model: str, gbnf: str | None, n_predict: int, threads: int) -> float | None:
    """llama-completion's sampling time per token (ms), with the grammar or without any."""
    args = ["-m", str(hub.resolve(model, fetch=False)), "-p", "Answer:", "-n", str(n_predict), "--temp", "1",
            "--seed", "1", "-no-cnv", "-t", str(threads)]
    path = None
    if gbnf is not None:
        path = RESULTS / "grammar-peer.gbnf"
        path.write_text(gbnf)
        args += ["--grammar-file", str(path)]
    else:
        args += ["--ignore-eos"]
    proc, _ = peer.run("llama-completion", args, timeout=600)
    if path is not None:
        path.unlink()
    sampled, runs = _SAMPLING.search(proc.stderr), _RUNS.search(proc.stderr)
    return float(sampled.group(1)) / (int(runs.group(1)) + 1) if sampled and runs else None


def bench_sampling(model: str, grammars: list[dict], n_predict: int, threads: int) -> dict:
    base = [x for x in (completion_sampling(model, None, n_predict, threads) for _ in range(3)) if x is not None]
    rows = {}
    for g in grammars:
        rows[g["name"]] = completion_sampling(model, g["gbnf"], n_predict, threads)
        print(f"  {model:12s} {g['name']:28s} llama.cpp sampling {rows[g['name']] or 0:7.2f} ms/token", flush=True)
    with_grammar = [v for v in rows.values() if v is not None]
    plain = statistics.median(base) if base else None
    return {"plain_ms_per_token": plain, "by_grammar_ms_per_token": rows,
            "grammar_median_ms_per_token": statistics.median(with_grammar) if with_grammar else None,
            "grammar_cost_ms_per_token": statistics.median(with_grammar) - plain if with_grammar and plain else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    ap.add_argument("--peer-tokens", type=int, default=48)
    ap.add_argument("--peer-threads", type=int, default=2)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--compile-reps", type=int, default=3)
    args = ap.parse_args()
    grammars = grammar_set()
    print(f"{len(grammars)} grammars ({sum(g['kind'] == 'schema' for g in grammars)} JSON schemas)")
    results = {"machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg()}, "models": {}}
    for model in args.models:
        peer_res, outputs = (None, {})
        if not args.no_peer and peer.available():
            RESULTS.mkdir(exist_ok=True)
            print(f"llama.cpp (llama-server, {args.peer_threads} threads) on {model}:")
            peer_res, outputs = bench_peer(model, grammars, args.peer_tokens, args.peer_threads)
            print(f"llama.cpp (llama-completion sampler timing) on {model}:")
            peer_res["sampling"] = bench_sampling(model, grammars, args.peer_tokens, args.peer_threads)
        print(f"ember on {model}:")
        ours = bench_ember(model, grammars, outputs, args.compile_reps)
        results["models"][model] = {"ember": ours, "llama.cpp": peer_res}
        report(model, ours, peer_res)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "grammar.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {RESULTS / 'grammar.json'}")


def report(model: str, ours: dict, peer_res: dict | None) -> None:
    m = ours["mask_us"]
    print(f"\n== {model}: {ours['n_vocab']} tokens, vocabulary built in {ours['vocab_build_s']:.2f} s")
    for k in ("cold", "warm", "all"):
        s = m[k]
        print(f"   mask {k:4s}: p50 {s['p50']:6.1f} µs  p99 {s['p99']:7.1f} µs  mean {s['mean']:6.1f} µs  ({s['n']} steps)")
    c = ours["compile_ms_tool_schemas"]
    print(f"   compile (tool schemas): median {c['median']:.2f} ms, p90 {c['p90']:.2f} ms, max {c['max']:.2f} ms")
    if not peer_res:
        return
    for k, v in peer_res["ms_per_token"].items():
        print(f"   llama-server {k}: {1e3 / v:.1f} tok/s (median), plain {1e3 / (peer_res['plain_ms_per_token'] or v):.1f} tok/s")
    sp = peer_res.get("sampling", {})
    if sp.get("grammar_cost_ms_per_token") is not None:
        cost = sp["grammar_cost_ms_per_token"]
        ours = m["cold"]["mean"] + ours_accept(ours)
        print(f"   llama.cpp grammar sampling: {sp['grammar_median_ms_per_token']:.2f} ms/token vs "
              f"{sp['plain_ms_per_token']:.2f} without: +{cost:.2f} ms/token; ember mask+accept (cold mean) "
              f"{ours:.1f} µs: {cost * 1e3 / ours:.0f}x less")


def ours_accept(ours: dict) -> float:
    return ours["accept_us"].get("mean", 0.0)


if __name__ == "__main__":
    main()
