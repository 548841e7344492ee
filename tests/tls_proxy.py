"""An HTTPS proxy that points TensorFlow's GCS client at a local GCS-API server, for tests.

TensorFlow's client always calls https://www.googleapis.com and https://storage.googleapis.com
(it has no endpoint setting), through libcurl, which honours `https_proxy` and TensorFlow's
`CURL_CA_BUNDLE`. This proxy answers CONNECT to those hosts, ends the TLS with a certificate
that a CA made here signed (`make_certificates`; the caller trusts it through CURL_CA_BUNDLE),
and forwards each request to the server: JSON API paths as they are, and
storage.googleapis.com/BUCKET/OBJECT as a media download, whose Range it answers itself.
`GOOGLE_AUTH_TOKEN_FOR_TESTING` gives TensorFlow a token without any credentials.
"""
import datetime
import http.client
import http.server
import os
import re
import socketserver
import ssl
import threading
import urllib.parse

HOSTS = ("www.googleapis.com", "storage.googleapis.com", "oauth2.googleapis.com")
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection"}


def make_certificates(folder):
  """A CA and a certificate for HOSTS signed by it, as PEM files in `folder`: their paths."""
  from cryptography import x509
  from cryptography.hazmat.primitives import hashes, serialization
  from cryptography.hazmat.primitives.asymmetric import ec
  from cryptography.x509.oid import NameOID
  now = datetime.datetime.now(datetime.timezone.utc)
  ca_key = ec.generate_private_key(ec.SECP256R1())
  ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test CA")])
  ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256()))
  key = ec.generate_private_key(ec.SECP256R1())
  cert = (x509.CertificateBuilder()
          .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, HOSTS[0])]))
          .issuer_name(ca_name).public_key(key.public_key())
          .serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(days=1))
          .not_valid_after(now + datetime.timedelta(days=2))
          .add_extension(x509.SubjectAlternativeName([x509.DNSName(h) for h in HOSTS]),
                         critical=False)
          .sign(ca_key, hashes.SHA256()))
  pem = serialization.Encoding.PEM
  paths = {n: os.path.join(folder, n) for n in ("ca.pem", "server.pem", "server.key")}
  with open(paths["ca.pem"], "wb") as f:
    f.write(ca.public_bytes(pem))
  with open(paths["server.pem"], "wb") as f:
    f.write(cert.public_bytes(pem))
  with open(paths["server.key"], "wb") as f:
    f.write(key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))
  return paths


def _forwarder(upstream, seen):
  """The handler class of the requests inside one tunnel, forwarding them to `upstream` (and
  appending "HOST PATH" of each to `seen`)."""
  host, port = urllib.parse.urlsplit(upstream).netloc.split(":")

  class Forward(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
      if os.environ.get("TLS_PROXY_LOG"):
        super().log_message(*args)

    def _forward(self):
      seen.append(f"{self.headers.get('Host', '')} {self.path}")
      body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
      path, wanted = self.path, None
      if self.headers.get("Host", "").startswith("storage.googleapis.com"):
        bucket, _, name = urllib.parse.urlsplit(path).path.lstrip("/").partition("/")
        path = (f"/download/storage/v1/b/{bucket}/o/"
                f"{urllib.parse.quote(urllib.parse.unquote(name), safe='')}?alt=media")
        wanted = self.headers.get("Range")
      headers = {k: v for k, v in self.headers.items()
                 if k.lower() not in _HOP and k.lower() not in ("host", "range")}
      connection = http.client.HTTPConnection(host, int(port), timeout=60)
      connection.request(self.command, path, body=body or None, headers=headers)
      response = connection.getresponse()
      data = response.read()
      status = response.status
      out = [(k, v) for k, v in response.getheaders() if k.lower() not in _HOP]
      if wanted and status == 200:
        match = re.match(r"bytes=(\d+)-(\d*)", wanted)
        start = int(match.group(1))
        end = min(int(match.group(2)) if match.group(2) else len(data) - 1, len(data) - 1)
        if start >= len(data):
          status, data = 416, b""
          out.append(("Content-Range", f"bytes */{len(data)}"))
        else:
          out.append(("Content-Range", f"bytes {start}-{end}/{len(data)}"))
          status, data = 206, data[start:end + 1]
      self.send_response(status)
      for k, v in out:
        self.send_header(k, v)
      self.send_header("Content-Length", str(len(data)))
      self.end_headers()
      if self.command != "HEAD":
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _forward

  return Forward


def start(upstream, folder):
  """Starts the proxy; returns (proxy URL, CA bundle path, stop(), the requests it forwarded
  as "HOST PATH")."""
  paths = make_certificates(folder)
  context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
  context.load_cert_chain(paths["server.pem"], paths["server.key"])
  seen = []
  forward = _forwarder(upstream, seen)

  class Tunnel(socketserver.StreamRequestHandler):
    def handle(self):
      line = self.rfile.readline().decode("latin-1")
      while self.rfile.readline() not in (b"\r\n", b"\n", b""):
        pass
      if not line.startswith("CONNECT "):
        self.wfile.write(b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\n\r\n")
        return
      self.wfile.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
      self.wfile.flush()
      tls = context.wrap_socket(self.connection, server_side=True)
      forward(tls, self.client_address, self.server)

  class Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

  server = Server(("127.0.0.1", 0), Tunnel)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  return (f"http://127.0.0.1:{server.server_address[1]}", paths["ca.pem"], server.shutdown,
          seen)
