"""Media acquisition (ninfer_serve.media): data URLs, local files only under the media root, http(s) only when
allowed (against a local server on 127.0.0.1: no test touches the network), the byte, time, count and frame
limits, the OpenAI error shape and codes, and the ChatInput the gateway builds (parts and media in order)."""

from __future__ import annotations

import asyncio
import base64
import os
import threading

import attrs
import httpx
import pytest

from ninfer.contract import ChatInput
from ninfer.contract.prompt import MediaItem
from ninfer_serve.app import create_app
from ninfer_serve.errors import APIError
from ninfer_serve.media import FetchCancelled, MediaPolicy, MediaRefused, acquire, fetch
from ninfer_serve.media_parts import MediaSource
from ninfer_serve.testing import MediaOrigin

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4  # bytes only: decoding is the Frontend's
JPEG = b"\xff\xd8\xff" + bytes(300)
GUARD_S = 30.0  # hang guard only


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def get(url: str, policy: MediaPolicy | None = None, *, limit: int = 1 << 20, cancel=None):
    return fetch(url, policy or MediaPolicy(), limit=limit, cancel=cancel or threading.Event())


def refused(url: str, policy: MediaPolicy | None = None, **kw) -> MediaRefused:
    with pytest.raises(MediaRefused) as info:
        get(url, policy, **kw)
    return info.value


# ---------------------------------------------------------------- data URLs


def test_data_urls_decode():
    assert get(data_url(PNG)).data == PNG and get(data_url(PNG)).mime_type == "image/png"
    unpadded = data_url(b"ab").rstrip("=")
    assert get(unpadded).data == b"ab"
    encoded = base64.b64encode(PNG).decode()
    wrapped = "data:image/png;base64," + "\n".join(encoded[i:i + 76] for i in range(0, len(encoded), 76))
    assert get(wrapped).data == PNG
    assert get("data:image/jpeg,%FF%D8%FF").data == b"\xff\xd8\xff"  # percent-encoded
    assert get(data_url(PNG, "application/octet-stream")).data == PNG  # loosely: bytes of no declared type
    assert get("data:;base64," + base64.b64encode(PNG).decode()).mime_type is None


@pytest.mark.parametrize("url,words", [
    ("data:image/png;base64,***", "not valid base64"),
    ("data:image/png;base64", "needs a comma"),
    ("data:text/plain;base64,aGk=", "text/plain is not an image"),
    ("data:video/mp4;base64,aGk=", "video/mp4 is not an image"),
])
def test_bad_data_urls_are_invalid_media(url, words):
    e = refused(url)
    assert e.code == "invalid_media" and words in e.message


def test_a_data_url_over_the_limit_is_refused_before_decoding():
    e = refused(data_url(PNG), limit=100)
    assert e.code == "media_too_large" and "more than 100 bytes" in e.message


# ---------------------------------------------------------------- local files


@pytest.fixture
def root(tmp_path):
    inside = tmp_path / "media"
    (inside / "sub").mkdir(parents=True)
    (inside / "sub" / "cat.png").write_bytes(PNG)
    (inside / "a b.jpg").write_bytes(JPEG)
    (tmp_path / "secret.png").write_bytes(b"secret")
    return inside


def test_files_under_the_root_are_read(root):
    policy = MediaPolicy(root=str(root))
    for url in ("sub/cat.png", str(root / "sub" / "cat.png"), f"file://{root}/sub/cat.png",
                f"file://localhost{root}/sub/cat.png", "sub/../sub/cat.png"):
        got = get(url, policy)
        assert got.data == PNG and got.mime_type == "image/png", url
    assert get(f"file://{root}/a%20b.jpg", policy).data == JPEG  # file URLs are percent-decoded
    os.symlink(root / "sub" / "cat.png", root / "link.png")  # a link that stays inside
    assert get("link.png", policy).data == PNG


def test_without_a_root_no_local_file_is_read(root):
    for url in (str(root / "sub" / "cat.png"), f"file://{root}/sub/cat.png", "cat.png"):
        e = refused(url)
        assert e.code == "media_not_allowed" and "--media-root" in e.message


def test_paths_out_of_the_root_are_refused(root):
    policy = MediaPolicy(root=str(root))
    os.symlink(root.parent / "secret.png", root / "escape.png")
    os.symlink(root.parent, root / "up")
    for url in ("../secret.png", "sub/../../secret.png", str(root.parent / "secret.png"),
                f"file://{root.parent}/secret.png", f"file://{root}/../secret.png", "/etc/passwd",
                "escape.png", "up/secret.png"):
        e = refused(url, policy)
        assert e.code == "media_not_allowed" and "outside the media root" in e.message, url
        assert "secret" not in e.message or "secret" in url  # where a link leads is not echoed


def test_unreadable_local_media_is_invalid(root):
    policy = MediaPolicy(root=str(root))
    os.mkfifo(root / "pipe.png")  # must not block a thread
    (root / "empty.png").write_bytes(b"")
    cases = {"missing.png": "no such file", "sub": "not a regular file", "pipe.png": "not a regular file",
             "file://elsewhere/x.png": "names no other host", "ftp://host/x.png": "scheme 'ftp' are not supported",
             "bad\0name.png": "not a valid path"}
    for url, words in cases.items():
        e = refused(url, policy)
        assert e.code == "invalid_media" and words in e.message, (url, e.message)
    with pytest.raises(APIError) as info:
        acquire((MediaSource(kind="image", urls=("empty.png",), param="p"),), policy, threading.Event())
    assert info.value.code == "invalid_media" and "is empty" in info.value.message


def test_a_file_over_the_limit_is_too_large(root):
    e = refused("sub/cat.png", MediaPolicy(root=str(root)), limit=len(PNG) - 1)
    assert e.code == "media_too_large"
    assert get("sub/cat.png", MediaPolicy(root=str(root)), limit=len(PNG)).data == PNG


def test_the_policy_checks_its_values(tmp_path):
    with pytest.raises(ValueError, match="root"):
        MediaPolicy(root=str(tmp_path / "none"))
    for bad in ({"threads": 17}, {"threads": 0}, {"max_bytes": 0}, {"timeout_s": 0}, {"max_items": 0},
                {"queue": -1}, {"allow_remote": 1}, {"allowed_hosts": "a.example"}, {"allowed_hosts": ["*"]},
                {"allowed_hosts": ["a b"]}, {"allowed_hosts": ["a.*.example"]}):
        with pytest.raises(ValueError):
            MediaPolicy(**bad)
    assert MediaPolicy(root=str(tmp_path / ".")).root == os.path.realpath(tmp_path)


# ---------------------------------------------------------------- http(s), against a local server


@pytest.fixture
def site(monkeypatch):
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    s = MediaOrigin(drip=PNG, guard_s=GUARD_S)  # /slow and /drip hold until s.release
    s.routes["/cat.png"] = (200, {"Content-Type": "image/png", "Content-Length": str(len(PNG))}, PNG)
    s.routes["/raw"] = (200, {}, PNG)  # no type, no length: read until the server closes
    s.routes["/page"] = (200, {"Content-Type": "text/html; charset=utf-8"}, b"<html></html>")
    s.routes["/moved"] = (302, {"Location": "/cat.png"}, b"")
    s.routes["/to-file"] = (302, {"Location": "file:///etc/passwd"}, b"")
    s.routes["/to-ftp"] = (307, {"Location": "ftp://127.0.0.1/x.png"}, b"")
    yield s
    s.close()


# The test server is on loopback: only a host the operator allows is fetched from there (test_media_fetch.py).
REMOTE = MediaPolicy(allow_remote=True, timeout_s=GUARD_S, allowed_hosts=("127.0.0.1",))


def test_remote_media_is_off_by_default(site):
    e = refused(site.url + "/cat.png")
    assert e.code == "media_not_allowed" and "--allow-remote-media" in e.message
    assert site.hits == []  # refused before any connection


def test_remote_media_when_allowed(site):
    got = get(site.url + "/cat.png", REMOTE)
    assert got.data == PNG and got.mime_type == "image/png"
    assert get(site.url + "/raw", REMOTE).data == PNG
    assert get(site.url + "/moved", REMOTE).data == PNG


@pytest.mark.parametrize("path,logged", [
    ("/missing.png", "answered HTTP 404"),
    ("/page", "is of type text/html, not an image"),
    ("/to-file", "redirects to 'file:///etc/passwd', which is refused: the scheme 'file' is not http(s)"),
    ("/to-ftp", "the scheme 'ftp' is not http(s)"),
])
def test_remote_refusals_tell_the_client_nothing_of_the_origin(site, caplog, path, logged):
    url = site.url + path
    e = refused(url, REMOTE)
    # the client's message is the address it sent and the policy, nothing the origin answered (a 404, a type)
    assert e.code == "invalid_media" and e.message == (f"{url!r}: the fetch was refused (media is fetched from "
                                                       "public addresses, as an image, within 30 s; the server's "
                                                       "log says why)")
    assert logged in caplog.text


def test_remote_byte_limit(site):
    for path in ("/cat.png", "/raw"):  # a declared length, and one found while reading
        e = refused(site.url + path, REMOTE, limit=len(PNG) - 1)
        assert e.code == "media_too_large", path


def test_remote_time_limit(site, caplog):
    policy = attrs.evolve(REMOTE, timeout_s=0.2)
    e = refused(site.url + "/slow", policy)  # the server holds its answer
    assert e.code == "invalid_media" and "within 0.2 s" in e.message
    assert "refused: not complete within 0.2 s" in caplog.text


def test_a_cancelled_fetch_stops_at_its_next_read(site):
    cancel = threading.Event()
    cancel.set()
    site.release.set()
    with pytest.raises(FetchCancelled):
        get(site.url + "/cat.png", REMOTE, cancel=cancel)


# ---------------------------------------------------------------- videos and acquisition order


def test_acquire_keeps_the_order_and_reads_videos_as_frames(root):
    policy = MediaPolicy(root=str(root))
    sources = (MediaSource(kind="video", urls=(data_url(PNG), "sub/cat.png"), param="v", fps=2.0),
               MediaSource(kind="image", urls=("a b.jpg",), param="i"))
    video, image = acquire(sources, policy, threading.Event())
    assert video == MediaItem(kind="video", frames=(PNG, PNG), fps=2.0)
    assert image == MediaItem(kind="image", data=JPEG, mime_type="image/jpeg")


def test_a_video_s_frames_share_the_item_limit(root):
    policy = MediaPolicy(root=str(root), max_bytes=len(PNG) + 10)
    with pytest.raises(APIError) as info:
        acquire((MediaSource(kind="video", urls=("sub/cat.png", "sub/cat.png"), param="m.video"),), policy,
                threading.Event())
    e = info.value
    assert (e.status, e.code, e.param) == (400, "media_too_large", "m.video[1]")
    assert "frames together hold more than" in e.message


# ---------------------------------------------------------------- over HTTP


def chat_body(*parts, **extra) -> dict:
    return {"model": "tiny-test", "messages": [{"role": "user", "content": list(parts)}], **extra}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture
def vision_engine(engine, script):
    engine.vision_enabled = True
    engine.next = lambda req: script.Handle("r", script.text("r", 3, ["ok"]))
    return engine


def error_of(r, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
    assert err["type"] == ("rate_limit_error" if status == 429 else "invalid_request_error")
    return err


def test_the_chat_input_holds_parts_and_media_in_order(client, vision_engine, root):
    c = client(vision_engine, media=MediaPolicy(root=str(root)))
    body = {"model": "tiny-test", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [
            {"type": "text", "text": "compare"}, {"type": "text", "text": "these"}, image_part(data_url(PNG)),
            {"type": "text", "text": "and"},
            {"type": "video", "video": ["sub/cat.png", f"file://{root}/a%20b.jpg"], "fps": 1.5},
            {"type": "input_image", "image_url": "a b.jpg"}, {"type": "image", "image": "sub/cat.png"},
            {"type": "video_url", "video_url": {"url": [data_url(JPEG)], "fps": 4}}]}]}
    assert c.post("/v1/chat/completions", json=body).status_code == 200
    chat = vision_engine.submitted[0].input
    assert isinstance(chat, ChatInput)
    assert chat.messages[0] == {"role": "system", "content": "be brief"}
    assert chat.messages[1]["content"] == [
        {"type": "text", "text": "compare\nthese"}, {"type": "image"}, {"type": "text", "text": "and"},
        {"type": "video"}, {"type": "image"}, {"type": "image"}, {"type": "video"}]
    assert chat.media == (MediaItem(kind="image", data=PNG, mime_type="image/png"),
                          MediaItem(kind="video", frames=(PNG, JPEG), fps=1.5),
                          MediaItem(kind="image", data=JPEG, mime_type="image/jpeg"),
                          MediaItem(kind="image", data=PNG, mime_type="image/png"),
                          MediaItem(kind="video", frames=(JPEG,), fps=4.0))


def test_text_only_requests_are_unchanged(client, vision_engine):
    c = client(vision_engine)
    body = chat_body({"type": "text", "text": "a"}, {"type": "text", "text": "b"})
    assert c.post("/v1/chat/completions", json=body).status_code == 200
    assert vision_engine.submitted[0].input.messages[0]["content"] == "a\nb"
    assert vision_engine.submitted[0].input.media == ()


def test_a_model_without_vision_answers_vision_not_enabled_before_fetching(client, engine, site):
    c = client(engine, media=REMOTE)
    r = c.post("/v1/chat/completions", json=chat_body({"type": "text", "text": "see"},
                                                       image_part(site.url + "/cat.png")))
    err = error_of(r, 400, "vision_not_enabled")
    assert err["param"] == "messages[0].content[1]"
    assert site.hits == [] and engine.submitted == []


@pytest.mark.parametrize("part,param,code", [
    (image_part("data:image/png;base64,***"), "messages[0].content[0].image_url.url", "invalid_media"),
    (image_part("/etc/passwd"), "messages[0].content[0].image_url.url", "media_not_allowed"),
    (image_part("http://127.0.0.1:9/x.png"), "messages[0].content[0].image_url.url", "media_not_allowed"),
    ({"type": "image", "image": data_url(PNG * 30)}, "messages[0].content[0].image", "media_too_large"),
    ({"type": "video", "video": [data_url(PNG), "data:,"]}, "messages[0].content[0].video[1]", "invalid_media"),
    ({"type": "video_url", "video_url": {"url": "https://example.com/clip.mp4"}},
     "messages[0].content[0].video_url.url", "invalid_media"),
    ({"type": "video", "video": [data_url(PNG)] * 3}, "messages[0].content[0].video", "media_too_large"),
    ({"type": "video", "video": []}, "messages[0].content[0].video", "invalid_media"),
    (image_part(""), "messages[0].content[0].image_url.url", "invalid_media"),
])
def test_media_errors_name_the_parameter(client, vision_engine, part, param, code):
    c = client(vision_engine, media=MediaPolicy(max_bytes=len(PNG) * 20, max_frames=2))
    err = error_of(c.post("/v1/chat/completions", json=chat_body(part)), 400, code)
    assert err["param"] == param and vision_engine.submitted == []


@pytest.mark.parametrize("part,param", [
    ({"type": "image_url", "image_url": {"url": "data:,x", "detail": "high"}}, "messages[0].content[0].image_url.detail"),
    ({"type": "image_url", "image_url": {"url": "data:,x", "size": 3}}, "messages[0].content[0].image_url.size"),
    ({"type": "image_url", "text": "x", "image_url": "data:,x"}, "messages[0].content[0].text"),
    ({"type": "image_url", "image_url": "data:,x", "fps": 2}, "messages[0].content[0].fps"),
    ({"type": "image"}, "messages[0].content[0].image"),
    ({"type": "video", "video": ["data:,x"], "fps": 0}, "messages[0].content[0].fps"),
    ({"type": "video_url", "video_url": {"url": ["data:,x"], "fps": -1}}, "messages[0].content[0].video_url.fps"),
    ({"type": "video_url"}, "messages[0].content[0].video_url"),
])
def test_malformed_media_parts_are_a_400(client, vision_engine, part, param):
    r = client(vision_engine).post("/v1/chat/completions", json=chat_body(part))
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_the_count_limit_and_system_messages(client, vision_engine):
    c = client(vision_engine, media=MediaPolicy(max_items=2))
    err = error_of(c.post("/v1/chat/completions", json=chat_body(*[image_part(data_url(PNG))] * 3)), 400,
                   "too_many_media")
    assert err["param"] == "messages" and "at most 2" in err["message"]
    body = {"model": "tiny-test", "messages": [{"role": "system", "content": [image_part(data_url(PNG))]},
                                                {"role": "user", "content": "hi"}]}
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0]"


def test_media_runs_on_its_own_pool_and_a_full_pool_answers_429(vision_engine, site):
    app = create_app(vision_engine, retry_after_s=2,
                     media=attrs.evolve(REMOTE, threads=1, queue=0))
    media_pool = app.state.gateway.media.pool
    slow = chat_body(image_part(site.url + "/slow"))

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            first = asyncio.ensure_future(c.post("/v1/chat/completions", json=slow))
            await asyncio.get_running_loop().run_in_executor(None, site.entered.wait, GUARD_S)
            assert media_pool.running == 1
            refused = await c.post("/v1/chat/completions", json=chat_body(image_part(data_url(PNG))))
            site.routes["/slow"] = (200, {"Content-Type": "image/png"}, PNG)
            site.release.set()
            return refused, await first

    try:
        refused, first = asyncio.run(asyncio.wait_for(main(), GUARD_S))
    finally:
        site.release.set()
        media_pool.shutdown(timeout=GUARD_S)
        app.state.gateway.pool.shutdown(timeout=GUARD_S)
    err = error_of(refused, 429, "overload")
    assert refused.headers["retry-after"] == "2" and "waiting for their media" in err["message"]
    assert first.status_code == 200 and len(vision_engine.submitted) == 1
    assert vision_engine.submitted[0].input.media[0].data == PNG


def test_a_request_cancelled_while_its_media_is_fetched_never_reaches_the_engine(vision_engine, site):
    app = create_app(vision_engine, media=REMOTE)
    media_pool = app.state.gateway.media.pool

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            request = asyncio.ensure_future(c.post("/v1/chat/completions", json=chat_body(image_part(site.url + "/drip"))))
            await asyncio.get_running_loop().run_in_executor(None, site.entered.wait, GUARD_S)
            request.cancel()
            try:
                await request
            except asyncio.CancelledError:
                pass
            site.release.set()  # the rest arrives; the fetch sees the cancellation at its next read
            while media_pool.running:  # hang guard: the test's wait_for
                await asyncio.sleep(0.001)

    try:
        asyncio.run(asyncio.wait_for(main(), GUARD_S))
    finally:
        site.release.set()
        media_pool.shutdown(timeout=GUARD_S)
        app.state.gateway.pool.shutdown(timeout=GUARD_S)
    assert vision_engine.submitted == []


def test_the_app_shuts_its_media_pool_down(client, vision_engine):
    c = client(vision_engine)
    pool = c.app.state.gateway.media.pool
    assert c.post("/v1/chat/completions", json=chat_body(image_part(data_url(PNG)))).status_code == 200
    c.__exit__(None, None, None)
    assert pool.closed and not any(w.is_alive() for w in pool._workers)
