"""Images in requests (`api/images.py`), with real Pillow and a real loopback HTTP server: what is
accepted, and that every bad image is a 400 naming its field and the problem."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import threading

import pytest

from omlx.api.images import ImageLimits, ImageRef, decode, fetch_remote, from_base64, from_url
from omlx.errors import InvalidRequestError

pytest.importorskip("PIL", reason="needs Pillow (omlx[vision])")


def png(size: tuple[int, int] = (30, 20), mode: str = "RGBA") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, size, 128).save(buf, format="PNG")
    return buf.getvalue()


def test_a_data_url_decodes_to_rgb_at_its_size() -> None:
    ref = from_url("data:image/png;base64," + base64.b64encode(png()).decode(), "messages.0.content.0", ImageLimits())
    img = decode(ref, ImageLimits())
    assert img.size == (30, 20) and img.mode == "RGB"


def test_an_animated_gif_gives_its_first_frame() -> None:
    from PIL import Image

    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 255, 0))]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    img = decode(ImageRef("x", data=buf.getvalue()), ImageLimits())
    assert img.getpixel((0, 0))[0] > 200


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda lim: from_url("data:image/png,abc", "p", lim), "must be base64"),
        (lambda lim: from_url("ftp://host/x.png", "p", lim), "unsupported image URL scheme"),
        (lambda lim: from_url("https://host/x.png", "p", lim), "--allow-remote-images is off"),
        (lambda lim: from_base64("AAAA", "image/svg+xml", "p", lim), "unsupported image media type"),
        (lambda lim: from_base64("", "image/png", "p", lim), "non-empty base64"),
        (lambda lim: decode(ImageRef("p", data=png()[:-30]), lim), "truncated or corrupt"),
        (lambda lim: decode(ImageRef("p", data=png((200, 200))), ImageLimits(max_pixels=100 * 100)), "more than 10000"),
        (lambda lim: decode(ImageRef("p", data=png()), ImageLimits(max_bytes=10)), "larger than 10 bytes"),
        (lambda lim: from_base64(base64.b64encode(bytes(2000)).decode(), None, "p", ImageLimits(max_bytes=1000)), "larger than 1000"),
    ],
)
def test_bad_images_are_refused_naming_the_field_and_the_problem(make, words) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        make(ImageLimits())
    assert refused.value.status == 400 and refused.value.param == "p" and words in str(refused.value)


class _Images(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/missing":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def image_host():
    _Images.body = png()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_remote_images_are_fetched_when_allowed_within_the_byte_limit(image_host) -> None:
    allowed = ImageLimits(allow_remote=True, remote_timeout=5.0)
    ref = from_url(image_host + "/cat.png", "p", allowed)
    asyncio.run(fetch_remote([ref], allowed))
    assert decode(ref, allowed).size == (30, 20)
    for url, limits, words in [
        (image_host + "/missing", allowed, "HTTP 404"),
        (image_host + "/cat.png", ImageLimits(allow_remote=True, max_bytes=50), "larger than 50 bytes"),
    ]:
        with pytest.raises(InvalidRequestError) as refused:
            asyncio.run(fetch_remote([from_url(url, "p", limits)], limits))
        assert words in str(refused.value)
