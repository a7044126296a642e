"""A small S3 client on the standard library (SigV4, path-style), enough for the bench runner:
create a bucket, put objects (single PUT or multipart), list, head, get (streamed), delete.

The runner uses it only around measurements (populating read-only data sets, verifying what a
file system wrote, cleaning up), never inside a timed phase, so its speed does not matter much.
Every request carries the User-Agent `bucketfs-bench` so the store-side request count can leave
it out.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import hmac
import http.client
import threading
import urllib.parse
import xml.etree.ElementTree as ET
from base64 import b64encode
from dataclasses import dataclass
from typing import Iterable, Iterator

USER_AGENT = "bucketfs-bench/1"
_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"


class S3Error(Exception):
    def __init__(self, status: int, body: bytes, what: str):
        self.status = status
        self.body = body
        super().__init__(f"{what}: HTTP {status}: {body[:300].decode('utf-8', 'replace')}")


@dataclass
class ObjectInfo:
    key: str
    size: int
    etag: str


def _q(s: str, safe: str = "/~") -> str:
    return urllib.parse.quote(s, safe=safe)


class S3:
    """Path-style S3 client for one endpoint. Thread-safe: one connection per thread."""

    def __init__(self, endpoint: str, access_key: str, secret_key: str, region: str = "us-east-1"):
        u = urllib.parse.urlsplit(endpoint)
        if u.scheme not in ("http", "https"):
            raise ValueError(f"endpoint must be http:// or https://, got {endpoint!r}")
        self.endpoint = endpoint.rstrip("/")
        self.scheme = u.scheme
        self.host = u.netloc
        self.access_key = access_key
        self.secret_key = secret_key
        self.region = region
        self._local = threading.local()
        self.requests = 0  # how many requests this client sent (all threads)
        self._lock = threading.Lock()

    # -- plumbing -------------------------------------------------------------------------------

    def _conn(self) -> http.client.HTTPConnection:
        c = getattr(self._local, "conn", None)
        if c is None:
            cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
            c = cls(self.host, timeout=300)
            self._local.conn = c
        return c

    def _drop_conn(self) -> None:
        c = getattr(self._local, "conn", None)
        if c is not None:
            c.close()
        self._local.conn = None

    def _sign(self, method: str, path: str, query: dict[str, str], headers: dict[str, str]) -> dict[str, str]:
        now = _dt.datetime.now(_dt.timezone.utc)
        amz_date = now.strftime("%Y%m%dT%H%M%SZ")
        datestamp = now.strftime("%Y%m%d")
        h = {k.lower(): str(v).strip() for k, v in headers.items()}
        h["host"] = self.host
        h["x-amz-date"] = amz_date
        h.setdefault("x-amz-content-sha256", "UNSIGNED-PAYLOAD")
        signed = sorted(h)
        canonical_query = "&".join(
            f"{_q(k, '~')}={_q(v, '~')}" for k, v in sorted(query.items())
        )
        canonical = "\n".join(
            [
                method,
                _q(path),
                canonical_query,
                "".join(f"{k}:{h[k]}\n" for k in signed),
                ";".join(signed),
                h["x-amz-content-sha256"],
            ]
        )
        scope = f"{datestamp}/{self.region}/s3/aws4_request"
        to_sign = "\n".join(
            ["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()]
        )
        k = ("AWS4" + self.secret_key).encode()
        for part in (datestamp, self.region, "s3", "aws4_request"):
            k = hmac.new(k, part.encode(), hashlib.sha256).digest()
        sig = hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest()
        h["authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={self.access_key}/{scope}, "
            f"SignedHeaders={';'.join(signed)}, Signature={sig}"
        )
        h["user-agent"] = USER_AGENT
        del h["host"]
        return h

    def request(
        self,
        method: str,
        bucket: str,
        key: str = "",
        query: dict[str, str] | None = None,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        stream: bool = False,
        ok: Iterable[int] = (200, 204),
    ):
        """Sends one request; returns (status, headers, body) or, with stream=True, the open
        response (the caller reads it to the end)."""
        path = "/" + bucket + ("/" + key if key else "")
        query = query or {}
        hdrs = dict(headers or {})
        if body is not None:
            hdrs["content-length"] = str(len(body))
        signed = self._sign(method, path, query, hdrs)
        url = _q(path)
        if query:
            url += "?" + "&".join(
                f"{_q(k, '~')}={_q(v, '~')}" if v != "" else _q(k, "~") for k, v in query.items()
            )
        with self._lock:
            self.requests += 1
        for attempt in range(2):
            conn = self._conn()
            try:
                conn.request(method, url, body=body, headers=signed)
                resp = conn.getresponse()
                break
            except (ConnectionError, http.client.HTTPException, OSError):
                self._drop_conn()
                if attempt:
                    raise
        if stream and resp.status in ok:
            return resp
        data = resp.read()
        if resp.status not in ok:
            raise S3Error(resp.status, data, f"{method} {path}")
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data

    # -- operations -----------------------------------------------------------------------------

    def create_bucket(self, bucket: str) -> None:
        try:
            self.request("PUT", bucket)
        except S3Error as e:
            if b"BucketAlreadyOwnedByYou" not in e.body:
                raise

    def bucket_exists(self, bucket: str) -> bool:
        try:
            self.request("HEAD", bucket)
            return True
        except S3Error as e:
            if e.status == 404:
                return False
            raise

    def put(self, bucket: str, key: str, data: bytes, meta: dict[str, str] | None = None) -> None:
        h = {f"x-amz-meta-{k}": v for k, v in (meta or {}).items()}
        self.request("PUT", bucket, key, body=data, headers=h)

    def put_chunks(self, bucket: str, key: str, chunks: Iterable[bytes], part_size: int) -> None:
        """Uploads the concatenation of `chunks`: one PUT when it fits in a part, else multipart."""
        buf = bytearray()
        upload_id = None
        parts: list[tuple[int, str]] = []
        for c in chunks:
            buf += c
            while len(buf) > part_size or (upload_id is not None and len(buf) >= part_size):
                if upload_id is None:
                    _, _, body = self.request("POST", bucket, key, query={"uploads": ""})
                    upload_id = ET.fromstring(body).find(f"{_NS}UploadId").text
                n = len(parts) + 1
                _, h, _ = self.request(
                    "PUT", bucket, key, query={"partNumber": str(n), "uploadId": upload_id},
                    body=bytes(buf[:part_size]),
                )
                parts.append((n, h["etag"]))
                del buf[:part_size]
        if upload_id is None:
            self.request("PUT", bucket, key, body=bytes(buf))
            return
        if buf:
            n = len(parts) + 1
            _, h, _ = self.request(
                "PUT", bucket, key, query={"partNumber": str(n), "uploadId": upload_id}, body=bytes(buf)
            )
            parts.append((n, h["etag"]))
        xml = "<CompleteMultipartUpload>" + "".join(
            f"<Part><PartNumber>{n}</PartNumber><ETag>{e}</ETag></Part>" for n, e in parts
        ) + "</CompleteMultipartUpload>"
        self.request("POST", bucket, key, query={"uploadId": upload_id}, body=xml.encode())

    def head(self, bucket: str, key: str) -> dict[str, str] | None:
        try:
            _, h, _ = self.request("HEAD", bucket, key)
            return h
        except S3Error as e:
            if e.status == 404:
                return None
            raise

    def get_stream(self, bucket: str, key: str) -> Iterator[bytes]:
        resp = self.request("GET", bucket, key, stream=True)
        try:
            while True:
                b = resp.read(1 << 20)
                if not b:
                    break
                yield b
        finally:
            resp.read()

    def list(self, bucket: str, prefix: str = "", delimiter: str | None = None) -> Iterator[ObjectInfo]:
        token = None
        while True:
            q = {"list-type": "2", "prefix": prefix, "max-keys": "1000"}
            if delimiter:
                q["delimiter"] = delimiter
            if token:
                q["continuation-token"] = token
            _, _, body = self.request("GET", bucket, query=q)
            root = ET.fromstring(body)
            for c in root.findall(f"{_NS}Contents"):
                yield ObjectInfo(
                    c.find(f"{_NS}Key").text,
                    int(c.find(f"{_NS}Size").text),
                    (c.find(f"{_NS}ETag").text or "").strip('"'),
                )
            if (root.findtext(f"{_NS}IsTruncated") or "false") != "true":
                return
            token = root.findtext(f"{_NS}NextContinuationToken")

    def delete_many(self, bucket: str, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            chunk = keys[i : i + 1000]
            xml = "<Delete><Quiet>true</Quiet>" + "".join(
                f"<Object><Key>{_xml_escape(k)}</Key></Object>" for k in chunk
            ) + "</Delete>"
            body = xml.encode()
            md5 = b64encode(hashlib.md5(body).digest()).decode()
            self.request("POST", bucket, query={"delete": ""}, body=body, headers={"content-md5": md5})

    def delete_prefix(self, bucket: str, prefix: str) -> int:
        keys = [o.key for o in self.list(bucket, prefix)]
        self.delete_many(bucket, keys)
        # Abandoned multipart uploads would keep their parts on disk.
        try:
            _, _, body = self.request("GET", bucket, query={"uploads": "", "prefix": prefix})
            root = ET.fromstring(body)
            for u in root.findall(f"{_NS}Upload"):
                self.request(
                    "DELETE", bucket, u.findtext(f"{_NS}Key"), query={"uploadId": u.findtext(f"{_NS}UploadId")}
                )
        except S3Error:
            pass
        return len(keys)


def _xml_escape(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
