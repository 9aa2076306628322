"""Support shared by the storage plugins of the ``lightning-storage-plugins`` distribution.

The plugins themselves are the packages ``dataflux_ckpt`` (Google Cloud Storage), ``fastpersist``
(NVMe) and ``smartredis_io`` (Redis). This package holds what they share and nothing that needs
another plugin's dependencies: :mod:`lightning_storage_plugins.services` supervises the local
service processes (emulators, servers, workers) their launchers start.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("lightning-storage-plugins")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
