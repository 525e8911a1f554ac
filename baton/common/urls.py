"""URL helpers shared by the gateway and `baton serve` (no dependencies: both import it)."""

from __future__ import annotations

from urllib.parse import urlsplit


def redact_url(url: str) -> str:
    """The URL with its password replaced by ***, for logs and error messages. Works on the
    several-host URLs of a Redis Cluster or Sentinel (`redis+sentinel://:pw@h1:1,h2:2/name`) too,
    whose port urllib cannot parse; `sentinel_password=` in the query is redacted as well."""
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    netloc = parts.netloc
    if at and ":" in userinfo:
        netloc = f"{userinfo.split(':', 1)[0]}:***@{hosts}"
    query = "&".join(_redact_param(item) for item in parts.query.split("&") if item)
    if (netloc, query) == (parts.netloc, parts.query):
        return url
    # urlunsplit would drop the empty authority of unix:///path
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "") + (
        f"#{parts.fragment}" if parts.fragment else "")


def _redact_param(item: str) -> str:
    name = item.partition("=")[0]
    return f"{name}=***" if name.endswith("password") else item
