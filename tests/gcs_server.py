"""A local GCS-API server for the object-storage tests: `python tests/gcs_server.py PORT`.

It is `gcp-storage-emulator` (from the package index) with the behaviours of the real service
it leaves out or gets wrong, which the clients under test rely on:
- downloads carry `x-goog-generation` (TensorStore's gcs driver, hence Orbax's OCDBT
  checkpoints, reads an object's generation from it to make its conditional writes);
- the preconditions `ifGenerationMatch` on uploads and deletes are enforced (HTTP 412 when
  the object's generation differs; 0: the object must not exist), which the run lock's
  conditional create and stale-lock takeover use;
- refusals: uploads to bucket `needs-credentials` get the service's 401 for an anonymous
  caller, and to bucket `read-only` its 403 for credentials without the permission;
- a multipart upload (gcsfs's for small objects) is stored byte for byte: the emulator reads
  it with Python's email parser, which takes a final carriage return of the content for part
  of the line break before the closing boundary (gcsfs breaks lines with "\n" alone) and
  drops it.
"""

import http
import json
import sys

from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects


def _generation(storage, bucket: str, name: str) -> str:
  try:
    return str(storage.get_file_obj(bucket, name).get("generation") or "0")
  except NotFound:
    return "0"


def _precondition_failed(request, response, storage, name) -> bool:
  wanted = request.query.get("ifGenerationMatch")
  if not wanted or name is None:
    return False
  if _generation(storage, request.params["bucket_name"], name) == wanted[0]:
    return False
  response.status = http.HTTPStatus.PRECONDITION_FAILED
  response.json({"error": {"code": 412, "message": "Precondition Failed"}})
  return True


def _upload_name(request):
  if "name" in request.query:
    return request.query["name"][0]
  data = request.data
  if isinstance(data, dict):
    return (data.get("meta") or {}).get("name") or data.get("name")
  return None


_insert, _delete, _download = objects.insert, objects.delete, objects.download


# Buckets whose uploads are refused as the real service refuses them: to a caller without
# credentials (401) and to one whose credentials lack the permission (403).
_REFUSED = {
    "needs-credentials": (401, "Anonymous caller does not have storage.objects.create access "
                               "to the Google Cloud Storage object."),
    "read-only": (403, "caller@example.iam.gserviceaccount.com does not have "
                       "storage.objects.create access to the Google Cloud Storage object. "
                       "Permission 'storage.objects.create' denied on resource."),
}


def _refused(request, response) -> bool:
  refusal = _REFUSED.get(request.params.get("bucket_name"))
  if refusal is None:
    return False
  code, message = refusal
  response.status = http.HTTPStatus(code)
  response.json({"error": {"code": code, "message": message,
                           "errors": [{"message": message, "reason": "forbidden"}]}})
  return True


def insert(request, response, storage, *args, **kwargs):
  if _refused(request, response):
    return None
  if _precondition_failed(request, response, storage, _upload_name(request)):
    return None
  return _insert(request, response, storage, *args, **kwargs)


def delete(request, response, storage, *args, **kwargs):
  if _precondition_failed(request, response, storage, request.params.get("object_id")):
    return None
  return _delete(request, response, storage, *args, **kwargs)


def download(request, response, storage, *args, **kwargs):
  response["x-goog-generation"] = _generation(storage, request.params["bucket_name"],
                                              request.params["object_id"])
  response["x-goog-metageneration"] = "1"
  return _download(request, response, storage, *args, **kwargs)


objects.insert, objects.delete, objects.download = insert, delete, download

# The server's routes take the handlers when it is imported: only now, after they are replaced.
from gcp_storage_emulator import server  # noqa: E402  pylint: disable=wrong-import-position

_read_data = server._read_data  # pylint: disable=protected-access


def read_data(request_handler, query):
  """The request's data, as the emulator gives it to its handlers; a multipart upload's parts
  split at its own line break (that of its first boundary line), so no content byte is lost."""
  content_type = request_handler.headers.get("Content-Type") or ""
  if not content_type.startswith("multipart/related"):
    return _read_data(request_handler, query)
  raw = server._decode_raw_data(  # pylint: disable=protected-access
      server._read_raw_data(request_handler), request_handler)  # pylint: disable=protected-access
  delimiter = b"--" + content_type.split("boundary=", 1)[1].strip('"').encode()
  eol = b"\r\n" if raw[len(delimiter):len(delimiter) + 2] == b"\r\n" else b"\n"
  # delimiter EOL meta-part EOL delimiter EOL content-part EOL delimiter "--"
  meta, content = (part.split(eol, 1)[1] for part in raw.split(eol + delimiter)[:2])
  meta_body = meta.split(eol + eol, 1)[1]
  headers, body = content.split(eol + eol, 1)
  content_types = [line.split(b":", 1)[1] for line in headers.split(eol)
                   if line.lower().startswith(b"content-type:")]
  return {"meta": json.loads(meta_body),
          "content": body,
          "content-type": (content_types[0].split(b";")[0].strip().decode().lower()
                           if content_types else "application/octet-stream")}


server._read_data = read_data  # pylint: disable=protected-access

if __name__ == "__main__":
  from gcp_storage_emulator.__main__ import main  # Imported after the handlers are replaced.
  main(["start", "--host", "127.0.0.1", "--port", sys.argv[1], "--default-bucket", "bucket",
        "--in-memory", "-q"])
