"""A llama.cpp RPC server: lend this machine's devices to a model loaded elsewhere.

Run it on each machine that should hold part of a model::

    python -m langchain_llamacpp_local.rpc_server --host 127.0.0.1 --port 50052

and pass ``rpc_servers=["thathost:50052"]`` to ``ChatLlamaCpp`` on the machine
that runs the chat. The wheel of llama-cpp-python ships no ``rpc-server`` binary,
so this module starts ggml's server in-process (``ggml_backend_rpc_start_server``);
it needs llama-cpp-python built with ``-DGGML_RPC=ON``.

The protocol has no authentication or encryption and trusts its client with the
server's memory: it binds to loopback unless told otherwise, and warns when it is not.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from pathlib import Path

from langchain_llamacpp_local.llama import rpc

logger = logging.getLogger("langchain_llamacpp_local.rpc_server")

EXPOSURE_WARNING = (
    "WARNING: the RPC server on {host} is reachable from other machines. llama.cpp's RPC "
    "protocol has no authentication or encryption: any client that connects can allocate, "
    "write and read memory and run computations on the exposed devices, and llama.cpp "
    "calls the server experimental and not secure. Never expose it to an open network: run it "
    "only on a trusted private network, behind a firewall that admits only the machine "
    "running the model (or tunnel it, e.g. over SSH or WireGuard)."
)


def exposure_warning(host: str) -> str | None:
    """The warning to print before binding ``host`` (None for loopback addresses)."""
    return None if rpc.is_loopback(host) else EXPOSURE_WARNING.format(host=host)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m langchain_llamacpp_local.rpc_server",
        description="Expose this machine's ggml devices to ChatLlamaCpp(rpc_servers=...).",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1: this machine only; see the warning "
        "printed for any other address)",
    )
    p.add_argument("--port", type=int, default=50052, help="TCP port (default 50052)")
    p.add_argument(
        "--device",
        action="append",
        default=[],
        metavar="NAME[,NAME...]",
        help="device(s) to expose, e.g. CUDA0 (repeatable; default: every GPU, else the CPU); "
        "see --list-devices",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 2),
        help="threads for the CPU device (default: half the cores)",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="keep large tensors the client sent in this directory, so that reloading the "
        "same model skips sending them again (default: no cache)",
    )
    p.add_argument("--list-devices", action="store_true", help="print the devices and exit")
    return p


def _device_names(values: list[str]) -> list[str]:
    names = [n.strip() for v in values for n in v.replace("/", ",").split(",")]
    return [n for n in names if n]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    reason = rpc.rpc_unavailable_reason()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    if args.list_devices:
        for d in rpc.local_devices():
            print(
                f"{d.name}: {d.description} ({d.type}, {d.memory_total >> 20} MiB, "
                f"{d.memory_free >> 20} MiB free)"
            )
        return 0
    try:
        endpoint = rpc.parse_endpoint(f"{args.host}:{args.port}")
        if args.threads <= 0:
            raise ValueError("--threads must be positive")
        devices = rpc.pick_server_devices(_device_names(args.device))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cache_dir = None
    if args.cache_dir:
        path = Path(args.cache_dir).expanduser()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            print(f"error: cannot create --cache-dir {path}: {e}", file=sys.stderr)
            return 2
        cache_dir = str(path.resolve())
    warning = exposure_warning(args.host)
    if warning:
        print(warning, file=sys.stderr, flush=True)

    # ggml's server loop never returns while it serves; run it on a daemon thread so
    # that Ctrl-C / SIGTERM end the process normally.
    failed = threading.Event()

    def serve() -> None:
        rpc.start_server(endpoint, devices, cache_dir=cache_dir, n_threads=args.threads)
        failed.set()

    thread = threading.Thread(target=serve, name="ggml-rpc-server", daemon=True)
    thread.start()
    try:
        while not failed.wait(0.5):
            pass
    except KeyboardInterrupt:
        return 0
    print(
        f"error: the RPC server could not start on {endpoint} (address in use or not "
        "available on this machine?)",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
