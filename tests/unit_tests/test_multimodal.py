"""Image decoding: every accepted form, pillow conversions, and refusals."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
from PIL import Image

from langchain_llamacpp_local.multimodal import ImageInputError, is_image_block, load_image


def _encode(img: Image.Image, fmt: str = "PNG", **kw: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _pattern(w: int = 8, h: int = 4) -> Image.Image:
    img = Image.new("RGB", (w, h), (10, 20, 30))
    img.putpixel((0, 0), (250, 0, 0))
    return img


PNG = _encode(_pattern())
B64 = base64.b64encode(PNG).decode()
DATA_URL = "data:image/png;base64," + B64


def test_every_form_decodes_to_the_same_pixels(tmp_path: Path) -> None:
    path = tmp_path / "x.png"
    path.write_bytes(PNG)
    forms = [
        {"type": "image", "base64": B64, "mime_type": "image/png"},
        {"type": "image", "url": DATA_URL},
        {"type": "image", "source_type": "base64", "data": B64, "mime_type": "image/png"},
        {"type": "image_url", "image_url": {"url": DATA_URL}},
        {"type": "image_url", "image_url": DATA_URL},
        B64,
        DATA_URL,
        PNG,
        _pattern(),
    ]
    ref = load_image(forms[0])
    assert (ref.width, ref.height) == (8, 4) and len(ref.rgb) == 8 * 4 * 3
    assert ref.rgb[:3] == bytes([250, 0, 0])
    for form in forms[1:]:
        assert load_image(form) == ref, form
    for local in (str(path), path, {"type": "image", "url": f"file://{path}"}):
        assert load_image(local, allow_local_files=True) == ref
    assert is_image_block(forms[0]) and is_image_block(forms[3]) and not is_image_block({"type": "text"})


def test_different_images_have_different_digests() -> None:
    other = _pattern()
    other.putpixel((1, 1), (0, 255, 0))
    assert load_image(PNG).digest != load_image(_encode(other)).digest


def test_exif_orientation_alpha_animation_cmyk_and_16_bit() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90
    rotated = load_image(_encode(_pattern(8, 4), "JPEG", exif=exif.tobytes()))
    assert (rotated.width, rotated.height) == (4, 8)
    rgba = Image.new("RGBA", (2, 2), (255, 0, 0, 0))
    assert load_image(_encode(rgba)).rgb[:3] == bytes([255, 255, 255])  # alpha over white
    frames = [Image.new("P", (4, 4), 1), Image.new("P", (4, 4), 2)]
    for f in frames:
        f.putpalette([0, 0, 0, 255, 0, 0, 0, 0, 255] + [0] * 759)
    gif = _encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    assert load_image(gif).rgb[:3] == bytes([255, 0, 0])  # first frame
    cmyk = Image.new("CMYK", (2, 2), (0, 255, 255, 0))
    r, g, b = load_image(_encode(cmyk, "JPEG")).rgb[:3]
    assert r > 200 and g < 60 and b < 60
    gray16 = Image.new("I;16", (2, 2), 65535)
    assert load_image(_encode(gray16)).rgb[:3] == bytes([255, 255, 255])


def test_pixel_limit_and_decompression_bomb() -> None:
    with pytest.raises(ImageInputError, match="400 pixels"):
        load_image(_encode(_pattern(20, 20)), max_pixels=100)
    bomb = _encode(Image.new("1", (20000, 20000)))  # 400 Mpixel, a few KB compressed
    assert len(bomb) < 200_000
    with pytest.raises(ImageInputError, match="(?i)pixels|bomb"):
        load_image(bomb)


def test_refusals(tmp_path: Path) -> None:
    path = tmp_path / "x.png"
    path.write_bytes(PNG)
    with pytest.raises(ImageInputError, match="allow_local_image_files"):
        load_image(str(path))
    with pytest.raises(ImageInputError, match="allow_remote_image_urls"):
        load_image({"type": "image", "url": "https://example.com/cat.png"})
    with pytest.raises(ImageInputError, match="base64"):
        load_image({"type": "image", "base64": "%%%not base64%%%"})
    with pytest.raises(ImageInputError, match="readable image"):
        load_image({"type": "image", "base64": base64.b64encode(b"hello").decode()})
    with pytest.raises(ImageInputError, match="block type"):
        load_image({"type": "audio", "base64": B64})


def test_remote_url_when_allowed_uses_loopback_only() -> None:
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.end_headers()
            self.wfile.write(PNG)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.handle_request, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/x.png"
    try:
        assert load_image({"type": "image", "url": url}, allow_remote_urls=True) == load_image(PNG)
    finally:
        thread.join(5)
        server.server_close()
