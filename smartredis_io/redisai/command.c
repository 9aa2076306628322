/* What every command of the module shares: registration with key specs, the caller's ACL, the
 * keyword matcher, the error style and the backend check. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "srio.h"

#define NAME_MAX_BYTES 200

int SRIO_Is(RedisModuleString *arg, const char *word) {
    size_t len;
    const char *s = RedisModule_StringPtrLen(arg, &len);
    return len == strlen(word) && strncasecmp(s, word, len) == 0;
}

char *SRIO_Format(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) n = 0;
    char *out = RedisModule_Alloc((size_t)n + 1);
    va_start(ap, fmt);
    vsnprintf(out, (size_t)n + 1, fmt, ap);
    va_end(ap);
    return out;
}

int SRIO_ReplyError(RedisModuleCtx *ctx, const char *fmt, ...) {
    char message[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(message, sizeof message, fmt, ap);
    va_end(ap);
    /* a reply is one line: names quoted in it may hold line breaks */
    for (char *c = message; *c; c++) {
        if (*c == '\r' || *c == '\n') *c = ' ';
    }
    RedisModule_ReplyWithError(ctx, message);
    return REDISMODULE_OK;
}

const char *SRIO_Name(RedisModuleString *s) {
    static char out[4][NAME_MAX_BYTES + 4]; /* a few names per message */
    static int next;
    size_t len;
    const char *p = RedisModule_StringPtrLen(s, &len);
    char *o = out[next++ % 4];
    size_t n = len < NAME_MAX_BYTES ? len : NAME_MAX_BYTES;
    for (size_t i = 0; i < n; i++) o[i] = p[i] ? p[i] : '?';
    strcpy(o + n, len > n ? "..." : "");
    return o;
}

int SRIO_BackendServed(RedisModuleString *arg) {
    if (SRIO_Is(arg, "TORCH")) return 1;
    if (SRIO_Is(arg, "TF") || SRIO_Is(arg, "TFLITE") || SRIO_Is(arg, "ONNX")) return 0;
    return -1;
}

int SRIO_CheckBackend(RedisModuleCtx *ctx, RedisModuleString *arg) {
    int served = SRIO_BackendServed(arg);
    if (served == 1) return 1;
    if (served == 0) {
        SRIO_ReplyError(ctx, "ERR backend %s is not served: this database runs TORCH models only (TorchScript or "
                             "torch.export)", SRIO_Name(arg));
    } else {
        SRIO_ReplyError(ctx, "ERR unsupported backend");
    }
    return 0;
}

int SRIO_CreateKeyCommand(RedisModuleCtx *ctx, const char *name, RedisModuleCmdFunc fn, const char *flags,
                          int arity, uint64_t key_flags) {
    if (RedisModule_CreateCommand(ctx, name, fn, flags, 1, 1, 1) == REDISMODULE_ERR) return REDISMODULE_ERR;
    RedisModuleCommand *command = RedisModule_GetCommand(ctx, name);
    if (command == NULL) return REDISMODULE_ERR;
    RedisModuleCommandKeySpec specs[] = {
        {.flags = key_flags,
         .begin_search_type = REDISMODULE_KSPEC_BS_INDEX,
         .bs.index.pos = 1,
         .find_keys_type = REDISMODULE_KSPEC_FK_RANGE,
         .fk.range = {.lastkey = 0, .keystep = 1, .limit = 0}},
        {0},
    };
    RedisModuleCommandInfo info = {
        .version = REDISMODULE_COMMAND_INFO_VERSION,
        .arity = arity,
        .key_specs = specs,
    };
    return RedisModule_SetCommandInfo(command, &info);
}

int SRIO_CreateCommand(RedisModuleCtx *ctx, const char *name, RedisModuleCmdFunc fn, const char *flags, int arity) {
    if (RedisModule_CreateCommand(ctx, name, fn, flags, 0, 0, 0) == REDISMODULE_ERR) return REDISMODULE_ERR;
    RedisModuleCommand *command = RedisModule_GetCommand(ctx, name);
    if (command == NULL) return REDISMODULE_ERR;
    RedisModuleCommandInfo info = {.version = REDISMODULE_COMMAND_INFO_VERSION, .arity = arity};
    return RedisModule_SetCommandInfo(command, &info);
}

int SRIO_UserMayAccess(RedisModuleCtx *ctx, RedisModuleString *keyname, int flags) {
    RedisModuleString *name = RedisModule_GetCurrentUserName(ctx);
    if (name == NULL) return 1; /* no client user: the server itself (AOF loading, replication) */
    RedisModuleUser *user = RedisModule_GetModuleUserFromUserName(name);
    RedisModule_FreeString(NULL, name);
    if (user == NULL) return 0;
    int ok = RedisModule_ACLCheckKeyPermissions(user, keyname, flags) == REDISMODULE_OK;
    RedisModule_FreeModuleUser(user);
    return ok;
}

int SRIO_ReplyReadError(RedisModuleCtx *ctx, int status, const char *what, char *err) {
    if (status == SRIO_EMPTY) {
        /* RedisAI's wording: SmartRedis clients show it as is */
        if (strcmp(what, "tensor") == 0) SRIO_ReplyError(ctx, "ERR tensor key is empty or in a different shard");
        else SRIO_ReplyError(ctx, "ERR %s key is empty", what);
    } else if (status == SRIO_CORRUPT && err) {
        SRIO_ReplyError(ctx, "ERR %s", err);
    } else {
        RedisModule_ReplyWithError(ctx, REDISMODULE_ERRORMSG_WRONGTYPE);
    }
    if (err) RedisModule_Free(err);
    return REDISMODULE_OK;
}
