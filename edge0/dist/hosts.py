"""`edge0 launch --hostfile`: mlx.launch's host file read and checked before any rank starts, so that a damaged one
is one line naming the file and what is wrong (mlx.launch's own parser answers with its traceback or usage).

    [{"ssh": "mac1", "ips": ["192.168.1.10"]}, {"ssh": "mac2", "ips": ["192.168.1.11"]}]
    {"backend": "jaccl", "envs": ["K=V"], "hosts": [{"ssh": ..., "ips": [...], "rdma": [null, "rdma_en2"]}, ...]}
"""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path

from ..errors import Edge0Error

BACKENDS = ("ring", "jaccl", "jaccl-ring")


def read_hostfile(path: str, backend: str | None = None) -> int:
    """The number of ranks (hosts) `path` names, after checking it is a host file mlx.launch can use with
    `backend` (None: the file's, else ring)."""
    what = f"--hostfile {path}"
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise Edge0Error(f"{what}: cannot be read ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise Edge0Error(f"{what}: not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise Edge0Error(f"{what}: not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    hosts = data.get("hosts") if isinstance(data, dict) else data
    if not isinstance(hosts, list):
        raise Edge0Error(f"{what}: expected a list of hosts, or an object whose \"hosts\" is one")
    if isinstance(data, dict):
        if data.get("backend", "") not in ("", *BACKENDS):
            raise Edge0Error(f"{what}: \"backend\" {data['backend']!r}: choose {', '.join(BACKENDS)}")
        envs = data.get("envs", [])
        if not isinstance(envs, list) or not all(isinstance(v, str) and "=" in v for v in envs):
            raise Edge0Error(f"{what}: \"envs\" must be a list of \"NAME=VALUE\" strings")
        backend = backend or data.get("backend") or None
    if len(hosts) < 2:
        raise Edge0Error(f"{what}: {len(hosts)} host(s); name at least 2 (one rank each)")
    for i, host in enumerate(hosts):
        _check_host(what, i, host, (backend or "ring") == "ring")
    return len(hosts)


def _check_host(what: str, i: int, host, ring: bool) -> None:
    where = f"{what}: host {i}"
    if not isinstance(host, dict):
        raise Edge0Error(f"{where}: expected an object such as {{\"ssh\": \"mac1\", \"ips\": [\"192.168.1.10\"]}}")
    if not isinstance(host.get("ssh"), str) or not host["ssh"]:
        raise Edge0Error(f"{where}: \"ssh\" must name the host to ssh into (a non-empty string)")
    ips = host.get("ips", [])
    if not isinstance(ips, list) or not all(isinstance(ip, str) for ip in ips):
        raise Edge0Error(f"{where}: \"ips\" must be a list of IP addresses (strings)")
    for ip in ips:
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            raise Edge0Error(f"{where}: \"ips\": {ip!r} is not an IP address") from None
    if ring and not ips:
        raise Edge0Error(f"{where}: the ring backend needs its \"ips\" (the address the other hosts reach it at)")
    if not isinstance(host.get("rdma", []), list):
        raise Edge0Error(f"{where}: \"rdma\" must be a list (one RDMA device or null per host)")
