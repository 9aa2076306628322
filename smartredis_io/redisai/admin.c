/* AI.INFO and AI.CONFIG.
 *
 * AI.INFO key [RESETSTAT]
 * AI.CONFIG LOADBACKEND <backend> <path> | BACKENDSPATH <path> | MODEL_CHUNK_SIZE <bytes>
 *         | GET BACKENDSPATH | GET MODEL_CHUNK_SIZE
 */
#include <string.h>

#include "srio.h"

/* AI.INFO key [RESETSTAT] */
static int Info(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc < 2 || argc > 3) return RedisModule_WrongArity(ctx);
    if (argc == 3 && !SRIO_Is(argv[2], "RESETSTAT")) return SRIO_ReplyError(ctx, "ERR unsupported argument: RESETSTAT or nothing");
    SRIO_Manifest m;
    if (SRIO_ManifestRead(ctx, argv[1], &m) != SRIO_OK) return SRIO_ReplyError(ctx, "ERR cannot find run info for key");
    if (argc == 3) {
        SRIO_ManifestFree(&m);
        SRIO_ExecResetStats(argv[1]);
        return RedisModule_ReplyWithSimpleString(ctx, "OK");
    }
    SRIO_ExecStats stats;
    SRIO_ExecGetStats(argv[1], &stats);
    int model = !strcmp(m.kind, "model");
    RedisModule_ReplyWithArray(ctx, 18);
    RedisModule_ReplyWithCString(ctx, "key");
    RedisModule_ReplyWithString(ctx, argv[1]);
    RedisModule_ReplyWithCString(ctx, "type");
    RedisModule_ReplyWithCString(ctx, model ? "MODEL" : "SCRIPT");
    RedisModule_ReplyWithCString(ctx, "backend");
    RedisModule_ReplyWithCString(ctx, m.backend);
    RedisModule_ReplyWithCString(ctx, "device");
    RedisModule_ReplyWithCString(ctx, m.device);
    RedisModule_ReplyWithCString(ctx, "tag");
    RedisModule_ReplyWithStringBuffer(ctx, m.tag, m.tag_len);
    RedisModule_ReplyWithCString(ctx, "duration");
    RedisModule_ReplyWithLongLong(ctx, stats.duration_us);
    RedisModule_ReplyWithCString(ctx, "samples");
    RedisModule_ReplyWithLongLong(ctx, model ? stats.samples : -1);
    RedisModule_ReplyWithCString(ctx, "calls");
    RedisModule_ReplyWithLongLong(ctx, stats.calls);
    RedisModule_ReplyWithCString(ctx, "errors");
    RedisModule_ReplyWithLongLong(ctx, stats.errors);
    SRIO_ManifestFree(&m);
    return REDISMODULE_OK;
}

static void set_backends_path(RedisModuleString *path) {
    size_t n;
    const char *p = RedisModule_StringPtrLen(path, &n);
    if (SRIO_Config.backends_path) RedisModule_Free(SRIO_Config.backends_path);
    SRIO_Config.backends_path = RedisModule_Alloc(n + 1);
    memcpy(SRIO_Config.backends_path, p, n);
    SRIO_Config.backends_path[n] = '\0';
}

static int Config(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc < 2) return RedisModule_WrongArity(ctx);
    if (SRIO_Is(argv[1], "LOADBACKEND")) {
        if (argc < 4) return RedisModule_WrongArity(ctx);
        if (!SRIO_CheckBackend(ctx, argv[2])) return REDISMODULE_OK;
        return RedisModule_ReplyWithSimpleString(ctx, "OK"); /* the workers bring torch */
    }
    if (SRIO_Is(argv[1], "BACKENDSPATH")) {
        if (argc < 3) return SRIO_ReplyError(ctx, "ERR BACKENDSPATH: missing path argument");
        set_backends_path(argv[2]);
        return RedisModule_ReplyWithSimpleString(ctx, "OK");
    }
    if (SRIO_Is(argv[1], "MODEL_CHUNK_SIZE")) {
        long long size;
        if (argc < 3) return SRIO_ReplyError(ctx, "ERR MODEL_CHUNK_SIZE: missing chunk size");
        if (RedisModule_StringToLongLong(argv[2], &size) != REDISMODULE_OK || size <= 0) {
            return SRIO_ReplyError(ctx, "ERR MODEL_CHUNK_SIZE: invalid chunk size");
        }
        SRIO_Config.model_chunk_size = size;
        return RedisModule_ReplyWithSimpleString(ctx, "OK");
    }
    if (SRIO_Is(argv[1], "GET")) {
        if (argc < 3) return RedisModule_WrongArity(ctx);
        if (SRIO_Is(argv[2], "BACKENDSPATH")) {
            return RedisModule_ReplyWithCString(ctx, SRIO_Config.backends_path ? SRIO_Config.backends_path : "");
        }
        if (SRIO_Is(argv[2], "MODEL_CHUNK_SIZE")) return RedisModule_ReplyWithLongLong(ctx, SRIO_Config.model_chunk_size);
        return RedisModule_ReplyWithNull(ctx);
    }
    return SRIO_ReplyError(ctx, "ERR unsupported subcommand");
}

int SRIO_RegisterAdminCommands(RedisModuleCtx *ctx) {
    if (SRIO_CreateKeyCommand(ctx, "ai.info", Info, "readonly", -2, REDISMODULE_CMD_KEY_RO | REDISMODULE_CMD_KEY_ACCESS) ==
        REDISMODULE_ERR) {
        return REDISMODULE_ERR;
    }
    /* no keys; the settings are the server's (RedisAI's AI.CONFIG is a write command without keys) */
    return SRIO_CreateCommand(ctx, "ai.config", Config, "write", -2);
}
