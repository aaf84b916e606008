"""The measuring side of benchmarks/serve_abuse.py: HTTP from a chosen source address, the server's memory and CPU
(its process and its children), and the pinger (``Watch``) whose worst latency is each scenario's figure."""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from pathlib import Path

PINGER_ADDRESS = "127.0.0.2"
PING = {"messages": [{"role": "user", "content": "Speak."}], "max_tokens": 8, "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": False}}

# -- HTTP ----------------------------------------------------------------------------------------------
def post(port: int, path: str, body: dict, *, timeout: float = 180.0, source: str | None = None,
         headers: dict | None = None) -> tuple[int, dict, dict, float]:
    """(status, JSON body or {}, headers, seconds); status 0 when the connection failed or timed out."""
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout,
                                      source_address=(source, 0) if source else None)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        raw = r.read()
        try:
            data = json.loads(raw) if raw else {}
        except ValueError:
            data = {"raw": raw[:200].decode("latin-1")}
        return r.status, data, dict(r.getheaders()), time.monotonic() - t0
    except (OSError, http.client.HTTPException) as exc:
        return 0, {"exception": type(exc).__name__}, {}, time.monotonic() - t0
    finally:
        conn.close()


def get_status(port: int, path: str, *, source: str | None = None, timeout: float = 10.0) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout,
                                      source_address=(source, 0) if source else None)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    except (OSError, http.client.HTTPException):
        return 0
    finally:
        conn.close()


def summary(status: int, data: dict, seconds: float) -> dict:
    err = data.get("error") if isinstance(data, dict) else None
    return {"status": status, "s": round(seconds, 2), "code": err.get("code") if isinstance(err, dict) else None,
            "message": (err.get("message") or "")[:160] if isinstance(err, dict) else None}


# -- the server's memory and CPU (the process and its children) ----------------------------------------
def _tree(pid: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, ()))
    return out


def tree_rss_mb(pid: int) -> float:
    total = 0
    for p in _tree(pid):
        try:
            total += int(Path(f"/proc/{p}/status").read_text().split("VmRSS:")[1].split()[0])
        except (OSError, IndexError):
            pass
    return total / 1024


def tree_cpu_s(pid: int) -> float:
    total = 0
    for p in _tree(pid):
        try:
            f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(f[11]) + int(f[12])
        except (OSError, IndexError):
            pass
    return total / os.sysconf("SC_CLK_TCK")


class Watch:
    """Pings and memory samples in the background; ``window()`` reads one scenario's share."""

    def __init__(self, port: int, pid: int) -> None:
        self.port, self.pid = port, pid
        self.pings: list[tuple[float, float, int]] = []  # (start, seconds, status)
        self.rss: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._ping, daemon=True),
                         threading.Thread(target=self._sample, daemon=True)]

    def __enter__(self) -> Watch:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(200)

    def _ping(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            status, _, _, seconds = post(self.port, "/v1/chat/completions", PING, timeout=120, source=PINGER_ADDRESS)
            self.pings.append((start, seconds, status))
            time.sleep(0.05)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.rss.append((time.monotonic(), tree_rss_mb(self.pid)))
            time.sleep(0.2)

    def window(self, t0: float, t1: float) -> dict:
        pings = [(s, st) for start, s, st in self.pings if start < t1 and start + s > t0]
        rss = [m for t, m in self.rss if t0 <= t <= t1]
        return {"ping_worst_s": round(max((s for s, _ in pings), default=0.0), 3), "pings": len(pings),
                "ping_failures": sum(st != 200 for _, st in pings),
                "rss_peak_mb": round(max(rss, default=0.0)), "rss_end_mb": round(rss[-1] if rss else 0.0)}


ANSWER_S = 1.0  # an admitted abusive request decodes its tokens within this long before its answer


def measured(watch: Watch, abuse) -> dict:
    """Run ``abuse()`` and the pinger's figures over it (plus one more ping's length, so a stall shows). When
    abusive requests are admitted, their own decoding shares the engine with the pinger as ``plain_burst``'s do;
    ``ping_worst_preparing_s`` is the worst ping that ended before the first of them could be decoding."""
    t0 = time.monotonic()
    figures = abuse()
    time.sleep(0.5)
    out = {**figures, **watch.window(t0, time.monotonic())}
    served = [r["s"] for r in figures.get("requests") or [figures.get("request")] if r and r["status"] == 200]
    if served:
        first = t0 + min(served) - ANSWER_S
        before = [s for start, s, _ in watch.pings if start + s > t0 and start + s < first]
        out["ping_worst_preparing_s"] = round(max(before, default=0.0), 3)
    out["health_after"] = get_status(watch.port, "/health", source="127.0.0.3")
    out["plain_after"] = post(watch.port, "/v1/chat/completions", PING, source="127.0.0.3")[0]
    return out


def at_once(n: int, fn) -> list:
    results: list = [None] * n
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, fn(i))) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results
