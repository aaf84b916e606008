"""What one hostile client can do to a real ``ninfer serve`` (issue 42): the probe's reproductions, each while a
pinger measures an innocent 8-token chat, with the server's memory (its process and its children) sampled.

Every scenario runs against a server process started through the CLI, exactly as a user starts it (the
embedded model on the CPU by default; the media scenarios on a tiny vision checkpoint converted once into
``--workdir``). The pinger sends greedy 8-token chats one after another from its own loopback address
(127.0.0.2), so limits per client address do not shield or hit it; the figure per scenario is its worst
latency while the abuse runs against its worst latency idle. The servers run ``--max-concurrency 8`` and the
abusive chats ask for 8 tokens (``schema_10k`` for 32, as the probe did), so once admitted they share the
engine with the pinger rather than hold every slot it needs: what the figure shows is preparation (parsing,
compiling, decoding media) reaching other requests.

Scenarios (``--only`` picks some):

- ``plain_burst``: the control, four ordinary 8-token chats at once;
- ``schema_10k``: four json_schema requests at once, 10,000 optional integer properties each;
- ``choice_3mb``: a choice of 1,024 strings of 3,000 characters; the client leaves after 5 s, then the
  server's CPU seconds over the next 10 s show whether the compile outlived it;
- ``ref_chains``: four schemas at once, each a 3,000-long ``$ref`` chain;
- ``anyof_10k``: an ``anyOf`` of 10,000 objects; ``regex_100k``: a regex of 100,000 alternatives;
- ``png_bomb``: 16 PNGs of 9400 x 9400 pixels (a few KB each) in one chat; ``eps``: EPS bytes sent as a PNG;
- ``remote``: ``--allow-remote-media``: a 1 byte/s origin against ``--media-timeout 5``, and whether
  loopback, link-local and encoded IP spellings (and a redirect into them) are fetched;
- ``cache``: the same 700-token prompt from a second user (another ``prompt_cache_key``, then another
  ``cache_salt``, then another API key): ``cached_tokens`` each time;
- ``half_bodies``: 512 connections from one address that send headers and part of a body;
- ``shutdown``: SIGTERM with one stream running and three requests queued (``--max-concurrency 1``);
- ``traps``: ``max_tokens: null`` on completions, a schema ``$ref`` to a URL, a grammar with no sentence.

    python -m benchmarks.serve_abuse [--only schema_10k png_bomb] [--json out.json]
"""

from __future__ import annotations

import argparse
import base64
import http.client
import http.server
import io
import json
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.serve_abuse_watch import (
    Watch,
    at_once,
    get_status,
    measured,
    post,
    summary,
    tree_cpu_s,
    tree_rss_mb,
)
from ninfer_serve.testing import ServerProcess, free_port

ABUSE_TOKENS = 8  # an abusive request, once admitted, decodes no longer than the pinger's own request
SERVER = ("--max-concurrency", "8")  # the abuse's requests never hold every slot the pinger needs
TEXT_SCENARIOS = ("plain_burst", "schema_10k", "choice_3mb", "ref_chains", "anyof_10k", "regex_100k", "cache", "half_bodies",
                  "shutdown", "traps")
MEDIA_SCENARIOS = ("png_bomb", "eps", "remote")



def chat(port: int, extra: dict, **kw) -> dict:
    body = {"messages": [{"role": "user", "content": "Answer."}], "max_tokens": ABUSE_TOKENS,
            "chat_template_kwargs": {"enable_thinking": False}, **extra}
    return summary(*[x for i, x in enumerate(post(port, "/v1/chat/completions", body, **kw)) if i != 2])


def schema(s: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": s}}}


# -- constraint scenarios ------------------------------------------------------------------------------
def plain_burst(port: int) -> dict:
    """The control: four ordinary chats at once, each as long as an abusive one (what sharing the engine costs
    the pinger when nothing is hostile)."""
    return {"requests": at_once(4, lambda i: chat(port, {}))}


def schema_10k(port: int) -> dict:
    """As the probe sent it: 32 tokens, within which its matcher grew by gigabytes."""
    s = schema({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(10_000)}})
    return {"requests": at_once(4, lambda i: chat(port, {**s, "max_tokens": 32}))}


def choice_3mb(port: int, pid: int) -> dict:
    rng = random.Random(0)
    choices = ["".join(rng.choice("abcdefghij") for _ in range(3000)) for _ in range(1024)]
    first = chat(port, {"structured_outputs": {"choice": choices}}, timeout=5.0)
    cpu0 = tree_cpu_s(pid)
    time.sleep(10)
    return {"request": first, "cpu_s_in_10s_after_leaving": round(tree_cpu_s(pid) - cpu0, 1),
            "rss_after_leaving_mb": round(tree_rss_mb(pid))}


def ref_chains(port: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(2999)} | {"d2999": {"type": "integer"}}
    s = schema({"$defs": defs, "$ref": "#/$defs/d0"})
    return {"requests": at_once(4, lambda i: chat(port, s))}


def anyof_10k(port: int) -> dict:
    s = schema({"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
                          for i in range(10_000)]})
    return {"request": chat(port, s)}


def regex_100k(port: int) -> dict:
    pattern = "(" + "|".join(f"w{i}" for i in range(100_000)) + ")"
    return {"request": chat(port, {"structured_outputs": {"regex": pattern}})}


# -- media scenarios -----------------------------------------------------------------------------------
def _data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def bomb_png(side: int = 9400) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (side, side)).save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def media_chat(port: int, urls: list[str], **kw) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": "What?"}]
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": ABUSE_TOKENS,
            "chat_template_kwargs": {"enable_thinking": False}}
    status, data, _, seconds = post(port, "/v1/chat/completions", body, **kw)
    return summary(status, data, seconds)


def png_bomb(port: int) -> dict:
    raw = bomb_png()
    return {"png_bytes": len(raw), "request": media_chat(port, [_data_url(raw)] * 16)}


def eps(port: int) -> dict:
    raw = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\nnewpath 0 0 moveto 8 8 lineto stroke\nshowpage\n"
    return {"request": media_chat(port, [_data_url(raw)])}


class Origin:
    """A loopback origin that counts its hits: ``/slow`` trickles a PNG at 1 byte/s, ``/redirect?to=URL``
    redirects, anything else is a small PNG."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        png = bomb_png(8)
        hits = self.hits

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a) -> None:
                pass

            def do_GET(self) -> None:
                hits.append(self.path)
                if self.path.startswith("/redirect?to="):
                    self.send_response(302)
                    self.send_header("Location", self.path.split("=", 1)[1])
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(png)))
                self.end_headers()
                try:
                    for i in range(len(png)):
                        self.wfile.write(png[i:i + 1])
                        self.wfile.flush()
                        if self.path == "/slow":
                            time.sleep(1.0)
                except OSError:
                    pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def remote(port: int, origin: Origin, trickle_port: int | None) -> dict:
    p, closed = origin.port, free_port()
    out: dict = {}
    if trickle_port is not None:
        out["trickle_1byte_per_s"] = media_chat(trickle_port, [f"http://127.0.0.1:{p}/slow"], timeout=200)
    targets = {"loopback": f"http://127.0.0.1:{p}/a.png", "localhost": f"http://localhost:{p}/a.png",
               "decimal": f"http://2130706433:{p}/a.png", "hex": f"http://0x7f000001:{p}/a.png",
               "octal": f"http://0177.0.0.1:{p}/a.png", "v6_loopback": f"http://[::1]:{p}/a.png",
               "metadata": "http://169.254.169.254/latest/meta-data/",
               "redirect": f"http://127.0.0.1:{p}/redirect?to=http://127.0.0.2:{p}/b.png",
               "closed_port": f"http://127.0.0.1:{closed}/a.png"}
    for name, url in targets.items():
        before = len(origin.hits)
        result = media_chat(port, [url], timeout=30)
        out[name] = {**result, "origin_hits": len(origin.hits) - before}
    return out


# -- the rest ------------------------------------------------------------------------------------------
def cache(port: int, keys: tuple[str, str] | None) -> dict:
    text = " ".join(f"Verse {i}: the quality of mercy is not strained." for i in range(70))

    def ask(**extra) -> int:
        headers = extra.pop("headers", None)
        body = {"prompt": text, "max_tokens": 1, **extra}
        status, data, _, _ = post(port, "/v1/completions", body, headers=headers)
        return data.get("usage", {}).get("prompt_tokens_details", {}).get("cached_tokens", -1) if status == 200 \
            else -status
    out = {"first_user": ask(prompt_cache_key="user-a"), "second_user_other_key": ask(prompt_cache_key="user-b")}
    out["salt_first"] = ask(prompt=text + " x", cache_salt="salt-a")
    out["salt_other"] = ask(prompt=text + " x", cache_salt="salt-b")
    out["salt_same"] = ask(prompt=text + " x", cache_salt="salt-a")
    if keys is not None:
        out["key_a"] = ask(prompt=text + " y", headers={"Authorization": f"Bearer {keys[0]}"})
        out["key_b"] = ask(prompt=text + " y", headers={"Authorization": f"Bearer {keys[1]}"})
        out["key_a_again"] = ask(prompt=text + " y", headers={"Authorization": f"Bearer {keys[0]}"})
    return out


def half_bodies(port: int, n: int = 512, hold_s: float = 12.0) -> dict:
    socks, refused = [], 0
    for _ in range(n):
        s = socket.socket()
        s.settimeout(2)
        try:
            s.connect(("127.0.0.1", port))
            s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: "
                      f"application/json\r\nContent-Length: 100000\r\n\r\n{{\"messages\"".encode())
            socks.append(s)
        except OSError:
            refused += 1
            s.close()
    health, end = [], time.monotonic() + hold_s
    while time.monotonic() < end:
        health.append(get_status(port, "/health", source="127.0.0.3"))
        time.sleep(0.5)
    for s in socks:
        try:
            s.settimeout(0.01)
            refused += s.recv(64).startswith(b"HTTP/1.1 503")
        except OSError:
            pass
        s.close()
    return {"held": len(socks), "offender_refused": refused, "health_ok": health.count(200), "health": len(health)}


def shutdown(server: ServerProcess) -> dict:
    port = server.port
    stream_tail: list[str] = []

    def stream() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        body = {"prompt": "ROMEO:", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        try:
            for line in r:
                if line.strip():
                    stream_tail[:] = (stream_tail + [line.decode().strip()[:120]])[-2:]
        except (OSError, http.client.HTTPException):
            stream_tail.append("<connection cut>")
    threads = [threading.Thread(target=stream)]
    queued: list = [None] * 3
    for i in range(3):
        threads.append(threading.Thread(target=lambda i=i: queued.__setitem__(i, post(
            port, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 64}, timeout=120))))
    for t in threads:
        t.start()
        time.sleep(0.3)
    time.sleep(1.0)
    t0 = time.monotonic()
    server.terminate(timeout_s=120)
    exited = time.monotonic() - t0
    for t in threads:
        t.join(30)
    return {"exit_s": round(exited, 1), "stream_tail": stream_tail,
            "queued": [{"status": q[0], "body": q[1], "retry_after": q[2].get("retry-after")} if q else None
                       for q in queued]}


def traps(port: int) -> dict:
    status, data, _, _ = post(port, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": None, "temperature": 0})
    out = {"max_tokens_null": {"status": status, "completion_tokens": data.get("usage", {}).get("completion_tokens")}}
    out["ref_url"] = chat(port, schema({"$ref": "https://example.com/schema.json"}))
    out["no_sentence"] = chat(port, {"grammar": "root ::= x\nx ::= x"})
    return out


# -- driver --------------------------------------------------------------------------------------------
def supports(flag: str) -> bool:
    text = subprocess.run([sys.executable, "-m", "ninfer", "serve", "--help"], capture_output=True, text=True).stdout
    return flag in text


def vision_model(workdir: Path) -> str:
    out = workdir / "tiny-vl.ninfer"
    if not out.exists():
        src = workdir / "tiny-vl-hf"
        run = [sys.executable, "-m", "ninfer"]
        subprocess.run([*run, "tiny-checkpoint", "--layout", "vl", "--no-mtp", str(src)], check=True)
        subprocess.run([*run, "convert", str(src), str(out)], check=True, capture_output=True)
    return str(out)


def idle_figures(watch: Watch, seconds: float, least: int = 3, limit_s: float = 60.0) -> dict:
    """The pinger alone for ``seconds``, and on until ``least`` pings came back (a loaded machine is slower)."""
    time.sleep(seconds)
    end = time.monotonic() + limit_s
    while sum(st == 200 for _, _, st in watch.pings) < least and time.monotonic() < end:
        time.sleep(0.05)
    pings = [s for _, s, st in watch.pings if st == 200][1:]  # the first one warms the path
    return {"ping_idle_worst_s": round(max(pings, default=0.0), 3),
            "ping_idle_median_s": round(sorted(pings)[len(pings) // 2] if pings else 0.0, 3),
            "rss_idle_mb": round(tree_rss_mb(watch.pid))}


def run(only: list[str], workdir: Path, idle_s: float) -> dict:
    results: dict = {}
    text = [s for s in TEXT_SCENARIOS if s in only and s not in ("half_bodies", "shutdown")]
    if text:
        with ServerProcess(None, *SERVER) as srv, Watch(srv.port, srv.proc.pid) as w:
            results["idle"] = idle_figures(w, idle_s)
            for name in text:
                if name == "choice_3mb":
                    results[name] = measured(w, lambda: choice_3mb(srv.port, srv.proc.pid))
                elif name == "cache":
                    results[name] = cache(srv.port, None)
                elif name == "traps":
                    results[name] = traps(srv.port)
                else:
                    results[name] = measured(w, lambda name=name: globals()[name](srv.port))
                print(name, json.dumps(results[name]), flush=True)
    if "cache" in only and supports("--api-key-file"):
        keys = workdir / "keys.txt"
        keys.write_text("key-a\nkey-b\n")
        with ServerProcess(None, *SERVER, "--api-key-file", str(keys)) as srv:
            results["cache_two_keys"] = cache(srv.port, ("key-a", "key-b"))
    if "half_bodies" in only:
        with ServerProcess(None, *SERVER, "--body-timeout", "15") as srv, Watch(srv.port, srv.proc.pid) as w:
            results["half_bodies_idle"] = idle_figures(w, idle_s)
            results["half_bodies"] = measured(w, lambda: half_bodies(srv.port))
    if "shutdown" in only:
        srv = ServerProcess(None, "--max-concurrency", "1", "--graceful-timeout", "3").start()
        results["shutdown"] = shutdown(srv)
    media = [s for s in MEDIA_SCENARIOS if s in only]
    if media:
        model, origin = vision_model(workdir), Origin()
        remote_args = ["--allow-remote-media", "--media-timeout", "5"]
        with ServerProcess(model, *SERVER, *remote_args) as srv, Watch(srv.port, srv.proc.pid) as w:
            results["media_idle"] = idle_figures(w, idle_s)
            for name in ("png_bomb", "eps"):
                if name in media:
                    results[name] = measured(w, lambda name=name: globals()[name](srv.port))
            if "remote" in media:
                allowed = ["--media-allowed-hosts", "127.0.0.1"] if supports("--media-allowed-hosts") else []
                with ServerProcess(model, *remote_args, *allowed) as trickle:
                    results["remote"] = remote(srv.port, origin, trickle.port)
        origin.server.shutdown()
    return results


def outcome(figures: dict) -> str:
    """One scenario's answers in a few words: the statuses (and error codes) its requests got."""
    reqs = [r for r in figures.get("requests") or ([figures["request"]] if "request" in figures else []) if r]
    groups: dict[tuple, list[float]] = {}
    for r in reqs:
        groups.setdefault((r["status"], r.get("code")), []).append(r["s"])
    parts = []
    for (status, code), seconds in groups.items():
        what = f"{status} {code}" if code else f"{status}"
        took = f"{min(seconds)} s" if min(seconds) == max(seconds) else f"{min(seconds)}-{max(seconds)} s"
        parts.append(f"{len(seconds)} x {what} in {took}" if len(seconds) > 1 else f"{what} in {took}")
    return ", ".join(parts)


def table(results: dict) -> str:
    """The pinger's worst latency per scenario against its worst idle, memory and the server's health after."""
    rows = ["| scenario | outcome | ping worst (s) | x idle worst | while preparing (s) | ping failures | RSS peak (MB) "
            "| health after |", "|---|---|---|---|---|---|---|---|"]
    for name, f in results.items():
        if not isinstance(f, dict) or "ping_worst_s" not in f:
            continue
        idle = results.get("half_bodies_idle" if name == "half_bodies" else
                           "media_idle" if name in MEDIA_SCENARIOS else "idle", {}).get("ping_idle_worst_s")
        ratio = f"{f['ping_worst_s'] / idle:.2f}" if idle else "-"
        preparing = f.get("ping_worst_preparing_s", "-")
        rows.append(f"| {name} | {outcome(f)} | {f['ping_worst_s']} | {ratio} | {preparing} | {f['ping_failures']} | "
                    f"{f['rss_peak_mb']} | {f['health_after']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", default=[*TEXT_SCENARIOS, *MEDIA_SCENARIOS],
                   choices=[*TEXT_SCENARIOS, *MEDIA_SCENARIOS])
    p.add_argument("--workdir", default=".serve_abuse", help="where the tiny vision model is built once")
    p.add_argument("--idle-s", type=float, default=8.0, help="seconds of idle pinging before the scenarios")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    workdir = Path(args.workdir)
    workdir.mkdir(exist_ok=True)
    results = run(args.only, workdir, args.idle_s)
    print(json.dumps(results, indent=1))
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
