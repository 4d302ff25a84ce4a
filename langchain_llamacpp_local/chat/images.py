"""Turn the image forms LangChain users send into RGB pixels, safely.

Accepted in messages: v1 ``{"type": "image", "base64": ..., "mime_type": ...}`` and
``{"type": "image", "url": "data:..."}``, the older ``source_type`` blocks, OpenAI
``{"type": "image_url", "image_url": {"url": ...}}`` and Anthropic-style ``source``
blocks; a block's url may be a local file path only when allowed and a remote
``http(s)`` URL only when allowed (a model call makes no network access by default).
:func:`load_image` itself also takes raw base64 or ``data:`` strings, bytes and PIL
images (no message form carries those). Decoding applies EXIF orientation, converts palette/alpha/CMYK/16-bit
images to RGB (alpha over white), takes the first frame of animations and refuses
images over a pixel budget before decoding them (decompression bombs).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import ExifTags, Image, ImageFile, ImageOps

from langchain_llamacpp_local.errors import ImageInputError, InvalidRequestError

MAX_DOWNLOAD_BYTES = 50 * 1024 * 1024


@dataclass(frozen=True)
class DecodedImage:
    """Decoded pixels in the layout mtmd_bitmap_init takes, plus a cache identity."""

    width: int
    height: int
    rgb: bytes  # width*height*3 bytes, row-major RGB (what mtmd_bitmap_init takes)
    digest: str  # identifies the pixels, so an unchanged image extends a cached prefix

    @property
    def mtmd_input(self) -> tuple[int, int, bytes, str]:
        """The form ``Engine.tokenize_multimodal`` takes for an image."""
        return (self.width, self.height, self.rgb, self.digest)


def is_image_block(block: Any) -> bool:
    """Whether a message content block carries an image (so it needs load_image)."""
    return isinstance(block, dict) and block.get("type") in ("image", "image_url")


def load_image(
    block: Any,
    *,
    allow_local_files: bool = False,
    allow_remote_urls: bool = False,
    max_pixels: int = 50_000_000,
    timeout: float = 10.0,
) -> DecodedImage:
    """Decode ``block`` (any accepted form) into RGB pixels."""
    if isinstance(block, DecodedImage):
        return block
    if isinstance(block, Image.Image):
        return _finish(block, max_pixels)
    data = _bytes_of(block, allow_local_files, allow_remote_urls, timeout)
    return _decode(data, max_pixels)


def _bytes_of(block: Any, local: bool, remote: bool, timeout: float) -> bytes | bytearray:
    if isinstance(block, (bytes, bytearray, memoryview)):
        return bytes(block)
    if isinstance(block, Path):
        return _read_file(str(block), local)
    if isinstance(block, str):
        return _from_string(block, local, remote, timeout)
    if not isinstance(block, dict):
        raise ImageInputError(f"unsupported image input of type {type(block).__name__}")
    btype = block.get("type")
    if btype == "image_url":
        url = block.get("image_url")
        if isinstance(url, dict):
            url = url.get("url")
        if not isinstance(url, str):
            raise ImageInputError("image_url block has no url")
        return _from_string(url, local, remote, timeout, plain_base64=False)
    if btype == "image":
        if isinstance(block.get("base64"), str):
            return _b64(block["base64"])
        if isinstance(block.get("base64"), (bytes, bytearray, memoryview)):
            return _bytes_field(bytes(block["base64"]))
        source = block.get("source_type")
        if source == "base64" and isinstance(block.get("data"), str):
            return _b64(block["data"])
        src = block.get("source")  # Anthropic style: {"type": "base64"|"url", ...}
        if isinstance(src, dict):
            if src.get("type") == "base64" and isinstance(src.get("data"), str):
                return _b64(src["data"])
            if src.get("type") == "url" and isinstance(src.get("url"), str):
                return _from_string(src["url"], local, remote, timeout, plain_base64=False)
        url = block.get("url")
        if source == "url" and not isinstance(url, str):
            url = block.get("data")
        if isinstance(url, str):
            return _from_string(url, local, remote, timeout, plain_base64=False)
        if "file_id" in block or source == "id":
            raise ImageInputError(
                "image blocks referencing a provider file id cannot be used locally; "
                "send the image as base64"
            )
        raise ImageInputError("image block has neither base64 data nor a url")
    raise ImageInputError(f"unsupported content block type {btype!r} for an image")


def _from_string(
    s: str, local: bool, remote: bool, timeout: float, *, plain_base64: bool = True
) -> bytes | bytearray:
    s = s.strip()
    if s[:5].lower() == "data:":
        head, sep, payload = s.partition(",")
        if not sep or ";base64" not in head.lower():
            raise ImageInputError("only base64 data: URLs are supported for images")
        return _b64(payload)
    if s[:8].lower().startswith(("http://", "https://")):
        if not remote:
            raise ImageInputError(
                "remote image URLs are disabled (a model call makes no network access "
                "by default); send the image as base64, or set allow_remote_image_urls=True "
                "on ChatLlamaCpp to let it download"
            )
        return _download(s, timeout)
    if s[:7].lower() == "file://":
        path = urllib.request.url2pathname(urllib.parse.urlparse(s).path)
        return _read_file(path, local)
    if "://" in s[:16]:
        raise ImageInputError(f"unsupported image URL scheme in {s[:40]!r}")
    # Raw base64 (JPEG's starts with "/9j/", so a leading "/" proves nothing); a real
    # path almost always holds a character outside the base64 alphabet ("." or "\").
    if plain_base64 and len(s) >= 64 and _looks_base64(s):
        return _b64(s)
    return _read_file(s, local)


def _bytes_field(data: bytes) -> bytes:
    """A ``base64`` field given as bytes: base64 text encoded as ASCII (what
    ``base64.b64encode`` returns), else the image file's own bytes."""
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        return data  # not base64 text: the file's bytes (pillow says if they are not)
    try:
        return _b64(text)
    except ImageInputError:
        return data


#: Characters of base64 decoded per step: each step is one short C call, so a thread
#: decoding a 70 MB image lets other threads (an event loop) in every millisecond or so.
_B64_STEP = 1 << 18


def _b64(payload: str) -> bytes:
    """An image's base64 (:func:`decode_base64` with image errors)."""
    return decode_base64(payload)


def decode_base64(
    payload: str, *, what: str = "image", error: type[InvalidRequestError] = ImageInputError
) -> bytes:
    """Decode base64 (line-wrapped or URL-safe too) in steps of :data:`_B64_STEP`
    characters: one ``b64decode`` (or one ``str.join``) of a whole large image holds
    the GIL for a third of a second, stalling every other thread, an asyncio loop
    included. The pieces are joined by ``bytes.join``, which copies a large result
    with the GIL released (a growing ``bytearray`` copies itself holding it)."""
    parts: list[bytes] = []
    carry = ""
    try:
        for start in range(0, len(payload), _B64_STEP):
            # line-wrapped base64 (MIME style) is common; URL-safe letters are mapped
            piece = carry + "".join(payload[start : start + _B64_STEP].split())
            piece = piece.replace("-", "+").replace("_", "/")
            cut = len(piece) - len(piece) % 4
            if cut > 4 and "=" in piece[: cut - 4]:
                raise ValueError("padding before the end of the data")
            parts.append(base64.b64decode(piece[:cut], validate=True))
            carry = piece[cut:]
        if carry:
            parts.append(base64.b64decode(carry + "=" * (-len(carry) % 4), validate=True))
    except (binascii.Error, ValueError) as exc:
        raise error(f"{what} data is not valid base64: {exc}") from None
    out = b"".join(parts)
    if not out:
        raise error(f"{what} data is empty")
    return out


class _BufferReader(io.RawIOBase):
    """A seekable file over a buffer without copying it (``io.BytesIO`` copies a
    bytearray: tens of milliseconds holding the GIL for a large image)."""

    def __init__(self, data: bytes | bytearray) -> None:
        self._view = memoryview(data)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        chunk = self._view[self._pos : self._pos + len(buffer)]
        buffer[: len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


def _looks_base64(s: str) -> bool:
    """Whether ``s`` is base64 text (whitespace allowed, at most two ``=`` at the end),
    checked in steps: the regex engine holds the GIL."""
    core = s.rstrip()
    body = core.rstrip("=")
    if len(core) - len(body) > 2:
        return False
    return all(
        _B64_BODY_RE.fullmatch(body, i, min(i + _B64_STEP, len(body)))
        for i in range(0, len(body), _B64_STEP)
    )


_B64_BODY_RE = re.compile(r"[A-Za-z0-9+/_\-\s]*")


def _read_file(path: str, local: bool) -> bytes:
    if not local:
        raise ImageInputError(
            "local image files are disabled (a prompt could otherwise read any file); "
            "set allow_local_image_files=True on ChatLlamaCpp to allow paths"
        )
    p = Path(path).expanduser()
    if not p.is_file():
        raise ImageInputError(f"image file not found: {path}")
    try:
        return p.read_bytes()
    except OSError as exc:
        raise ImageInputError(f"image file could not be read: {exc}") from None


def _download(url: str, timeout: float) -> bytes:
    """Fetch an opted-in remote image, never more than MAX_DOWNLOAD_BYTES."""
    req = urllib.request.Request(url, headers={"User-Agent": "langchain-llamacpp-local"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (opt-in)
            length = resp.headers.get("Content-Length")
            if length and length.isdigit() and int(length) > MAX_DOWNLOAD_BYTES:
                raise ImageInputError(
                    f"image at {url} is {length} bytes, over the {MAX_DOWNLOAD_BYTES} byte cap"
                )
            data = resp.read(MAX_DOWNLOAD_BYTES + 1)
    except ImageInputError:
        raise
    except (OSError, ValueError) as exc:  # URLError, HTTPError, timeouts are OSErrors
        raise ImageInputError(f"could not download image from {url}: {exc}") from None
    if len(data) > MAX_DOWNLOAD_BYTES:
        raise ImageInputError(f"image at {url} is larger than {MAX_DOWNLOAD_BYTES} bytes")
    return data


def _decode(data: bytes | bytearray, max_pixels: int) -> DecodedImage:
    try:
        # Image.open reads only the header; pillow itself raises DecompressionBombError
        # past 2 * Image.MAX_IMAGE_PIXELS, and _finish checks max_pixels before load().
        img = Image.open(io.BufferedReader(_BufferReader(data)))
    except Image.DecompressionBombError as exc:
        raise ImageInputError(f"image refused as a decompression bomb: {exc}") from None
    except Exception as exc:  # pillow raises many types on hostile input
        raise ImageInputError(f"not a readable image: {exc}") from None
    return _finish(img, max_pixels)


def _allocate_lazily(img: Image.Image) -> None:
    """Give a file's image, before it is decoded, pixel memory that the kernel zeroes
    page by page as the decoder (GIL released) writes it.

    Pillow's own allocation is made of 16 MiB blocks; once large blocks have been freed,
    glibc serves such sizes from its heap (its mmap threshold rises up to 32 MiB) and
    zeroes them with ``memset``, all of it (~150 MB for 6000x6000) holding the GIL:
    60-150 ms here during which no other thread runs. A single block of the whole image
    is a fresh mapping once it is past that threshold, and costs nothing up front."""
    new_block = getattr(Image.core, "new_block", None)
    if (
        new_block is None
        or not isinstance(img, ImageFile.ImageFile)
        or img.mode not in _LAZY_MODES
        or getattr(img, "_im", 0) is not None  # loaded already (or an unknown Pillow)
    ):
        return
    try:
        img.im = new_block(img.mode, img.size)
    except (MemoryError, ValueError):  # Pillow allocates its own way, as always
        return


#: Modes :func:`_allocate_lazily` gives a single block (no palette to attach).
_LAZY_MODES = frozenset({"RGB", "RGBA", "L", "LA"})


def _finish(img: Image.Image, max_pixels: int) -> DecodedImage:
    w, h = img.size
    if w * h > max_pixels:  # checked on the header, before any pixel is decoded
        raise ImageInputError(
            f"image of {w}x{h} = {w * h} pixels exceeds the limit of {max_pixels} pixels"
        )
    try:
        if getattr(img, "n_frames", 1) > 1:
            img.seek(0)  # animations (GIF/APNG/WebP): the first frame only
        _allocate_lazily(img)
        img.load()
        if img.getexif().get(ExifTags.Base.Orientation, 1) != 1:
            # only then: exif_transpose copies an image it does not turn
            img = ImageOps.exif_transpose(img) or img
        if img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (
            img.mode in ("P", "L", "RGB") and "transparency" in img.info
        ):
            rgba = img.convert("RGBA")
            canvas = Image.new("RGB", rgba.size, (255, 255, 255))
            canvas.paste(rgba, mask=rgba.getchannel("A"))  # alpha over white
            img = canvas
        elif img.mode.startswith("I;16") or img.mode == "I":
            # 16-bit gray: keep the top 8 bits (convert("L") would clip at 255).
            img = img.point(lambda v: v / 256).convert("L").convert("RGB")
        elif img.mode != "RGB":  # convert() of an RGB image is a copy
            img = img.convert("RGB")
        rgb = img.tobytes()  # its final join of the pixels releases the GIL
    except Image.DecompressionBombError as exc:
        raise ImageInputError(f"image refused as a decompression bomb: {exc}") from None
    except MemoryError:
        raise ImageInputError(f"image of {w}x{h} pixels is too large to decode") from None
    except Exception as exc:  # truncated/corrupt data surfaces only at load()
        raise ImageInputError(f"the image could not be decoded: {exc}") from None
    if len(rgb) != img.width * img.height * 3:
        raise ImageInputError("the image decoded to an unexpected pixel layout")
    # fed in two parts: prefix + rgb would copy the pixels holding the GIL (sha256 of a
    # large buffer releases it)
    sha = hashlib.sha256(f"{img.width}x{img.height}:".encode())
    sha.update(rgb)
    return DecodedImage(img.width, img.height, rgb, sha.hexdigest())
