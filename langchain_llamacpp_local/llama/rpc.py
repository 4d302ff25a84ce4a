"""llama.cpp's RPC backend: remote ggml devices that hold a model's layers.

An ``rpc-server`` (here :mod:`langchain_llamacpp_local.rpc_server`) exposes its
machine's CPU/GPUs over TCP; registering its endpoint adds one ggml device per
remote device, and a model loaded with those devices in its list keeps its layers
and KV cache there. llama-cpp-python 0.3.36 has no working Python API for this
(``Llama(rpc_servers=...)`` is ignored), so this module calls ggml directly:

* ggml's symbols are looked up through llama_cpp's own ``libllama`` handle, so they
  resolve to the ``libggml`` that libllama uses. The wheel also ships a second copy
  (``libggml.so`` next to ``libggml.so.0``); loading that one by path would create
  a second device registry that llama.cpp never sees.
* The RPC backend is reached through the registry (``ggml_backend_reg_by_name("RPC")``)
  like llama.cpp's own tools do; it exists only in builds made with ``-DGGML_RPC=ON``.
* Registering a server is process-global and permanent, so every model loaded while
  RPC is compiled in gets an explicit device list (:func:`model_devices`): the
  endpoints of *that* model plus the local GPUs llama.cpp would pick by default.
* ggml aborts the whole process when it cannot connect or handshake, so each
  endpoint is first checked here with the protocol's HELLO (:func:`probe_server`).
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import socket
import struct
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import metadata

import llama_cpp.llama_cpp as C

from langchain_llamacpp_local.errors import ModelLoadError, RpcError
from langchain_llamacpp_local.llama.backend import init_backend

logger = logging.getLogger(__name__)

#: ggml-rpc protocol version this package speaks (``RPC_PROTO_*`` in ggml-rpc.h).
RPC_PROTO_MAJOR = 7
RPC_PROTO_MINOR = 0
_CMD_HELLO = 14
_CMD_DEVICE_COUNT = 15
_CONN_CAPS_SIZE = 24
_HELLO_RSP_SIZE = 4 + _CONN_CAPS_SIZE

#: Seconds to wait for a server's HELLO before giving up (it serves one client at a time).
PROBE_TIMEOUT = 10.0

# enum ggml_backend_dev_type
DEV_CPU, DEV_GPU, DEV_IGPU, DEV_ACCEL, DEV_META = range(5)
_DEV_TYPES = {DEV_CPU: "CPU", DEV_GPU: "GPU", DEV_IGPU: "iGPU", DEV_ACCEL: "accelerator"}


def install_command() -> str:
    """The command that reinstalls the current llama-cpp-python with RPC compiled in."""
    try:
        version = metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:  # pragma: no cover - llama_cpp imported above
        version = "0.3.36"
    return (
        'CMAKE_ARGS="-DGGML_RPC=ON" pip install --force-reinstall --no-cache-dir '
        f"--no-deps llama-cpp-python=={version}"
    )


# --------------------------------------------------------------------------- ggml


class _Caps(ctypes.Structure):
    _fields_ = [
        ("async_", ctypes.c_bool),
        ("host_buffer", ctypes.c_bool),
        ("buffer_from_host_ptr", ctypes.c_bool),
        ("events", ctypes.c_bool),
        ("mmap_support", ctypes.c_bool),
    ]


class _DevProps(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("description", ctypes.c_char_p),
        ("memory_free", ctypes.c_size_t),
        ("memory_total", ctypes.c_size_t),
        ("type", ctypes.c_int),
        ("device_id", ctypes.c_char_p),
        ("caps", _Caps),
    ]


class _Ggml:
    """Prototypes of the ggml-backend registry functions, bound in libllama's scope."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, s, i, z = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_size_t

        def fn(name: str, restype: object, *argtypes: object) -> ctypes._CFuncPtr:
            return ctypes.CFUNCTYPE(restype, *argtypes)((name, lib))  # type: ignore[arg-type]

        self.reg_by_name = fn("ggml_backend_reg_by_name", p, s)
        self.reg_name = fn("ggml_backend_reg_name", s, p)
        self.reg_dev_count = fn("ggml_backend_reg_dev_count", z, p)
        self.reg_dev_get = fn("ggml_backend_reg_dev_get", p, p, z)
        self.reg_get_proc_address = fn("ggml_backend_reg_get_proc_address", p, p, s)
        self.register = fn("ggml_backend_register", None, p)
        self.dev_count = fn("ggml_backend_dev_count", z)
        self.dev_get = fn("ggml_backend_dev_get", p, z)
        self.dev_by_name = fn("ggml_backend_dev_by_name", p, s)
        self.dev_name = fn("ggml_backend_dev_name", s, p)
        self.dev_description = fn("ggml_backend_dev_description", s, p)
        self.dev_type = fn("ggml_backend_dev_type", i, p)
        self.dev_backend_reg = fn("ggml_backend_dev_backend_reg", p, p)
        self.dev_get_props = fn("ggml_backend_dev_get_props", None, p, ctypes.POINTER(_DevProps))


@cache
def _ggml() -> _Ggml:
    init_backend()  # routes ggml's log through logging first
    return _Ggml(C._lib)


_AddServer = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)
_StartServer = ctypes.CFUNCTYPE(
    None,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_size_t,
    ctypes.c_size_t,
    ctypes.POINTER(ctypes.c_void_p),
)


def _rpc_reg() -> int | None:
    return _ggml().reg_by_name(b"RPC") or None


def rpc_unavailable_reason() -> str | None:
    """Why RPC cannot be used with the installed llama-cpp-python (None: it can)."""
    if _rpc_reg() is None:
        return (
            "the installed llama-cpp-python was built without llama.cpp's RPC backend; "
            f"reinstall it with: {install_command()}"
        )
    return None


def rpc_available() -> bool:
    return rpc_unavailable_reason() is None


def _require_rpc() -> int:
    reg = _rpc_reg()
    if reg is None:
        raise RpcError(rpc_unavailable_reason() or "RPC backend missing")
    return reg


def _proc(name: str) -> int:
    addr = _ggml().reg_get_proc_address(_require_rpc(), name.encode())
    if not addr:
        raise RpcError(f"this llama.cpp build's RPC backend has no {name}")
    return addr


# --------------------------------------------------------------------------- endpoints


def parse_endpoint(endpoint: str) -> str:
    """Validate ``host:port`` (the form llama.cpp accepts) and return it normalised."""
    if not isinstance(endpoint, str):
        raise ValueError(f"an RPC endpoint must be a 'host:port' string, not {endpoint!r}")
    text = endpoint.strip()
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"RPC endpoint {endpoint!r} is not 'host:port'")
    if ":" in host or "[" in host:
        raise ValueError(
            f"RPC endpoint {endpoint!r}: llama.cpp's RPC client does not take IPv6 "
            "addresses; use an IPv4 address or a host name"
        )
    # isascii: '²'.isdigit() is true, yet int() refuses it
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise ValueError(
            f"RPC endpoint {endpoint!r}: port must be a number in 1..65535, not {port!r}"
        )
    return f"{host}:{int(port)}"


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (binding there exposes nothing)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _ProtocolError(Exception):
    """The peer answered, but not as ggml's RPC server does."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise _ProtocolError("it closed the connection during the handshake")
        data += part
    return data


def _call(sock: socket.socket, cmd: int, payload: bytes, expect: int) -> bytes:
    """One request/response: ``cmd`` (1 byte), size (u64 LE), payload; size, reply."""
    sock.sendall(bytes([cmd]) + struct.pack("<Q", len(payload)) + payload)
    (size,) = struct.unpack("<Q", _recv_exact(sock, 8))
    if size != expect:
        raise _ProtocolError(f"a {size}-byte reply where the protocol has {expect} bytes")
    return _recv_exact(sock, size)


def probe_server(endpoint: str, timeout: float = PROBE_TIMEOUT) -> int:
    """Handshake with an RPC server the way ggml does and return its device count.

    ggml's client aborts the process on any connection failure, so this runs first
    and turns each failure into an :class:`RpcError` that says what went wrong.
    """
    host, _, port = parse_endpoint(endpoint).rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as sock:
            hello = _call(sock, _CMD_HELLO, bytes(_CONN_CAPS_SIZE), _HELLO_RSP_SIZE)
            major, minor, patch = hello[0], hello[1], hello[2]
            if major != RPC_PROTO_MAJOR or minor > RPC_PROTO_MINOR:
                raise RpcError(
                    f"RPC server {endpoint} speaks protocol {major}.{minor}.{patch}; this "
                    f"llama.cpp speaks {RPC_PROTO_MAJOR}.{RPC_PROTO_MINOR}: run the same "
                    "llama.cpp version on both sides"
                )
            (count,) = struct.unpack("<I", _call(sock, _CMD_DEVICE_COUNT, b"", 4))
    except RpcError:
        raise
    except _ProtocolError as e:
        raise RpcError(
            f"{endpoint} is not a compatible llama.cpp RPC server ({e}); start one with "
            "python -m langchain_llamacpp_local.rpc_server"
        ) from None
    except TimeoutError:
        raise RpcError(
            f"RPC server {endpoint} did not answer within {timeout:g} s (an RPC server "
            "serves one client at a time: is another process using it?)"
        ) from None
    except OSError as e:
        raise RpcError(f"cannot reach RPC server {endpoint}: {e}") from None
    if count == 0:
        raise RpcError(f"RPC server {endpoint} exposes no devices")
    return int(count)


# --------------------------------------------------------------------------- devices


@dataclass(frozen=True)
class DeviceInfo:
    """One ggml device as llama.cpp sees it."""

    name: str
    description: str
    type: str
    memory_free: int
    memory_total: int


def _info(dev: int) -> DeviceInfo:
    g = _ggml()
    props = _DevProps()
    g.dev_get_props(dev, ctypes.byref(props))
    return DeviceInfo(
        name=(props.name or b"").decode(),
        description=(props.description or b"").decode(),
        type=_DEV_TYPES.get(props.type, str(props.type)),
        memory_free=int(props.memory_free),
        memory_total=int(props.memory_total),
    )


def local_devices() -> list[DeviceInfo]:
    """This machine's ggml devices (what an RPC server here can expose)."""
    g = _ggml()
    out = []
    for i in range(g.dev_count()):
        dev = g.dev_get(i)
        if not _is_rpc_device(dev):
            out.append(_info(dev))
    return out


def _is_rpc_device(dev: int) -> bool:
    g = _ggml()
    return g.reg_name(g.dev_backend_reg(dev)) == b"RPC"


def _default_local_devices() -> list[int]:
    """The local GPUs llama.cpp offloads to by default (``llama_prepare_model_devices``)."""
    g = _ggml()
    gpus: list[int] = []
    gpu_ids: set[bytes] = set()
    igpus: list[int] = []
    for i in range(g.dev_count()):
        dev = g.dev_get(i)
        kind = g.dev_type(dev)
        if kind == DEV_GPU and not _is_rpc_device(dev):
            props = _DevProps()
            g.dev_get_props(dev, ctypes.byref(props))
            if props.device_id and props.device_id in gpu_ids:
                continue  # the same physical GPU seen by a second backend
            if props.device_id:
                gpu_ids.add(props.device_id)
            gpus.append(dev)
        elif kind == DEV_IGPU and (
            not igpus or g.dev_backend_reg(dev) == g.dev_backend_reg(igpus[-1])
        ):
            igpus.append(dev)
    return gpus + (igpus if not gpus else [])


_lock = threading.Lock()
_servers: dict[str, list[int]] = {}  # endpoint -> its registered ggml devices
_in_use: Counter[str] = Counter()  # endpoint -> live models holding a connection


def _add_server(endpoint: str) -> list[int]:
    """Register ``endpoint``'s devices (once per process) after checking it answers."""
    devices = _servers.get(endpoint)
    if _in_use[endpoint] == 0:
        # no live connection of ours: check the server before ggml (which would abort)
        count = probe_server(endpoint)
        if devices is not None and count != len(devices):
            raise RpcError(
                f"RPC server {endpoint} now exposes {count} devices but had {len(devices)} "
                "when this process registered it (ggml keeps the first registration): "
                "restart this process, or the server with its former --device list"
            )
    if devices is not None:
        return devices
    g = _ggml()
    reg = _AddServer(_proc("ggml_backend_rpc_add_server"))(endpoint.encode())
    if not reg:
        raise RpcError(f"RPC server {endpoint} exposes no devices")
    g.register(reg)
    devices = [g.reg_dev_get(reg, i) for i in range(g.reg_dev_count(reg))]
    _servers[endpoint] = devices
    logger.info(
        "registered RPC server %s: %s",
        endpoint,
        ", ".join(g.dev_name(d).decode() for d in devices),
    )
    return devices


class DevicePlacement:
    """The device list (and split) for one model load; holds its RPC servers until released.

    ``devices`` is None where llama.cpp's default applies (RPC not compiled in,
    no endpoints, no split); otherwise a NULL-terminated array for
    ``llama_model_params.devices``.
    """

    def __init__(self, rpc_servers: Sequence[str], tensor_split: Sequence[float] | None) -> None:
        self.endpoints = tuple(parse_endpoint(e) for e in rpc_servers)
        self.devices: ctypes.Array[ctypes.c_void_p] | None = None
        self.tensor_split: ctypes.Array[ctypes.c_float] | None = None
        self.names: list[str] = []
        self._held: list[str] = []
        if len(set(self.endpoints)) != len(self.endpoints):
            raise ValueError(f"rpc_servers lists an endpoint twice: {list(rpc_servers)}")
        if self.endpoints:
            _require_rpc()
        elif _rpc_reg() is None and tensor_split is None:
            return  # no RPC registry: llama.cpp's default device list is the right one
        remote: list[int] = []
        with _lock:
            try:
                for ep in self.endpoints:
                    remote.extend(_add_server(ep))
                    _in_use[ep] += 1
                    self._held.append(ep)
            except BaseException:
                self._drop()
                raise
        devs = remote + _default_local_devices()  # RPC first, as llama.cpp orders them
        g = _ggml()
        self.names = [g.dev_name(d).decode() for d in devs]
        self.devices = (ctypes.c_void_p * (len(devs) + 1))(*devs, None)
        if tensor_split is not None:
            self._set_split(list(tensor_split))

    def _set_split(self, split: list[float]) -> None:
        if len(split) != len(self.names):
            devices = ", ".join(self.names) or "none"
            raise ModelLoadError(
                f"tensor_split has {len(split)} entries but this model has "
                f"{len(self.names)} offload devices ({devices}); give one proportion per device"
            )
        arr = (ctypes.c_float * max(C.llama_max_devices(), len(split)))()
        for i, v in enumerate(split):
            arr[i] = v
        self.tensor_split = arr

    def apply(self, mparams: C.llama_model_params) -> None:
        """Point ``mparams`` at this placement (keep ``self`` alive while loading)."""
        if self.devices is not None:
            mparams.devices = ctypes.cast(self.devices, ctypes.c_void_p)
        if self.tensor_split is not None:
            mparams.tensor_split = ctypes.cast(self.tensor_split, ctypes.POINTER(ctypes.c_float))

    def release(self) -> None:
        """Forget this model's hold on its servers (after its model is freed)."""
        with _lock:
            self._drop()

    def _drop(self) -> None:  # caller holds _lock
        for ep in self._held:
            _in_use[ep] -= 1
        self._held = []


# --------------------------------------------------------------------------- server


def pick_server_devices(names: Sequence[str]) -> list[int]:
    """Devices for an RPC server: the named ones, else the accelerators, else the CPU."""
    g = _ggml()
    if names:
        devs = []
        for name in names:
            dev = g.dev_by_name(name.encode())
            if not dev or _is_rpc_device(dev):
                known = ", ".join(d.name for d in local_devices())
                raise ValueError(f"unknown device {name!r}; this machine has: {known}")
            devs.append(dev)
        return devs
    devs = []
    for i in range(g.dev_count()):
        dev = g.dev_get(i)
        if g.dev_type(dev) not in (DEV_CPU, DEV_ACCEL) and not _is_rpc_device(dev):
            devs.append(dev)
    if devs:
        return devs
    return [g.dev_get(i) for i in range(g.dev_count()) if g.dev_type(g.dev_get(i)) == DEV_CPU][:1]


def start_server(
    endpoint: str, devices: Sequence[int], *, cache_dir: str | None, n_threads: int
) -> None:
    """Serve ``devices`` on ``endpoint``; returns only if the server could not start."""
    start = _StartServer(_proc("ggml_backend_rpc_start_server"))
    arr = (ctypes.c_void_p * len(devices))(*devices)
    start(
        parse_endpoint(endpoint).encode(),
        cache_dir.encode() if cache_dir else None,
        n_threads,
        len(devices),
        arr,
    )
