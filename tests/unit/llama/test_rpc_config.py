"""RPC settings that fail before any server is used: endpoints, splits, probes, builds."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from langchain_llamacpp_local import ChatLlamaCpp, ModelLoadError
from langchain_llamacpp_local.llama import rpc
from langchain_llamacpp_local.rpc_server import exposure_warning
from langchain_llamacpp_local.rpc_server import main as rpc_server_main


@pytest.mark.parametrize(
    ("given", "normalised"),
    [("127.0.0.1:50052", "127.0.0.1:50052"), (" gpu-box:0080 ", "gpu-box:80")],
)
def test_parse_endpoint_accepts_host_port(given: str, normalised: str) -> None:
    assert rpc.parse_endpoint(given) == normalised


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ("127.0.0.1", "not 'host:port'"),
        (":50052", "not 'host:port'"),
        ("host:0", "port must be"),
        ("host:70000", "port must be"),
        ("host:http", "port must be"),
        ("[::1]:50052", "IPv6"),
        ("::1:50052", "IPv6"),
    ],
)
def test_parse_endpoint_rejects_with_reason(bad: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        rpc.parse_endpoint(bad)


def test_loopback_detection() -> None:
    assert rpc.is_loopback("127.0.0.1") and rpc.is_loopback("127.3.0.1")
    assert rpc.is_loopback("localhost") and rpc.is_loopback("::1")
    assert not rpc.is_loopback("0.0.0.0") and not rpc.is_loopback("192.168.1.10")
    assert not rpc.is_loopback("gpu-box")


def test_server_warns_before_binding_a_non_loopback_address() -> None:
    assert exposure_warning("127.0.0.1") is None and exposure_warning("localhost") is None
    warning = exposure_warning("0.0.0.0")
    assert warning and "0.0.0.0" in warning and "Never expose it to an open network" in warning


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_probe_reports_a_closed_port() -> None:
    with pytest.raises(rpc.RpcError, match="cannot reach RPC server 127.0.0.1:"):
        rpc.probe_server(f"127.0.0.1:{_free_port()}", timeout=2)


@pytest.fixture()
def not_rpc_server() -> Iterator[str]:
    """A TCP server that answers like a web server, not like ggml's RPC server."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.recv(64)
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield f"127.0.0.1:{srv.getsockname()[1]}"
    srv.close()
    t.join(5)


def test_probe_rejects_a_server_that_is_not_rpc(not_rpc_server: str) -> None:
    with pytest.raises(
        rpc.RpcError, match="is not a compatible llama.cpp RPC server .*-byte reply"
    ):
        rpc.probe_server(not_rpc_server, timeout=5)


def test_probe_times_out_on_a_silent_server() -> None:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()  # accepts into the backlog, never answers: like a busy RPC server
        with pytest.raises(rpc.RpcError, match="did not answer within 0.5 s"):
            rpc.probe_server(f"127.0.0.1:{srv.getsockname()[1]}", timeout=0.5)


def test_settings_errors_name_the_problem(tiny_llama: str) -> None:
    with pytest.raises(ValueError, match="rpc_servers is empty"):
        ChatLlamaCpp(model_path=tiny_llama, rpc_servers=[])
    with pytest.raises(ValueError, match="not 'host:port'"):
        ChatLlamaCpp(model_path=tiny_llama, rpc_servers=["gpu-box"])
    with pytest.raises(ValueError, match="twice"):
        ChatLlamaCpp(model_path=tiny_llama, rpc_servers=["a:1", "a:01"])
    with pytest.raises(ValueError, match="non-negative"):
        ChatLlamaCpp(model_path=tiny_llama, tensor_split=[1.0, -1.0])
    with pytest.raises(ValueError, match="all be zero"):
        ChatLlamaCpp(model_path=tiny_llama, tensor_split=[0.0, 0.0])


def test_without_rpc_build_the_error_gives_the_reinstall_command(tiny_llama: str) -> None:
    reason = rpc.rpc_unavailable_reason()
    if reason is None:
        pytest.skip(
            "this llama-cpp-python has RPC compiled in (tests/integration/llama/test_rpc.py)"
        )
    cmd = rpc.install_command()
    assert cmd.startswith('CMAKE_ARGS="-DGGML_RPC=ON" pip install ')
    assert "llama-cpp-python==" in cmd and cmd in reason
    with pytest.raises(ValueError, match="RPC backend") as info:
        ChatLlamaCpp(model_path=tiny_llama, rpc_servers=["127.0.0.1:50052"])
    assert cmd in str(info.value)
    assert rpc_server_main(["--port", "50052"]) == 2  # the server says so too, and exits


def test_tensor_split_must_match_the_devices(tiny_llama: str) -> None:
    n = len(rpc._default_local_devices()) if rpc.rpc_available() else 0
    llm = ChatLlamaCpp(model_path=tiny_llama, tensor_split=[1.0] * (n + 1), max_tokens=2)
    with pytest.raises(
        ModelLoadError, match=f"tensor_split has {n + 1} entries but this model has {n}"
    ):
        llm.load()


def test_explicit_zero_gpu_layers_with_rpc_is_refused(tiny_llama: str) -> None:
    if not rpc.rpc_available():
        pytest.skip(rpc.rpc_unavailable_reason() or "")
    with pytest.raises(ValueError, match="n_gpu_layers=0 keeps every layer"):
        ChatLlamaCpp(model_path=tiny_llama, rpc_servers=["127.0.0.1:50052"], n_gpu_layers=0)
