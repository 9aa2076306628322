/* The execution half of the smartredis_io Redis module: RedisAI's AI.MODELEXECUTE, AI.SCRIPTEXECUTE
 * and AI.SCRIPTRUN, queued in this server's memory and run by `python -m smartredis_io.worker`
 * processes through the SRIO.* commands (syntax in docs/smartredis.md). */
#ifndef SRIO_EXEC_H
#define SRIO_EXEC_H

#include "redismodule.h"

/* What the workers have counted for one model or script key (RedisAI's AI.INFO fields). */
typedef struct SRIO_ExecStats {
    long long duration_us; /* time spent running it, in microseconds */
    long long samples;     /* rows of the first input (a batch counts all its rows) */
    long long calls;       /* runs (a batch is one run) */
    long long errors;      /* requests answered with an error, timeouts included */
} SRIO_ExecStats;

/* Create the execution commands, subscribe to client disconnections and start the heartbeat
 * timer; call once from RedisModule_OnLoad. This file owns the module's ClientChange subscription
 * (a module has one callback per server event). REDISMODULE_OK or REDISMODULE_ERR. */
int SRIO_ExecRegister(RedisModuleCtx *ctx);

/* The statistics of `key`; 0 (and zeros in `out`) when nothing was counted for it. */
int SRIO_ExecGetStats(RedisModuleString *key, SRIO_ExecStats *out);

/* Forget the statistics of `key` (AI.INFO key RESETSTAT, and a deleted model or script). */
void SRIO_ExecResetStats(RedisModuleString *key);

/* The deadline of a request that names no TIMEOUT (AI.SCRIPTRUN from SmartRedis sends none);
 * 60000 ms, SmartRedis's default SR_MODEL_TIMEOUT, unless set. Values <= 0 are ignored. */
void SRIO_ExecSetDefaultTimeout(long long ms);

#endif
