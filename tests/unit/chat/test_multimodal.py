"""Image decoding: every accepted form, pillow conversions, and refusals (no network)."""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import struct
import threading
import time
import urllib.request
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image, ImageFile

from langchain_llamacpp_local.chat.images import (
    DecodedImage,
    ImageInputError,
    is_image_block,
    load_image,
)


def _encode(img: Image.Image, fmt: str = "PNG", **kw: Any) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _pattern(w: int = 8, h: int = 4) -> Image.Image:
    img = Image.new("RGB", (w, h), (10, 20, 30))
    img.putpixel((0, 0), (250, 0, 0))
    return img


def _close(px: bytes, want: tuple[int, int, int], tol: int = 40) -> bool:
    return all(abs(a - b) <= tol for a, b in zip(px, want, strict=True))


def _pixel(img: DecodedImage, x: int, y: int) -> bytes:
    i = (y * img.width + x) * 3
    return img.rgb[i : i + 3]


PNG = _encode(_pattern())
B64 = base64.b64encode(PNG).decode()
DATA_URL = "data:image/png;base64," + B64


class _Forbidden(BaseException):
    """Not an Exception, so no ``except Exception`` in the module can swallow it."""


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any download attempt fails the test, so refusals are proven to happen first."""

    def boom(*args: object, **kwargs: object) -> None:
        raise _Forbidden("network access attempted")

    monkeypatch.setattr(urllib.request, "urlopen", boom)


@pytest.fixture
def no_pixel_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any pixel decode fails the test: a refused bomb must never be allocated."""

    def boom(self: object) -> None:
        raise _Forbidden("pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", boom)


def test_every_form_decodes_to_the_same_pixels(tmp_path: Path) -> None:
    path = tmp_path / "x.png"
    path.write_bytes(PNG)
    forms: list[Any] = [
        {"type": "image", "base64": B64, "mime_type": "image/png"},
        {"type": "image", "url": DATA_URL},
        {"type": "image", "source_type": "base64", "data": B64, "mime_type": "image/png"},
        {"type": "image", "source_type": "url", "url": DATA_URL},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}},
        {"type": "image_url", "image_url": {"url": DATA_URL, "detail": "auto"}},
        {"type": "image_url", "image_url": DATA_URL},
        B64,
        DATA_URL,
        "\n".join(B64[i : i + 60] for i in range(0, len(B64), 60)),  # MIME line-wrapped
        PNG,
        bytearray(PNG),
        _pattern(),
    ]
    ref = load_image(forms[0])
    assert (ref.width, ref.height) == (8, 4) and len(ref.rgb) == 8 * 4 * 3
    assert _pixel(ref, 0, 0) == bytes([250, 0, 0]) and _pixel(ref, 1, 0) == bytes([10, 20, 30])
    for form in forms[1:]:
        got = load_image(form)
        assert (got.rgb, got.digest, got.width, got.height) == (
            ref.rgb,
            ref.digest,
            8,
            4,
        ), form
    local_forms: list[Any] = [
        str(path),
        path,
        path.as_uri(),
        {"type": "image", "url": path.as_uri()},
        {"type": "image", "url": str(path)},
        {"type": "image_url", "image_url": {"url": path.as_uri()}},
    ]
    for local in local_forms:
        assert load_image(local, allow_local_files=True) == ref, local
    assert load_image(ref) is ref  # already decoded: passed through


def test_raw_base64_jpeg_is_not_mistaken_for_a_path() -> None:
    jpeg_b64 = base64.b64encode(_encode(Image.new("RGB", (8, 8), (0, 0, 255)), "JPEG")).decode()
    assert jpeg_b64.startswith("/9j/")
    img = load_image(jpeg_b64)
    assert (img.width, img.height) == (8, 8) and _close(_pixel(img, 4, 4), (0, 0, 255))


def test_is_image_block() -> None:
    assert is_image_block({"type": "image", "base64": B64})
    assert is_image_block({"type": "image_url", "image_url": DATA_URL})
    assert not is_image_block({"type": "text", "text": "hi"})
    assert not is_image_block("hello") and not is_image_block(None)


def test_digest_identifies_pixels_and_size() -> None:
    other = _pattern()
    other.putpixel((1, 1), (0, 255, 0))
    a, b = load_image(PNG), load_image(_encode(other))
    assert a.digest != b.digest and len(a.digest) == 64
    # Same bytes, different shape: the size is part of the identity.
    wide = load_image(Image.new("RGB", (2, 1), (1, 2, 3)))
    tall = load_image(Image.new("RGB", (1, 2), (1, 2, 3)))
    assert wide.rgb == tall.rgb and wide.digest != tall.digest
    # the value itself is what cached prefixes (host RAM, disk) were keyed by
    assert a.digest == hashlib.sha256(b"%dx%d:" % (a.width, a.height) + a.rgb).hexdigest()


def test_exif_orientation_rotates_the_pixels() -> None:
    stored = Image.new("RGB", (16, 8), (0, 0, 255))
    stored.paste((255, 0, 0), (0, 0, 8, 8))  # left half red
    exif = Image.Exif()
    exif[0x0112] = 6  # display = stored rotated 90 degrees clockwise
    img = load_image(_encode(stored, "JPEG", exif=exif.tobytes(), quality=95))
    assert (img.width, img.height) == (8, 16)
    assert _close(_pixel(img, 4, 3), (255, 0, 0)) and _close(_pixel(img, 4, 12), (0, 0, 255))


def test_alpha_is_composited_on_white() -> None:
    assert load_image(_encode(Image.new("RGBA", (2, 2), (255, 0, 0, 0)))).rgb[:3] == b"\xff" * 3
    half = load_image(_encode(Image.new("RGBA", (2, 2), (0, 0, 0, 128)))).rgb[:3]
    assert all(120 <= c <= 135 for c in half)
    assert load_image(_encode(Image.new("LA", (2, 2), (0, 0)))).rgb[:3] == b"\xff" * 3
    pal = Image.new("P", (2, 2), 0)
    pal.putpalette([0, 0, 0] * 256)
    assert load_image(_encode(pal, transparency=0)).rgb[:3] == b"\xff" * 3


@pytest.mark.parametrize("fmt", ["GIF", "PNG", "WEBP"])
def test_animation_takes_the_first_frame(fmt: str) -> None:
    red, blue = Image.new("RGB", (4, 4), (255, 0, 0)), Image.new("RGB", (4, 4), (0, 0, 255))
    kw: dict[str, Any] = {"save_all": True, "append_images": [blue], "duration": 100}
    if fmt == "GIF":
        red, blue = (f.convert("P", palette=Image.Palette.ADAPTIVE) for f in (red, blue))
        kw["append_images"] = [blue]
    if fmt == "WEBP":
        kw["lossless"] = True
    data = _encode(red, fmt, **kw)
    with Image.open(io.BytesIO(data)) as check:
        assert getattr(check, "n_frames", 1) == 2  # really animated
    img = load_image(data)
    assert (img.width, img.height) == (4, 4) and _close(_pixel(img, 2, 2), (255, 0, 0), 5)


def test_cmyk_16_bit_gray_and_static_webp() -> None:
    r, g, b = load_image(_encode(Image.new("CMYK", (2, 2), (0, 255, 255, 0)), "JPEG")).rgb[:3]
    assert r > 200 and g < 60 and b < 60
    gray16 = Image.new("I;16", (2, 2), 0x8000)
    assert load_image(_encode(gray16)).rgb[:3] == bytes([128] * 3)  # scaled, not clipped
    webp = load_image(_encode(Image.new("RGB", (3, 5), (0, 200, 0)), "WEBP", lossless=True))
    assert (webp.width, webp.height) == (3, 5) and webp.rgb[:3] == bytes([0, 200, 0])


def _zero_png(width: int, height: int) -> bytes:
    """A 1-bit all-black PNG built row-block by row-block, never holding its pixels."""

    def chunk(tag: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body))

    row = b"\x00" * (1 + (width + 7) // 8)
    comp = zlib.compressobj(9)
    idat = b"".join(comp.compress(row * 500) for _ in range(height // 500)) + comp.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def test_pixel_limit_names_the_size() -> None:
    with pytest.raises(ImageInputError, match="20x20 = 400 pixels"):
        load_image(_encode(_pattern(20, 20)), max_pixels=100)
    with pytest.raises(ImageInputError, match="400 pixels"):
        load_image(_pattern(20, 20), max_pixels=100)
    assert load_image(_encode(_pattern(10, 10)), max_pixels=100).width == 10  # at the limit


@pytest.mark.usefixtures("no_pixel_decode")
def test_decompression_bombs_are_refused_before_decoding() -> None:
    bomb = _zero_png(20000, 20000)  # 400 Mpixel: 1.2 GB as RGB
    assert len(bomb) < 100_000
    start = time.perf_counter()
    with pytest.raises(ImageInputError, match="pixels"):
        load_image({"type": "image", "base64": base64.b64encode(bomb).decode()})
    # Even with a huge budget, pillow's own bomb guard refuses it before decoding.
    with pytest.raises(ImageInputError, match="pixels"):
        load_image(bomb, max_pixels=10**12)
    # Under pillow's guard but over our default budget of 50 Mpixel.
    with pytest.raises(ImageInputError, match="8000x8000 = 64000000 pixels"):
        load_image(_zero_png(8000, 8000))
    assert time.perf_counter() - start < 2.0


def test_local_files_refused_by_default(tmp_path: Path) -> None:
    path = tmp_path / "x.png"
    path.write_bytes(PNG)
    for form in (str(path), path, {"type": "image", "url": path.as_uri()}):
        with pytest.raises(ImageInputError, match="allow_local_image_files=True"):
            load_image(form)
    with pytest.raises(ImageInputError, match="not found"):
        load_image(tmp_path / "missing.png", allow_local_files=True)


@pytest.mark.usefixtures("no_network")
def test_remote_urls_refused_by_default() -> None:
    url = "https://example.com/cat.png"
    forms: list[Any] = [
        url,
        {"type": "image", "url": url},
        {"type": "image", "source_type": "url", "url": url},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    for form in forms:
        with pytest.raises(
            ImageInputError, match="remote image URLs are disabled.*allow_remote_image_urls=True"
        ):
            load_image(form)
    # Local files being allowed does not open the network.
    with pytest.raises(ImageInputError, match="allow_remote_image_urls"):
        load_image(url, allow_local_files=True)


@pytest.fixture
def loopback_server() -> Iterator[str]:
    """Serve PNG at /x.png and 404 elsewhere, on 127.0.0.1 only."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            if self.path != "/x.png":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            self.wfile.write(PNG)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    # a short poll: shutdown() waits for the loop to look (0.5 s by default)
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_remote_url_when_allowed(loopback_server: str) -> None:
    url = loopback_server + "/x.png"
    ref = load_image(PNG)
    assert load_image({"type": "image", "url": url}, allow_remote_urls=True) == ref
    assert (
        load_image({"type": "image_url", "image_url": {"url": url}}, allow_remote_urls=True) == ref
    )
    with pytest.raises(ImageInputError, match="could not download"):
        load_image(loopback_server + "/missing.png", allow_remote_urls=True, timeout=5)


def test_garbage_and_unknown_inputs_are_refused() -> None:
    with pytest.raises(ImageInputError, match="base64"):
        load_image({"type": "image", "base64": "%%%not base64%%%"})
    with pytest.raises(ImageInputError, match="base64"):
        load_image("data:image/png;base64,@@@@")
    with pytest.raises(ImageInputError, match="readable image"):
        load_image({"type": "image", "base64": base64.b64encode(b"hello, not an image").decode()})
    with pytest.raises(ImageInputError, match="could not be decoded"):
        load_image(PNG[: len(PNG) - 30])  # truncated inside the pixel data
    with pytest.raises(ImageInputError, match="'audio'"):
        load_image({"type": "audio", "base64": B64})
    with pytest.raises(ImageInputError, match="int"):
        load_image(42)
    with pytest.raises(ImageInputError, match="neither"):
        load_image({"type": "image"})
    assert issubclass(ImageInputError, ValueError)


def test_decoding_a_large_base64_image_holds_the_gil_in_short_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 72 MB base64 payload (plain, and line-wrapped) is decoded in steps of at most
    ``_B64_STEP`` characters, each one short C call holding the GIL, so another thread (an
    event loop, say) gets in between them; one whole ``b64decode`` holds it for about a
    third of a second. The steps are counted, not timed (a wall-clock bound flakes on a
    loaded machine)."""
    import os

    from langchain_llamacpp_local.chat import images

    calls: list[int] = []
    decode = images.base64.b64decode

    def counting(data: Any, *args: Any, **kwargs: Any) -> bytes:
        calls.append(len(data))
        return decode(data, *args, **kwargs)

    monkeypatch.setattr(images.base64, "b64decode", counting)
    payload = base64.b64encode(os.urandom(54_000_000)).decode()
    wrapped = "\n".join(payload[i : i + 76] for i in range(0, 8_000_000, 76)) + payload[8_000_000:]
    for block in ({"type": "image", "base64": payload}, wrapped):
        calls.clear()
        with pytest.raises(ImageInputError, match="image"):  # random bytes are no image
            load_image(block)
        assert sum(calls) >= len(payload)  # every character decoded, in steps
        assert max(calls) <= images._B64_STEP
        assert len(calls) >= len(payload) // images._B64_STEP
