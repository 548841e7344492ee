"""What the explorer's server refuses and what every response carries.

The explorer reads the user's folders and runs their models, so a request it answers must come
from the user's own browser tab, never from another site the browser has open: its Host must
be one this server answers to (a DNS-rebound name is refused); bound beyond loopback, every
request carries the per-start token (as Jupyter's server requires); a POST (what runs a model)
carries the token in its form and, where the browser sends them, an Origin and Sec-Fetch-Site
of this server's own pages (no cross-site request forgery). Bodies, fields, lines and classes
are capped; errors echo a short prefix only; responses forbid framing, sniffing and referrers.
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import re
import secrets
import socket
from typing import Iterable, Optional, Sequence

LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
WILDCARD_ADDRESSES = frozenset({"0.0.0.0", "::", ""})
TOKEN_FIELD = "token"
MAX_BODY_BYTES = 1 << 20  # A typed response or a list of candidates is a few kB.
MAX_FIELDS = 32  # The largest live form has 8 fields.
MAX_LINES = 64  # Arguments, context utterances or responses a live box takes.
MAX_CLASSES = 16  # Judge classes.
MAX_ECHO = 200  # Characters of a user's input an error message repeats.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; frame-src 'self'; form-action 'self'; base-uri 'none'; "
    "frame-ancestors 'none'")
# A served file (a picture, a library heatmap page): no script, framed by the explorer only.
FILE_SECURITY_POLICY = ("sandbox; default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; "
                        "frame-ancestors 'self'")
_SAME_SITE_FETCHES = frozenset({"same-origin", "none"})


def is_loopback(host: str) -> bool:
  """Whether `host` (an address or "localhost") reaches this machine only."""
  if host.lower() == "localhost":
    return True
  try:
    return ipaddress.ip_address(host.strip("[]")).is_loopback
  except ValueError:
    return False


def allowed_hosts(host: str, extra: Iterable[str] = ()) -> frozenset[str]:
  """The Host names a server bound to `host` answers to: the loopback names, the bound
  address (the machine's names for a wildcard), and `extra`."""
  names = set(LOOPBACK_NAMES) | {h.lower() for h in extra if h}
  bound = host.lower()
  if bound in WILDCARD_ADDRESSES:
    names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
  elif bound:
    names.add(f"[{bound}]" if ":" in bound and not bound.startswith("[") else bound)
  return frozenset(names)


def host_name(host_header: str) -> str:
  """The name of a Host header, without its port ("[::1]:8765" -> "[::1]")."""
  host = host_header.strip().lower()
  if host.startswith("["):
    return host.partition("]")[0] + "]"
  return host.rpartition(":")[0] if host.count(":") == 1 else host


@dataclasses.dataclass(frozen=True)
class Guard:
  """What one server accepts.

  Attributes:
    allowed_hosts: Host names a request may address.
    token: The per-start secret every form carries (and every request, where required).
    token_required: Every request must carry the token (the server is not loopback-only).
  """
  allowed_hosts: frozenset[str]
  token: str
  token_required: bool

  @classmethod
  def for_bind(cls, host: str, extra_hosts: Sequence[str] = ()) -> Guard:
    return cls(allowed_hosts=allowed_hosts(host, extra_hosts),
               token=secrets.token_urlsafe(24), token_required=not is_loopback(host))

  def matches(self, given: Optional[str]) -> bool:
    return bool(given) and hmac.compare_digest(str(given).encode(), self.token.encode())

  def refusal(self, *, method: str, host: str, url_root: str, origin: Optional[str],
              fetch_site: Optional[str], query_token: Optional[str],
              cookie_token: Optional[str], form_token: Optional[str]) -> Optional[str]:
    """Why a request is refused (one line for the page), or None to answer it."""
    if host_name(host) not in self.allowed_hosts:
      return (f"host {short(host)!r} is not an address this explorer answers to "
              "(start it with --allowed_host=NAME to add one)")
    if self.token_required and not (self.matches(query_token) or self.matches(cookie_token)):
      return ("this explorer is served beyond this machine and needs its token: open the "
              "URL it printed when it started (…/?token=…)")
    if method not in ("GET", "HEAD", "OPTIONS"):
      # Under `Referrer-Policy: no-referrer` a browser posts this server's own forms with
      # `Origin: null`; Sec-Fetch-Site then says whose page it was.
      own_page = origin == "null" and fetch_site == "same-origin"
      if origin is not None and not own_page and origin.rstrip("/") != url_root.rstrip("/"):
        return f"a request from another site ({short(origin)}) is refused"
      if fetch_site is not None and fetch_site not in _SAME_SITE_FETCHES:
        return f"a {short(fetch_site)} request is refused: use this explorer's own pages"
      if not self.matches(form_token):
        return ("the form is not one of this explorer's pages (or the explorer restarted "
                "since the page was opened): reload the page and submit again")
    return None


def cookie_name(host: str) -> str:
  """The token's cookie, one per port (cookies ignore ports: two explorers on one machine
  must not overwrite each other's)."""
  port = host.rpartition(":")[2] if host.rpartition(":")[2].isdigit() else "80"
  return f"jaxmoral_explore_{port}"


def short(text: str, limit: int = MAX_ECHO) -> str:
  """At most `limit` characters of `text` (with the count of those left out)."""
  text = str(text)
  return text if len(text) <= limit else f"{text[:limit]}… ({len(text) - limit} more characters)"


# Characters a page shows by name: C0 controls (but tab and newlines), DEL, C1 controls,
# and the invisible marks and overrides that reorder or hide text (bidi, zero width, BOM).
_INVISIBLE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u061c\u200b-\u200f"
                        "\u202a-\u202e\u2060-\u2069\ufeff]")


def visible(text: str) -> str:
  """`text` with each control or bidi character shown as ⟨U+XXXX⟩."""
  return _INVISIBLE.sub(lambda m: f"⟨U+{ord(m.group()):04X}⟩", text)


_ABSOLUTE_PATH = re.compile(r"(?<![\w.~/-])/(?:[^\s'\"/:,;()]+/)+([^\s'\"/:,;()]+)")


def redact(text: str, folders: Sequence[tuple[str, str]]) -> str:
  """`text` with each shown folder's (absolute path, label) path as its label, and any other
  absolute path as its last component: a page never shows where the folders are on disk."""
  for path, label in sorted(folders, key=lambda f: -len(f[0])):
    text = text.replace(path, label)
  return _ABSOLUTE_PATH.sub(lambda m: "…/" + m.group(1), text)
