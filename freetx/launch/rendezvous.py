"""Before a node of a multi-node run starts its processes: is the rendezvous reachable?

torchrun's own wait for an unreachable rendezvous host is 600 s of repeated c10d
warnings and no message. `freetx run` checks first: the host must resolve (every
node), and a node that does not host the rendezvous store waits up to
`--rendezvous-timeout` seconds for the store's port to accept a TCP connection,
then stops with one paragraph naming the host and port.
"""

from __future__ import annotations

import socket
import time

from freetx.errors import FreetxError

DEFAULT_TIMEOUT_S = 300.0
RETRY_S = 0.5

CHECK = (
    "Check that every node was given the same address (node 0's host name or IP, as "
    "`freetx launch torchrun` prints it), that node 0 was started, and that no firewall "
    "blocks the port between the nodes."
)


def split_endpoint(endpoint: str, default_port: int) -> tuple[str, int]:
    """`host:port`, `host` or `[v6]:port` as (host, port)."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or "]" in port or (host.count(":") and not host.endswith("]")):
        host, port = endpoint, ""  # no port, or a bare IPv6 address
    host = host.strip("[]")
    if not port:
        return host, default_port
    if not port.isdigit():
        raise FreetxError(
            f"the rendezvous endpoint {endpoint!r} has no valid port; write it as HOST:PORT "
            "(e.g. node001:29500)."
        )
    return host, int(port)


def resolve(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to, or one paragraph saying it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise FreetxError(
            f"the rendezvous host {host} (port {port}) does not resolve on this node "
            f"({e.args[-1] if e.args else e}); nothing was started. {CHECK}"
        ) from None
    return sorted({info[4][0] for info in infos})


def wait_for_rendezvous(host: str, port: int, timeout_s: float) -> None:
    """Wait until `host:port` (a resolved host) accepts a TCP connection, at most
    `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(5.0, left))):
                return
        except OSError as e:
            last = e.strerror or type(e).__name__
        if time.monotonic() + RETRY_S >= deadline:
            break
        time.sleep(RETRY_S)
    raise FreetxError(
        f"the rendezvous at {host}:{port} did not answer within {timeout_s:g} s ({last}); "
        f"this node started no processes. {CHECK} Node 0 may start later: raise "
        "--rendezvous-timeout SECONDS to wait longer."
    )
