"""Credentials out of what deepepochs prints: a tracking URI may carry a user name and a password
(`http://user:password@host`, as MLflow and requests take them), which must never reach the console, a
`repr`, a warning or a log file.

- `redacted_uri(uri)`: the URI with its `user:password@` part written `***@`.
- `redact(text, uri)`: `text` with every `//user:password@` written `//***@`, and the URI's own user
  information (also URL-decoded) removed wherever it appears, as an exception's text may quote it.
"""

from __future__ import annotations

import re
import urllib.parse

__all__ = ["redact", "redacted_uri"]

#: The user information of any URL in a text: `scheme://<userinfo>@`.
_USERINFO = re.compile(r"(?<=//)[^/?#@\s'\"]+@")


def _userinfo(uri) -> list[str]:
    """The `user:password` part of `uri` as written and URL-decoded (none when it has none)."""
    if not isinstance(uri, str) or "@" not in uri:
        return []
    match = re.match(r"[A-Za-z][A-Za-z0-9+.-]*://([^/?#]*)@", uri)
    if match is None:
        return []
    raw = match.group(1)
    parts = {raw, urllib.parse.unquote(raw)}
    for piece in raw.split(":", 1)[1:]:  # the password alone, which an HTTP library may print
        if len(piece) >= 3:
            parts |= {piece, urllib.parse.unquote(piece)}
    return sorted(parts, key=len, reverse=True)


def redacted_uri(uri):
    """`uri` with its `user:password@` written `***@` (other values as they are)."""
    return _USERINFO.sub("***@", uri, count=1) if isinstance(uri, str) else uri


def redact(text: str, uri=None) -> str:
    """`text` without credentials: every URL's user information, and `uri`'s, replaced by `***`."""
    text = _USERINFO.sub("***@", text)
    for secret in _userinfo(uri):
        text = text.replace(secret, "***")
    return text
