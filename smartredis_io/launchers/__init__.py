"""Launchers: Redis servers and clusters with the smartredis_io module loaded, and SmartSim's set-up.

``server`` holds ``RedisServer``, ``RedisCluster`` and ``Orchestrator`` (exported by
:mod:`smartredis_io`); ``redis_module`` finds the module's shared object for ``redis-server
--loadmodule``; ``smartsim_setup`` lays out what SmartSim's ``smart build`` would. The last two are
commands: ``python -m smartredis_io.redis_module`` and ``python -m smartredis_io.smartsim_setup``.
"""
