"""N `ember serve` replicas behind SGLang's Model Gateway, on loopback.

    python deploy/replicas.py [--replicas 3] [--policy cache_aware|round_robin|...] [--model smollm2]
                              [--port 8080] [--ctx 2048] [--slots 2] [--threads 1] [--kv-memory 512M]
                              [--no-sticky] [--kv-events] [--log-dir DIR]

Replica i listens on 127.0.0.1:(port + 1 + i), the gateway on 127.0.0.1:port; clients talk to the
gateway's OpenAI routes (/v1/chat/completions, /v1/completions, /v1/models). With --kv-events
replica i also publishes KV events on tcp://127.0.0.1:(port + 101 + i). Ctrl-C stops everything.

Sticky sessions (on by default, `smg` only): a request that names its conversation, with the header
`x-smg-routing-key: CONVERSATION` or a body `rid` of `CONVERSATION_t3` (turn suffix stripped), goes
where the conversation's first request went; a new conversation goes to the replica with the fewest
conversations in flight. Requests without a key are placed by --policy alone.

The gateway is `smg` (pip install smg), the successor of `sglang-router`, which works too
(pip install sglang-router; its module is sglang_router.launch_router). Both register ember as a
generic OpenAI-compatible worker (docs/replicas.md has what they probe and what ember answers).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

GATEWAYS = ("smg.launch_router", "sglang_router.launch_router")  # newest first
# smg's routing-key override pins keyed requests on any policy; `min_group` starts a new key on the
# worker with the fewest keys in flight, so conversations that share a system prompt still spread.
STICKY_FLAGS = ("--routing-key-override", "--assignment-mode", "min_group")
STICKY_GATEWAYS = ("smg.launch_router",)


def gateway_module() -> str | None:
    """The gateway's launcher module, where one is installed."""
    for module in GATEWAYS:
        if importlib.util.find_spec(module.split(".")[0]) is not None:
            return module
    return None


@dataclass
class Cluster:
    """Replicas and the gateway in front of them; a context manager that stops them all."""

    replicas: int = 2
    policy: str = "cache_aware"
    model: str = "smollm2"
    port: int = 8080
    ctx: int = 2048
    slots: int = 2
    threads: int = 1
    kv_events: bool = False
    sticky: bool = True  # keyed conversations stay on one replica (smg; sglang-router has no override)
    kv_memory: str | None = None  # each replica's KV budget (`ember serve --kv-memory`; default ctx x slots)
    log_dir: str | None = None  # where each process writes its log (default: discarded)
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def worker_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.port + 1 + i}" for i in range(self.replicas)]

    def kv_endpoint(self, i: int) -> str:
        return f"tcp://127.0.0.1:{self.port + 101 + i}"

    def __enter__(self) -> Cluster:
        try:
            for i in range(self.replicas):
                self.procs.append(self._spawn(f"replica{i}", self._replica_command(i)))
            for url in self.worker_urls:
                wait_http(url + "/health", 300, self.procs)
            self.procs.append(self._spawn("gateway", self._gateway_command()))
            wait_http(self.url + "/v1/models", 120, self.procs, ready=self._all_workers_listed)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.procs.clear()

    def _replica_command(self, i: int) -> list[str]:
        cmd = [sys.executable, "-m", "ember", "serve", self.model, "--host", "127.0.0.1",
               "--port", str(self.port + 1 + i), "--ctx", str(self.ctx), "--slots", str(self.slots),
               "--threads", str(self.threads), "--log-level", "warning"]
        cmd += ["--kv-memory", self.kv_memory] if self.kv_memory else []
        return cmd + (["--kv-events-endpoint", self.kv_endpoint(i)] if self.kv_events else [])

    def _gateway_command(self) -> list[str]:
        module = gateway_module()
        if module is None:
            raise RuntimeError("no gateway installed: pip install smg (or sglang-router)")
        cmd = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(self.port),
               "--worker-urls", *self.worker_urls, "--policy", self.policy,
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.port + 200),
               "--log-level", "warn"]
        return cmd + (list(STICKY_FLAGS) if self.sticky and module in STICKY_GATEWAYS else [])

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        out = open(os.path.join(self.log_dir, name + ".log"), "wb") if self.log_dir else subprocess.DEVNULL
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)

    def _all_workers_listed(self, body: bytes) -> bool:
        """The gateway lists the model once its workers are registered."""
        return bool(json.loads(body).get("data"))


def wait_http(url: str, timeout: float, procs: list[subprocess.Popen], ready=lambda body: True) -> None:
    """Until `url` answers 200 (and `ready` accepts the body); fails early if a process died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = [p.args for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"exited early: {' '.join(map(str, dead[0]))}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200 and ready(r.read()):
                    return
        except (urllib.error.URLError, OSError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--policy", default="cache_aware", help="the gateway's policy (cache_aware, round_robin, ...)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--port", type=int, default=8080, help="the gateway's port; replicas take the next ones")
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-memory", default=None, help="each replica's KV budget, e.g. 512M (default ctx x slots)")
    p.add_argument("--no-sticky", dest="sticky", action="store_false",
                   help="ignore conversation keys (x-smg-routing-key, rid): every request placed by --policy")
    p.add_argument("--kv-events", action="store_true", help="replicas publish KV events (needs ember[kv-events])")
    p.add_argument("--log-dir", default=None)
    a = p.parse_args()
    with Cluster(a.replicas, a.policy, a.model, a.port, a.ctx, a.slots, a.threads, a.kv_events, a.sticky,
                 a.kv_memory, a.log_dir) as c:
        sticky = ", sticky sessions" if a.sticky and gateway_module() in STICKY_GATEWAYS else ""
        print(f"gateway {c.url} ({a.policy}{sticky}) -> {' '.join(c.worker_urls)}", flush=True)
        try:
            while all(proc.poll() is None for proc in c.procs):
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
