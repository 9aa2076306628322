/* AI.INFO and AI.CONFIG, and the module's load-time arguments.
 *
 * AI.INFO key [RESETSTAT]
 * AI.CONFIG LOADBACKEND <backend> <path> | BACKENDSPATH <path> | MODEL_CHUNK_SIZE <bytes>
 *         | GET BACKENDSPATH | GET MODEL_CHUNK_SIZE
 *
 * Load-time arguments (pairs, as RedisAI's): MODEL_CHUNK_SIZE <bytes>, BACKENDSPATH <path>,
 * BULK_LIMIT_BYTES <bytes> (the size above which values are chunked; smartredis_io's own), and
 * RedisAI's TORCH <path>, THREADS_PER_QUEUE, INTRA_OP_PARALLELISM, INTER_OP_PARALLELISM and
 * MODEL_EXECUTION_TIMEOUT, accepted and not used here: the execution workers run the models.
 */
#include <string.h>
#include <strings.h>

#include "srio.h"

static char *BackendsPath = NULL;

/* Without the execution half (exec.c) nothing runs, so nothing is counted; exec.c defines these. */
__attribute__((weak)) int SRIO_ExecGetStats(RedisModuleString *key, SRIO_ExecStats *out) {
    memset(out, 0, sizeof(*out));
    return 0;
}

__attribute__((weak)) void SRIO_ExecResetStats(RedisModuleString *key) {}

/* AI.INFO key [RESETSTAT] */
static int Info(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc < 2 || argc > 3) return RedisModule_WrongArity(ctx);
    SRIO_Manifest m;
    if (SRIO_ManifestRead(ctx, argv[1], &m) != SRIO_OK) {
        return RedisModule_ReplyWithError(ctx, "ERR cannot find run info for key");
    }
    if (argc == 3 && !strcasecmp(RedisModule_StringPtrLen(argv[2], NULL), "RESETSTAT")) {
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

static int is(RedisModuleString *arg, const char *word) {
    return strcasecmp(RedisModule_StringPtrLen(arg, NULL), word) == 0;
}

static int set_positive(RedisModuleString *arg, long long *out) {
    long long v;
    if (RedisModule_StringToLongLong(arg, &v) != REDISMODULE_OK || v <= 0) return 0;
    *out = v;
    return 1;
}

static void set_backends_path(const char *path) {
    if (BackendsPath) RedisModule_Free(BackendsPath);
    size_t n = strlen(path);
    BackendsPath = RedisModule_Alloc(n + 1);
    memcpy(BackendsPath, path, n + 1);
}

/* 1 for TORCH (served by the workers), 0 for a backend this database does not serve, -1 unknown */
static int backend_served(RedisModuleString *arg) {
    if (is(arg, "TORCH")) return 1;
    if (is(arg, "TF") || is(arg, "TFLITE") || is(arg, "ONNX")) return 0;
    return -1;
}

static int Config(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc < 2) return RedisModule_WrongArity(ctx);
    if (is(argv[1], "LOADBACKEND")) {
        if (argc < 4) return RedisModule_WrongArity(ctx);
        int served = backend_served(argv[2]);
        if (served < 0) return RedisModule_ReplyWithError(ctx, "ERR unsupported backend");
        if (!served) {
            RedisModuleString *msg = RedisModule_CreateStringPrintf(
                ctx, "ERR backend %s is not served: this database runs TORCH models only (TorchScript or torch.export)",
                RedisModule_StringPtrLen(argv[2], NULL));
            RedisModule_ReplyWithError(ctx, RedisModule_StringPtrLen(msg, NULL));
            RedisModule_FreeString(ctx, msg);
            return REDISMODULE_OK;
        }
        return RedisModule_ReplyWithSimpleString(ctx, "OK"); /* the workers bring torch */
    }
    if (is(argv[1], "BACKENDSPATH")) {
        if (argc < 3) return RedisModule_ReplyWithError(ctx, "ERR BACKENDSPATH: missing path argument");
        set_backends_path(RedisModule_StringPtrLen(argv[2], NULL));
        return RedisModule_ReplyWithSimpleString(ctx, "OK");
    }
    if (is(argv[1], "MODEL_CHUNK_SIZE")) {
        if (argc < 3) return RedisModule_ReplyWithError(ctx, "ERR MODEL_CHUNK_SIZE: missing chunk size");
        if (!set_positive(argv[2], &SRIO_ModelChunkSize)) {
            return RedisModule_ReplyWithError(ctx, "ERR MODEL_CHUNK_SIZE: invalid chunk size");
        }
        return RedisModule_ReplyWithSimpleString(ctx, "OK");
    }
    if (is(argv[1], "GET")) {
        if (argc < 3) return RedisModule_WrongArity(ctx);
        if (is(argv[2], "BACKENDSPATH")) return RedisModule_ReplyWithCString(ctx, BackendsPath ? BackendsPath : "");
        if (is(argv[2], "MODEL_CHUNK_SIZE")) return RedisModule_ReplyWithLongLong(ctx, SRIO_ModelChunkSize);
        return RedisModule_ReplyWithNull(ctx);
    }
    return RedisModule_ReplyWithError(ctx, "ERR unsupported subcommand");
}

int SRIO_Configure(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc % 2) {
        RedisModule_Log(ctx, "warning", "smartredis_io module arguments come in pairs (NAME value), got %d", argc);
        return REDISMODULE_ERR;
    }
    for (int i = 0; i < argc; i += 2) {
        const char *name = RedisModule_StringPtrLen(argv[i], NULL);
        const char *value = RedisModule_StringPtrLen(argv[i + 1], NULL);
        long long n;
        int served = backend_served(argv[i]);
        if (is(argv[i], "MODEL_CHUNK_SIZE")) {
            if (!set_positive(argv[i + 1], &SRIO_ModelChunkSize)) goto bad;
        } else if (is(argv[i], "BULK_LIMIT_BYTES")) {
            if (!set_positive(argv[i + 1], &n) || n <= SRIO_HEADER_MAX_BYTES) goto bad;
            SRIO_BulkLimit = (uint64_t)n;
        } else if (is(argv[i], "BACKENDSPATH")) {
            set_backends_path(value);
        } else if (served == 1 || is(argv[i], "THREADS_PER_QUEUE") || is(argv[i], "INTRA_OP_PARALLELISM") ||
                   is(argv[i], "INTER_OP_PARALLELISM") || is(argv[i], "MODEL_EXECUTION_TIMEOUT")) {
            RedisModule_Log(ctx, "notice", "%s %s: accepted; the execution workers' own settings apply", name, value);
        } else if (served == 0) {
            RedisModule_Log(ctx, "warning", "backend %s is not served: models of this backend are refused", name);
        } else {
            RedisModule_Log(ctx, "warning", "unknown smartredis_io module argument %s", name);
            return REDISMODULE_ERR;
        }
        continue;
    bad:
        RedisModule_Log(ctx, "warning", "invalid value for smartredis_io module argument %s: %s", name, value);
        return REDISMODULE_ERR;
    }
    return REDISMODULE_OK;
}

int SRIO_RegisterAdminCommands(RedisModuleCtx *ctx) {
    if (SRIO_CreateKeyCommand(ctx, "ai.info", Info, "readonly", -2,
                              REDISMODULE_CMD_KEY_RO | REDISMODULE_CMD_KEY_ACCESS) == REDISMODULE_ERR) {
        return REDISMODULE_ERR;
    }
    /* no keys; the settings are the server's (RedisAI's AI.CONFIG is a write command without keys) */
    if (RedisModule_CreateCommand(ctx, "ai.config", Config, "write", 0, 0, 0) == REDISMODULE_ERR) return REDISMODULE_ERR;
    RedisModuleCommandInfo info = {.version = REDISMODULE_COMMAND_INFO_VERSION, .arity = -2};
    return RedisModule_SetCommandInfo(RedisModule_GetCommand(ctx, "ai.config"), &info);
}
