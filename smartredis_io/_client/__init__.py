"""The SmartRedis client's internals: private, behind the public modules of :mod:`smartredis_io`.

The connection to a standalone server or a cluster (``connection``, over redis-py through
``_redispy``), the tensor wire format (``wire``), the stored-model and request protocol shared with
the Redis module and the workers (``protocol``, ``placement``), the policies on which stored code
may run (``torchscript_policy``, ``export_policy``), the argument checks (``helpers``), and the
``Client``'s commands, one mixin per data type on ``client_base``. The execution workers, the
launchers and the Lightning plugins are clients of the same database: they build on the
connection, wire format and protocol here, and nothing here imports them.
"""
