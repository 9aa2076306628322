"""The XML multipart server's protocol, spoken over real HTTP, in front of a real fake-gcs-server."""

from __future__ import annotations

import base64
import hashlib
import random
import threading
import xml.etree.ElementTree as ElementTree
from concurrent.futures import ThreadPoolExecutor

import google_crc32c
import pytest
import requests
from google.cloud.storage import transfer_manager
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataflux_ckpt.testing import XmlMultipartServer
from tests.support.gcs import S3_NAMESPACE, client_for, uploads_in_progress

NS = f"{{{S3_NAMESPACE}}}"


def _crc32c(data: bytes) -> str:
    return base64.b64encode(google_crc32c.Checksum(data).digest()).decode()


def _md5(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()


def _error_code(response: requests.Response) -> str:
    return ElementTree.fromstring(response.content).findtext("Code")


class Client:
    """The XML multipart protocol by hand, as GCS documents it."""

    def __init__(self, url: str, bucket: str, key: str) -> None:
        self.base = f"{url}/{bucket}/{key}"
        self.http = requests.Session()

    def initiate(self) -> str:
        response = self.http.post(f"{self.base}?uploads", headers={"Content-Type": "application/x-test"}, timeout=10)
        assert response.status_code == 200, response.text
        return ElementTree.fromstring(response.content).findtext(f"{NS}UploadId")

    def put(self, upload_id: str, number: int, data: bytes, **headers: str) -> requests.Response:
        return self.http.put(f"{self.base}?partNumber={number}&uploadId={upload_id}", data=data,
                             headers=headers, timeout=30)

    def part(self, upload_id: str, number: int, data: bytes) -> str:
        response = self.put(upload_id, number, data)
        assert response.status_code == 200, response.text
        assert response.headers["ETag"] == f'"{hashlib.md5(data).hexdigest()}"'
        assert response.headers["x-goog-hash"] == f"crc32c={_crc32c(data)},md5={_md5(data)}"
        return response.headers["ETag"]

    def complete(self, upload_id: str, parts: list[tuple[int, str]]) -> requests.Response:
        body = "<CompleteMultipartUpload>" + "".join(
            f"<Part><PartNumber>{n}</PartNumber><ETag>{etag}</ETag></Part>" for n, etag in parts
        ) + "</CompleteMultipartUpload>"
        return self.http.post(f"{self.base}?uploadId={upload_id}", data=body,
                              headers={"Content-Type": "application/xml"}, timeout=30)

    def list_parts(self, upload_id: str, **params: int) -> requests.Response:
        return self.http.get(f"{self.base}?uploadId={upload_id}", params=params, timeout=10)

    def abort(self, upload_id: str) -> requests.Response:
        return self.http.delete(f"{self.base}?uploadId={upload_id}", timeout=10)


def _stored(url: str, bucket: str, key: str) -> tuple[int, bytes | None, dict]:
    """Status, bytes and JSON metadata of an object, read through the JSON API."""
    name = requests.utils.quote(key, safe="")
    meta = requests.get(f"{url}/storage/v1/b/{bucket}/o/{name}", timeout=10)
    if meta.status_code != 200:
        return meta.status_code, None, {}
    data = requests.get(f"{url}/download/storage/v1/b/{bucket}/o/{name}?alt=media", timeout=30).content
    return 200, data, meta.json()


def test_initiate_upload_list_complete(gcs_xml_server, gcs_bucket):
    client = Client(gcs_xml_server.url, gcs_bucket, "dir/model.ckpt")
    upload_id = client.initiate()
    assert uploads_in_progress(gcs_xml_server.url, gcs_bucket) == ["dir/model.ckpt"]
    parts = {n: random.Random(n).randbytes(100_000 + n) for n in range(1, 6)}
    with ThreadPoolExecutor(4) as pool:  # parts arrive concurrently and out of order
        etags = dict(zip(reversed(parts), pool.map(lambda n: client.part(upload_id, n, parts[n]), reversed(parts)), strict=True))
    parts[3] = b"sent again"  # a part sent again replaces the first one
    etags[3] = client.part(upload_id, 3, parts[3])

    listing = ElementTree.fromstring(client.list_parts(upload_id).content)
    listed = [(int(p.findtext(f"{NS}PartNumber")), p.findtext(f"{NS}ETag"), int(p.findtext(f"{NS}Size")))
              for p in listing.iter(f"{NS}Part")]
    assert listed == [(n, etags[n], len(parts[n])) for n in range(1, 6)]
    page = ElementTree.fromstring(client.list_parts(upload_id, **{"max-parts": 2, "part-number-marker": 1}).content)
    assert [int(p.findtext(f"{NS}PartNumber")) for p in page.iter(f"{NS}Part")] == [2, 3]
    assert page.findtext(f"{NS}IsTruncated") == "true" and page.findtext(f"{NS}NextPartNumberMarker") == "3"

    done = client.complete(upload_id, [(n, etags[n]) for n in range(1, 6)])
    assert done.status_code == 200, done.text
    expected = b"".join(parts[n] for n in range(1, 6))
    status, data, meta = _stored(gcs_xml_server.url, gcs_bucket, "dir/model.ckpt")
    assert status == 200 and data == expected
    assert done.headers["x-goog-hash"] == f"crc32c={_crc32c(expected)}" == f"crc32c={meta['crc32c']}"
    assert done.headers["x-goog-generation"] == str(meta["generation"])
    assert meta["contentType"] == "application/x-test"
    assert ElementTree.fromstring(done.content).findtext(f"{NS}Key") == "dir/model.ckpt"
    assert uploads_in_progress(gcs_xml_server.url, gcs_bucket) == []
    assert _error_code(client.list_parts(upload_id)) == "NoSuchUpload"


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(0, 70_000), min_size=1, max_size=8), data=st.data())
def test_completion_concatenates_exactly_the_listed_parts(gcs_xml_server, gcs_bucket, sizes, data):
    key = f"prop/{random.getrandbits(64):x}"
    client = Client(gcs_xml_server.url, gcs_bucket, key)
    upload_id = client.initiate()
    parts = {n: random.Random(n * 7919 + size).randbytes(size) for n, size in enumerate(sizes, start=1)}
    etags = {n: client.part(upload_id, n, payload) for n, payload in parts.items()}
    chosen = data.draw(st.lists(st.sampled_from(sorted(parts)), min_size=1, unique=True).map(sorted))
    assert client.complete(upload_id, [(n, etags[n]) for n in chosen]).status_code == 200
    assert _stored(gcs_xml_server.url, gcs_bucket, key)[1] == b"".join(parts[n] for n in chosen)


def test_abort_discards_the_parts_and_publishes_nothing(gcs_xml_server, gcs_bucket):
    client = Client(gcs_xml_server.url, gcs_bucket, "aborted.ckpt")
    upload_id = client.initiate()
    client.part(upload_id, 1, b"x" * 1000)
    assert client.abort(upload_id).status_code == 204
    assert uploads_in_progress(gcs_xml_server.url, gcs_bucket) == []
    assert _stored(gcs_xml_server.url, gcs_bucket, "aborted.ckpt")[0] == 404
    assert _error_code(client.abort(upload_id)) == "NoSuchUpload"
    assert _error_code(client.put(upload_id, 2, b"late")) == "NoSuchUpload"


@pytest.mark.parametrize("header", ["x-goog-hash crc32c", "x-goog-hash md5", "Content-MD5"])
def test_part_with_a_bad_checksum_is_refused(gcs_xml_server, gcs_bucket, header):
    client = Client(gcs_xml_server.url, gcs_bucket, "bad-digest.ckpt")
    upload_id = client.initiate()
    data, other = b"the bytes that were sent", b"the bytes that were meant"
    declared = {"x-goog-hash crc32c": {"x-goog-hash": f"crc32c={_crc32c(other)}"},
                "x-goog-hash md5": {"x-goog-hash": f"md5={_md5(other)}"},
                "Content-MD5": {"Content-MD5": _md5(other)}}[header]
    refused = client.put(upload_id, 1, data, **declared)
    assert refused.status_code == 400 and _error_code(refused) == "BadDigest"
    assert list(ElementTree.fromstring(client.list_parts(upload_id).content).iter(f"{NS}Part")) == []
    # The same part with its true checksums (both kinds in one header, as GCS clients send them).
    accepted = client.put(upload_id, 1, data, **{"x-goog-hash": f"crc32c={_crc32c(data)},md5={_md5(data)}"})
    assert accepted.status_code == 200


def test_wrong_etag_at_complete_is_refused_and_the_upload_survives(gcs_xml_server, gcs_bucket):
    client = Client(gcs_xml_server.url, gcs_bucket, "etag.ckpt")
    upload_id = client.initiate()
    first, second = client.part(upload_id, 1, b"a" * 10), client.part(upload_id, 2, b"b" * 10)
    refused = client.complete(upload_id, [(1, first), (2, f'"{hashlib.md5(b"other").hexdigest()}"')])
    assert refused.status_code == 400 and _error_code(refused) == "InvalidPart"
    assert _error_code(client.complete(upload_id, [(1, first), (3, second)])) == "InvalidPart"
    assert _error_code(client.complete(upload_id, [(2, second), (1, first)])) == "InvalidPartOrder"
    assert _error_code(client.complete(upload_id, [])) == "MalformedXML"
    assert _stored(gcs_xml_server.url, gcs_bucket, "etag.ckpt")[0] == 404
    assert client.complete(upload_id, [(1, first), (2, second)]).status_code == 200
    assert _stored(gcs_xml_server.url, gcs_bucket, "etag.ckpt")[1] == b"a" * 10 + b"b" * 10


def test_missing_or_unknown_upload_id(gcs_xml_server, gcs_bucket):
    client = Client(gcs_xml_server.url, gcs_bucket, "unknown.ckpt")
    for response in (client.put("0123abcd", 1, b"x"), client.list_parts("0123abcd"),
                     client.complete("0123abcd", [(1, '"x"')]), client.abort("0123abcd")):
        assert response.status_code == 404 and _error_code(response) == "NoSuchUpload"
    empty = client.put("", 1, b"x")
    assert empty.status_code == 400 and _error_code(empty) == "InvalidArgument"
    # An upload id is bound to its bucket and object.
    upload_id = client.initiate()
    elsewhere = Client(gcs_xml_server.url, gcs_bucket, "another.ckpt")
    assert _error_code(elsewhere.put(upload_id, 1, b"x")) == "NoSuchUpload"
    assert _error_code(client.put(upload_id, 0, b"x")) == "InvalidArgument"
    assert _error_code(client.put(upload_id, 10_001, b"x")) == "InvalidArgument"


def test_missing_bucket(gcs_xml_server):
    response = requests.post(f"{gcs_xml_server.url}/no-such-bucket-here/k?uploads", timeout=10)
    assert response.status_code == 404 and _error_code(response) == "NoSuchBucket"


def test_parts_smaller_than_gcs_minimum_are_refused_at_completion(gcs_emulator, gcs_bucket):
    with XmlMultipartServer(gcs_emulator) as server:  # GCS's 5 MiB minimum
        client = Client(server.url, gcs_bucket, "small.ckpt")
        upload_id = client.initiate()
        small = client.part(upload_id, 1, b"s" * 1000)
        big = client.part(upload_id, 2, b"b" * (5 * 2**20))
        last = client.part(upload_id, 3, b"l" * 10)
        refused = client.complete(upload_id, [(1, small), (2, big)])
        assert refused.status_code == 400 and _error_code(refused) == "EntityTooSmall"
        assert client.complete(upload_id, [(2, big), (3, last)]).status_code == 200


def test_concurrent_completions_to_one_key_leave_one_whole_object(gcs_xml_server, gcs_bucket):
    payloads = [bytes([i]) * 3_000_000 for i in (1, 2)]
    clients = [Client(gcs_xml_server.url, gcs_bucket, "race.ckpt") for _ in payloads]
    uploads = [(c, c.initiate()) for c in clients]
    etags = [[c.part(u, n, p[(n - 1) * 1_000_000 : n * 1_000_000]) for n in (1, 2, 3)]
             for (c, u), p in zip(uploads, payloads, strict=True)]
    barrier = threading.Barrier(2)

    def complete(index: int) -> int:
        client, upload_id = uploads[index]
        barrier.wait()
        return client.complete(upload_id, list(enumerate(etags[index], start=1))).status_code

    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(complete, (0, 1))) == [200, 200]
    assert _stored(gcs_xml_server.url, gcs_bucket, "race.ckpt")[1] in payloads


def test_other_requests_pass_through_and_resumable_sessions_stay_on_it(gcs_xml_server, gcs_bucket):
    client = client_for(gcs_xml_server.url)
    blob = client.bucket(gcs_bucket).blob("json/obj.bin")
    blob.chunk_size = 256 * 1024  # a resumable upload in four requests
    data = random.Random(1).randbytes(1_000_000)
    blob.upload_from_string(data)
    assert client.bucket(gcs_bucket).blob("json/obj.bin").download_as_bytes() == data
    assert [b.name for b in client.list_blobs(gcs_bucket, prefix="json/")] == ["json/obj.bin"]
    start = requests.post(f"{gcs_xml_server.url}/upload/storage/v1/b/{gcs_bucket}/o",
                          params={"uploadType": "resumable", "name": "json/session"}, json={}, timeout=10)
    assert start.headers["Location"].startswith(gcs_xml_server.url + "/")


def test_google_cloud_storage_transfer_manager_uploads_through_it(gcs_xml_server, gcs_bucket, tmp_path):
    """google-cloud-storage's own XML multipart client, as real GCS users run it."""
    source = tmp_path / "big.bin"
    data = random.Random(2).randbytes(3 * 2**20 + 123)
    source.write_bytes(data)
    blob = client_for(gcs_xml_server.url).bucket(gcs_bucket).blob("tm/big.bin")
    transfer_manager.upload_chunks_concurrently(str(source), blob, chunk_size=2**20, max_workers=4,
                                                worker_type=transfer_manager.THREAD)
    assert _stored(gcs_xml_server.url, gcs_bucket, "tm/big.bin")[1] == data


def _generation(url: str, bucket: str, key: str) -> int:
    return int(_stored(url, bucket, key)[2].get("generation") or 0)


def test_generation_preconditions_are_enforced_where_fake_gcs_server_ignores_them(gcs_xml_server, gcs_bucket):
    url = gcs_xml_server.url
    upload = f"{url}/upload/storage/v1/b/{gcs_bucket}/o"

    def media(name: str, data: bytes, generation: int | None) -> requests.Response:
        params = {"uploadType": "media", "name": name}
        if generation is not None:
            params["ifGenerationMatch"] = str(generation)
        return requests.post(upload, params=params, data=data, timeout=10)

    assert media("pre/obj", b"first", 0).status_code == 200  # 0: only if there is none
    first = _generation(url, gcs_bucket, "pre/obj")
    refused = media("pre/obj", b"second", 0)
    assert refused.status_code == 412 and refused.json()["error"]["errors"][0]["reason"] == "conditionNotMet"
    assert media("pre/obj", b"second", first + 1).status_code == 412
    assert media("pre/obj", b"second", first).status_code == 200
    second = _generation(url, gcs_bucket, "pre/obj")
    assert second != first and _stored(url, gcs_bucket, "pre/obj")[1] == b"second"

    for name in ("pre/a", "pre/b"):
        assert media(name, name.encode(), None).status_code == 200
    compose = f"{url}/storage/v1/b/{gcs_bucket}/o/{requests.utils.quote('pre/obj', safe='')}/compose"
    body = {"sourceObjects": [{"name": "pre/a"}, {"name": "pre/b"}]}
    assert requests.post(compose, params={"ifGenerationMatch": first}, json=body, timeout=10).status_code == 412
    composed = requests.post(compose, params={"ifGenerationMatch": second}, json=body, timeout=10)
    assert composed.status_code == 200
    third = int(composed.json()["generation"])
    assert third not in (first, second)  # a compose over an object makes a new generation, as on GCS
    assert _stored(url, gcs_bucket, "pre/obj")[1] == b"pre/apre/b"

    delete = f"{url}/storage/v1/b/{gcs_bucket}/o/{requests.utils.quote('pre/obj', safe='')}"
    assert requests.delete(delete, params={"ifGenerationMatch": second}, timeout=10).status_code == 412
    assert _stored(url, gcs_bucket, "pre/obj")[0] == 200
    assert requests.delete(delete, params={"ifGenerationMatch": third}, timeout=10).status_code in (200, 204)
    assert _stored(url, gcs_bucket, "pre/obj")[0] == 404


def test_resumable_upload_precondition_is_checked_when_it_finishes(gcs_xml_server, gcs_bucket):
    url = gcs_xml_server.url
    requests.post(f"{url}/upload/storage/v1/b/{gcs_bucket}/o", params={"uploadType": "media", "name": "res"},
                  data=b"old", timeout=10)
    current = _generation(url, gcs_bucket, "res")
    for generation, expected in ((current + 1, 412), (current, 200)):
        start = requests.post(f"{url}/upload/storage/v1/b/{gcs_bucket}/o", json={}, timeout=10,
                              params={"uploadType": "resumable", "name": "res", "ifGenerationMatch": generation})
        session = start.headers["Location"]
        assert requests.put(session, data=b"x" * 262144, headers={"Content-Range": "bytes 0-262143/*"},
                            timeout=10).status_code == 308
        last = requests.put(session, data=b"y", headers={"Content-Range": "bytes 262144-262144/262145"}, timeout=10)
        assert last.status_code == expected
    assert _stored(url, gcs_bucket, "res")[1] == b"x" * 262144 + b"y"
