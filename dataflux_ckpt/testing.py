"""Local stand-ins for GCS, for tests, examples and offline runs; not part of the plugin itself.

    from dataflux_ckpt.testing import FakeGcsServer, XmlMultipartServer

    with FakeGcsServer() as gcs, XmlMultipartServer(gcs) as front, front.activated():
        front.create_bucket("ckpts")
        ...  # GCS clients in this process now talk to the local server

:class:`FakeGcsServer` runs fake-gcs-server (the JSON API); :class:`XmlMultipartServer` serves GCS's
XML API multipart uploads in front of it. Neither has authentication: both listen on loopback
unless started with ``allow_remote=True``.
"""

from __future__ import annotations

from dataflux_ckpt.emulator import FakeGcsServer, create_bucket, find_fake_gcs_server
from dataflux_ckpt.xml_server import XmlMultipartServer

__all__ = ["FakeGcsServer", "XmlMultipartServer", "create_bucket", "find_fake_gcs_server"]
