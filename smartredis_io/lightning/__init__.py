"""The Lightning integration: checkpoints and model publishing on Redis, and ``redis://`` paths for fsspec.

``checkpoint_io`` holds ``SmartRedisCheckpointIO``, ``SmartRedisModelCheckpoint`` and
``SmartRedisModelPublisher`` (exported by :mod:`smartredis_io`, which imports Lightning on their
first use); ``filesystem`` is the fsspec file system Lightning lists and removes ``redis://``
checkpoints through. Importing this package imports no Lightning.
"""
