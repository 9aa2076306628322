/* The smartredis_io Redis module: RedisAI's commands for SmartRedis clients (C, C++, Fortran,
 * Python) on a stock redis-server 7.0 or newer, over smartredis_io's storage.
 *
 *     redis-server --loadmodule "$(python -m smartredis_io.redis_module)" [NAME value ...]
 *
 * Each concern registers its own commands here: tensors (tensor.c), models and scripts (model.c),
 * AI.INFO / AI.CONFIG and the load-time arguments (admin.c); the execution half adds its own.
 */
#include "exec.h"
#include "srio.h"

#define SRIO_MODULE_NAME "srio"
#define SRIO_MODULE_VERSION 1

SRIO_EXPORT int RedisModule_OnLoad(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (RedisModule_Init(ctx, SRIO_MODULE_NAME, SRIO_MODULE_VERSION, REDISMODULE_APIVER_1) == REDISMODULE_ERR) {
        return REDISMODULE_ERR;
    }
    if (RedisModule_SetCommandInfo == NULL || RedisModule_ACLCheckKeyPermissions == NULL) {
        RedisModule_Log(ctx, "warning", "the smartredis_io module needs Redis 7.0 or newer");
        return REDISMODULE_ERR;
    }
    if (SRIO_Configure(ctx, argv, argc) == REDISMODULE_ERR) return REDISMODULE_ERR;
    if (SRIO_RegisterTensorCommands(ctx) == REDISMODULE_ERR || SRIO_RegisterModelCommands(ctx) == REDISMODULE_ERR ||
        SRIO_RegisterAdminCommands(ctx) == REDISMODULE_ERR || SRIO_ExecRegister(ctx) == REDISMODULE_ERR) {
        return REDISMODULE_ERR;
    }
    return REDISMODULE_OK;
}
