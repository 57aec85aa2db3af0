"""Who may talk to the server: the Host a request names and the web page (Origin) it comes from.

A server on 127.0.0.1 is reachable from every web page its user opens. A page can post to it
without a CORS preflight (a text/plain form post), and with DNS rebinding (a name of the
attacker's that resolves to 127.0.0.1) it can even read the replies. Browsers always send the
name they connect to as Host, and the page's origin as Origin on such requests, so the server
refuses Host values other than its own names and Origins other than the allowed ones.

Both lists take the keyword "localhost" for every loopback name and address (localhost,
*.localhost, 127.0.0.0/8, ::1), on any port, and "*" for anything.
"""
from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

LOOPBACK = "localhost"
ANY = "*"


def is_loopback(name: str) -> bool:
    """A loopback host name or address (no port, no brackets)."""
    name = name.lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def host_name(host: str) -> str:
    """The name of a Host header value: "[::1]:8080" -> "::1", "Example.com:80" -> "example.com"."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    name, _, port = host.rpartition(":")
    return name if name and port.isdigit() else host


def host_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    name = host_name(host).rstrip(".")
    return ANY in allowed or name in allowed or (LOOPBACK in allowed and is_loopback(name))


def origin_allowed(origin: str, allowed: tuple[str, ...]) -> bool:
    """An Origin header value ("https://app.example:8443", or "null" for opaque origins)."""
    if ANY in allowed:
        return True
    origin = origin.strip().lower().rstrip("/")
    if origin in allowed:
        return True
    try:
        parts = urlsplit(origin)
        name = parts.hostname
    except ValueError:
        return False
    return LOOPBACK in allowed and parts.scheme in ("http", "https") and bool(name) and is_loopback(name)


def is_loopback_bind(host: str) -> bool:
    """Whether a listening address only takes loopback connections."""
    return is_loopback(host.strip("[]"))
