/* The smartredis_io Redis module: RedisAI's commands for SmartRedis clients (C, C++, Fortran,
 * Python) on a stock redis-server 7.0 or newer, over smartredis_io's storage, and the execution
 * workers that run their models.
 *
 *     redis-server --loadmodule "$(python -m smartredis_io.redis_module)" [NAME value ...]
 *
 * Each concern registers its own commands here: tensors (tensor.c), models and scripts (model.c),
 * AI.INFO / AI.CONFIG (admin.c), runs and the worker protocol (exec.h), and the workers the module
 * starts (spawn.c); the load-time arguments are config.c's.
 */
#include <string.h>
#include <strings.h>

#include "srio.h"

#define SRIO_MODULE_NAME "srio"
#define SRIO_MODULE_VERSION 1

/* CONFIG SET proto-max-bulk-len moves the default largest tensor with it. */
static void config_changed(RedisModuleCtx *ctx, RedisModuleEvent event, uint64_t subevent, void *data) {
    (void)event;
    if (subevent != REDISMODULE_SUBEVENT_CONFIG_CHANGE) return;
    RedisModuleConfigChange *change = data;
    for (uint32_t i = 0; i < change->num_changes; i++) {
        if (strcasecmp(change->config_names[i], "proto-max-bulk-len") == 0) SRIO_RefreshServerLimits(ctx);
    }
}

SRIO_EXPORT int RedisModule_OnLoad(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (RedisModule_Init(ctx, SRIO_MODULE_NAME, SRIO_MODULE_VERSION, REDISMODULE_APIVER_1) == REDISMODULE_ERR) {
        return REDISMODULE_ERR;
    }
    if (RedisModule_SetCommandInfo == NULL || RedisModule_ACLCheckKeyPermissions == NULL) {
        RedisModule_Log(ctx, "warning", "the smartredis_io module needs Redis 7.0 or newer");
        return REDISMODULE_ERR;
    }
    if (SRIO_Configure(ctx, argv, argc) == REDISMODULE_ERR) return REDISMODULE_ERR;
    SRIO_RefreshServerLimits(ctx);
    if (RedisModule_SubscribeToServerEvent(ctx, RedisModuleEvent_Config, config_changed) == REDISMODULE_ERR ||
        SRIO_RegisterTensorCommands(ctx) == REDISMODULE_ERR || SRIO_RegisterModelCommands(ctx) == REDISMODULE_ERR ||
        SRIO_RegisterAdminCommands(ctx) == REDISMODULE_ERR || SRIO_ExecRegister(ctx) == REDISMODULE_ERR ||
        SRIO_SpawnRegister(ctx) == REDISMODULE_ERR) {
        return REDISMODULE_ERR;
    }
    return REDISMODULE_OK;
}

/* The queue, the requests in flight and the workers live in this module's memory, and its
 * workers hold a pipe to it: it stays loaded for the server's life. */
SRIO_EXPORT int RedisModule_OnUnload(RedisModuleCtx *ctx) {
    RedisModule_Log(ctx, "warning", "the smartredis_io module cannot be unloaded: requests and workers depend on it");
    return REDISMODULE_ERR;
}
