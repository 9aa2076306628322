/* The execution half of the smartredis_io Redis module: RedisAI's AI.MODELEXECUTE, AI.SCRIPTEXECUTE
 * and AI.SCRIPTRUN, queued in this server's memory and run by `python -m smartredis_io.worker`
 * processes through the SRIO.* commands (syntax in docs/smartredis.md). Its statistics
 * (SRIO_ExecGetStats / SRIO_ExecResetStats) are declared in srio.h. */
#ifndef SRIO_EXEC_H
#define SRIO_EXEC_H

#include "srio.h"

/* Create the execution commands, subscribe to client disconnections and start the heartbeat
 * timer; call once from RedisModule_OnLoad. This file owns the module's ClientChange subscription
 * (a module has one callback per server event). REDISMODULE_OK or REDISMODULE_ERR. */
int SRIO_ExecRegister(RedisModuleCtx *ctx);

/* The deadline of a request that names no TIMEOUT (AI.SCRIPTRUN from SmartRedis sends none);
 * 60000 ms, SmartRedis's default SR_MODEL_TIMEOUT, unless set. Values <= 0 are ignored. */
void SRIO_ExecSetDefaultTimeout(long long ms);

#endif
