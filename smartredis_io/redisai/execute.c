/* RedisAI's AI.MODELEXECUTE, AI.SCRIPTEXECUTE and AI.SCRIPTRUN: their arguments, checked as RedisAI
 * checks them, the caller's ACL on every key they name, then the request queued for a worker
 * (see exec.h).
 *
 * AI.MODELEXECUTE key INPUTS n input... OUTPUTS m output... [TIMEOUT ms]
 * AI.SCRIPTEXECUTE key function [KEYS n key...] [INPUTS n input...] [ARGS n arg...] [OUTPUTS m output...]
 *                  [TIMEOUT ms]
 * AI.SCRIPTRUN key function INPUTS input... [$ input...] OUTPUTS output... [TIMEOUT ms]
 */
#include <stdio.h>
#include <string.h>

#include "exec.h"

#define MAX_TIMEOUT_MS 1000000000000LL /* a TIMEOUT longer than this (31 years) is refused */

static long long next_id = 1;
static long long default_timeout_ms = 60000; /* SmartRedis's SR_MODEL_TIMEOUT; AI.SCRIPTRUN sends none */

static int is_dollar(RedisModuleString *word) {
    size_t len;
    const char *s = RedisModule_StringPtrLen(word, &len);
    return len == 1 && s[0] == '$';
}

typedef struct Parsed {
    int kind;
    RedisModuleString *key, *fn;
    RedisModuleString **inputs, **outputs, **keys, **args; /* pointers into argv */
    int ninputs, noutputs, nkeys, nargs, variadic;
    long long timeout_ms;
} Parsed;

/* `COUNT name...` at argv[*pos]: RedisAI's checks and messages. 0 or an error reply's text. */
static const char *parse_counted(RedisModuleString **argv, int argc, int *pos, int positive, RedisModuleString ***names,
                                 int *n, const char *count_error, const char *positive_error, const char *short_error) {
    long long count;
    if (*pos >= argc || RedisModule_StringToLongLong(argv[*pos], &count) != REDISMODULE_OK) return count_error;
    if (count < 0 || (positive && count == 0)) return positive_error;
    (*pos)++;
    if (count > argc - *pos) return short_error;
    *names = argv + *pos;
    *n = (int)count;
    *pos += (int)count;
    return NULL;
}

static const char *parse_timeout(RedisModuleString **argv, int argc, int *pos, long long *timeout_ms) {
    if (*pos >= argc) return "ERR No value provided for TIMEOUT";
    if (RedisModule_StringToLongLong(argv[*pos], timeout_ms) != REDISMODULE_OK || *timeout_ms <= 0 ||
        *timeout_ms > MAX_TIMEOUT_MS)
        return "ERR Invalid value for TIMEOUT";
    (*pos)++;
    return NULL;
}

/* AI.MODELEXECUTE key INPUTS n input... OUTPUTS m output... [TIMEOUT ms] */
static const char *parse_modelexecute(RedisModuleString **argv, int argc, Parsed *p) {
    if (argc < 8) return "ERR wrong number of arguments for 'AI.MODELEXECUTE' command";
    p->kind = KIND_MODEL;
    p->key = argv[1];
    int pos = 2;
    if (!SRIO_Is(argv[pos++], "INPUTS")) return "ERR INPUTS not specified";
    const char *error = parse_counted(argv, argc, &pos, 1, &p->inputs, &p->ninputs, "ERR Invalid argument for input_count",
                                      "ERR Input count must be a positive integer",
                                      "ERR number of input keys to AI.MODELEXECUTE command does not match the number of "
                                      "given arguments");
    if (error) return error;
    if (pos >= argc || !SRIO_Is(argv[pos++], "OUTPUTS")) return "ERR OUTPUTS not specified";
    error = parse_counted(argv, argc, &pos, 1, &p->outputs, &p->noutputs, "ERR Invalid argument for output_count",
                          "ERR Output count must be a positive integer",
                          "ERR number of output keys to AI.MODELEXECUTE command does not match the number of "
                          "given arguments");
    if (error) return error;
    if (pos < argc) {
        if (!SRIO_Is(argv[pos++], "TIMEOUT")) return "ERR Invalid argument after OUTPUTS (only TIMEOUT may follow)";
        if ((error = parse_timeout(argv, argc, &pos, &p->timeout_ms))) return error;
    }
    if (pos != argc) return "ERR Invalid argument after TIMEOUT";
    return NULL;
}

/* AI.SCRIPTEXECUTE's counted scopes, with RedisAI's messages */
static const struct {
    const char *word;
    int positive;      /* the count may not be 0 */
    const char *again, *count, *negative, *short_;
} SCOPES[] = {
    {"KEYS", 1, "ERR Already Encountered KEYS scope in AI.SCRIPTEXECUTE command",
     "ERR Invalid argument for keys count in AI.SCRIPTEXECUTE", "ERR Invalid or negative value found in number of KEYS",
     "ERR number of keys to AI.SCRIPTEXECUTE command does not match the number of given arguments"},
    {"INPUTS", 0, "ERR Already Encountered INPUTS scope in AI.SCRIPTEXECUTE command",
     "ERR Invalid argument for inputs count in AI.SCRIPTEXECUTE", "ERR Invalid argument for inputs count in AI.SCRIPTEXECUTE",
     "ERR number of inputs to AI.SCRIPTEXECUTE command does not match the number of given arguments"},
    {"ARGS", 0, "ERR Already Encountered ARGS scope in AI.SCRIPTEXECUTE command",
     "ERR Invalid argument for args count in AI.SCRIPTEXECUTE", "ERR Invalid argument for args count in AI.SCRIPTEXECUTE",
     "ERR number of args to AI.SCRIPTEXECUTE command does not match the number of given arguments"},
    {"OUTPUTS", 0, "ERR Already Encountered OUTPUTS scope in AI.SCRIPTEXECUTE command",
     "ERR Invalid argument for outputs count in AI.SCRIPTEXECUTE",
     "ERR Invalid argument for outputs count in AI.SCRIPTEXECUTE",
     "ERR number of outputs to AI.SCRIPTEXECUTE command does not match the number of given arguments"},
};

/* AI.SCRIPTEXECUTE key function [KEYS n key...] [INPUTS n input...] [ARGS n arg...] [OUTPUTS m output...] [TIMEOUT ms] */
static const char *parse_scriptexecute(RedisModuleString **argv, int argc, Parsed *p) {
    if (argc < 4) return "ERR wrong number of arguments for 'AI.SCRIPTEXECUTE' command";
    p->kind = KIND_SCRIPT_LISTS;
    p->key = argv[1];
    p->fn = argv[2];
    if (!SRIO_Is(argv[3], "KEYS") && !SRIO_Is(argv[3], "INPUTS"))
        return "ERR KEYS or INPUTS scope must be provided first for AI.SCRIPTEXECUTE command";
    RedisModuleString ***names[] = {&p->keys, &p->inputs, &p->args, &p->outputs};
    int *counts[] = {&p->nkeys, &p->ninputs, &p->nargs, &p->noutputs}, seen[4] = {0};
    int pos = 3;
    while (pos < argc) {
        RedisModuleString *word = argv[pos++];
        if (SRIO_Is(word, "TIMEOUT")) {
            const char *error = parse_timeout(argv, argc, &pos, &p->timeout_ms);
            if (error) return error;
            if (pos != argc) return "ERR Invalid AI.SCRIPTEXECUTE command: TIMEOUT must come last";
            break;
        }
        int scope = 0;
        while (scope < 4 && !SRIO_Is(word, SCOPES[scope].word)) scope++;
        if (scope == 4) return "ERR Invalid AI.SCRIPTEXECUTE command. Unexpected argument";
        if (seen[scope]++) return SCOPES[scope].again;
        const char *error = parse_counted(argv, argc, &pos, SCOPES[scope].positive, names[scope], counts[scope],
                                          SCOPES[scope].count, SCOPES[scope].negative, SCOPES[scope].short_);
        if (error) return error;
    }
    return NULL;
}

/* AI.SCRIPTRUN key function INPUTS input... [$ input...] OUTPUTS output... [TIMEOUT ms] (names, no counts) */
static const char *parse_scriptrun(RedisModuleString **argv, int argc, Parsed *p, RedisModuleString ***scratch) {
    if (argc < 3) return "ERR wrong number of arguments for 'AI.SCRIPTRUN' command";
    p->kind = KIND_SCRIPT;
    p->key = argv[1];
    p->fn = argv[2];
    *scratch = RedisModule_Alloc(sizeof **scratch * 2 * (argc + 1));
    p->inputs = *scratch;
    p->outputs = *scratch + argc + 1;
    int section = 0, inputs_done = 0, timeout_set = 0; /* section: 0 none, 1 inputs, 2 outputs */
    for (int pos = 3; pos < argc; pos++) {
        RedisModuleString *word = argv[pos];
        if (SRIO_Is(word, "TIMEOUT")) {
            if (timeout_set++) return "ERR Already encountered an TIMEOUT section in SCRIPTRUN";
            pos++;
            const char *error = parse_timeout(argv, argc, &pos, &p->timeout_ms);
            if (error) return error;
            pos--;
        } else if (SRIO_Is(word, "INPUTS")) {
            if (inputs_done) return "ERR Already encountered an INPUTS section in SCRIPTRUN";
            if (section == 1) return "ERR Already encountered an INPUTS keyword in SCRIPTRUN";
            section = 1;
        } else if (SRIO_Is(word, "OUTPUTS")) {
            if (section == 2) return "ERR Already encountered an OUTPUTS keyword in SCRIPTRUN";
            section = 2;
            inputs_done = 1;
        } else if (is_dollar(word)) {
            if (section != 1) return "ERR Encountered a variable size list of tensors outside of input section";
            if (p->variadic >= 0) return "ERR Already encountered a variable size list of tensors";
            p->variadic = p->ninputs;
        } else if (section == 1) {
            p->inputs[p->ninputs++] = word;
        } else if (section == 2) {
            p->outputs[p->noutputs++] = word;
        } else {
            return "ERR Unrecongnized parameter to SCRIPTRUN";
        }
    }
    return NULL;
}

static int check_keys(RedisModuleCtx *ctx, RedisModuleUser *user, RedisModuleString *name, RedisModuleString **keys,
                      int n, int flags, const char *what) {
    for (int i = 0; i < n; i++) {
        if (RedisModule_ACLCheckKeyPermissions(user, keys[i], flags) != REDISMODULE_OK) {
            SRIO_ReplyError(ctx, "NOPERM user '%s' has no permission to %s %s key '%s' (a run needs read on its model or "
                                 "script and inputs, write on its outputs)", SRIO_Name(name),
                            (flags & REDISMODULE_CMD_KEY_UPDATE) ? "write" : "read", what, SRIO_Name(keys[i]));
            return 0;
        }
    }
    return 1;
}

static RedisModuleString **hold_all(RedisModuleString **argv, int n) {
    if (n <= 0) return NULL;
    RedisModuleString **out = RedisModule_Alloc(sizeof *out * (size_t)n);
    for (int i = 0; i < n; i++) out[i] = SRIO_Hold(argv[i]);
    return out;
}

/* Whether the caller may run `p` (its ACL on every key); replies NOPERM and returns NULL if not.
 * The caller's user name otherwise, held by the request. */
static RedisModuleString *allowed_user(RedisModuleCtx *ctx, const Parsed *p, const char *what) {
    RedisModuleString *user_name = RedisModule_GetCurrentUserName(ctx);
    if (user_name == NULL) {
        /* a command always has a client; without one there is no user to run as */
        SRIO_ReplyError(ctx, "NOPERM no user is calling: runs are made on behalf of a client's user");
        return NULL;
    }
    RedisModuleUser *user = RedisModule_GetModuleUserFromUserName(user_name);
    if (user == NULL) {
        RedisModule_FreeString(NULL, user_name);
        SRIO_ReplyError(ctx, "NOPERM the calling user no longer exists");
        return NULL;
    }
    RedisModuleString *key = p->key;
    int allowed = check_keys(ctx, user, user_name, &key, 1, REDISMODULE_CMD_KEY_ACCESS, what) &&
                  check_keys(ctx, user, user_name, p->inputs, p->ninputs, REDISMODULE_CMD_KEY_ACCESS, "input") &&
                  check_keys(ctx, user, user_name, p->keys, p->nkeys, REDISMODULE_CMD_KEY_ACCESS, "KEYS") &&
                  check_keys(ctx, user, user_name, p->outputs, p->noutputs,
                             REDISMODULE_CMD_KEY_UPDATE | REDISMODULE_CMD_KEY_INSERT, "output");
    RedisModule_FreeModuleUser(user);
    if (!allowed) {
        RedisModule_FreeString(NULL, user_name);
        return NULL;
    }
    return user_name;
}

static int execute(RedisModuleCtx *ctx, RedisModuleString **argv, int argc, int command) {
    static const char *const names[] = {"AI.MODELEXECUTE", "AI.SCRIPTRUN", "AI.SCRIPTEXECUTE"};
    Parsed p = {.variadic = -1};
    RedisModuleString **scratch = NULL;
    const char *error = command == KIND_MODEL    ? parse_modelexecute(argv, argc, &p)
                        : command == KIND_SCRIPT ? parse_scriptrun(argv, argc, &p, &scratch)
                                                 : parse_scriptexecute(argv, argc, &p);
    if (error) {
        SRIO_ReplyError(ctx, "%s", error);
        goto done;
    }
    if (RedisModule_GetContextFlags(ctx) & REDISMODULE_CTX_FLAGS_DENY_BLOCKING) {
        SRIO_ReplyError(ctx, "ERR %s waits for an execution worker and cannot run inside MULTI, a Lua script or a "
                             "module call", names[command]);
        goto done;
    }
    const char *what = p.kind == KIND_MODEL ? "model" : "script";
    SRIO_Manifest m;
    int status = SRIO_ManifestRead(ctx, p.key, &m);
    if (status == SRIO_EMPTY) {
        SRIO_ReplyError(ctx, "ERR %s key is empty", what);
        goto done;
    }
    int batched = status == SRIO_OK && m.batch_size > 1;
    int right_kind = status == SRIO_OK && strcmp(m.kind, what) == 0;
    if (status == SRIO_OK) SRIO_ManifestFree(&m);
    if (!right_kind) {
        RedisModule_ReplyWithError(ctx, REDISMODULE_ERRORMSG_WRONGTYPE);
        goto done;
    }
    RedisModuleString *user_name = allowed_user(ctx, &p, what);
    if (user_name == NULL) goto done;
    if (SRIO_NoWorkerComing()) {
        RedisModule_FreeString(NULL, user_name);
        SRIO_ReplyError(ctx, "ERR no execution worker is registered on this server%s", SRIO_NoWorkerHint());
        goto done;
    }
    Request *r = RedisModule_Calloc(1, sizeof *r);
    r->id = next_id++;
    r->kind = p.kind;
    r->variadic = p.variadic;
    r->batched = p.kind == KIND_MODEL && batched;
    r->key = SRIO_Hold(p.key);
    r->fn = p.fn ? SRIO_Hold(p.fn) : NULL;
    r->user = user_name;
    r->inputs = hold_all(p.inputs, p.ninputs);
    r->outputs = hold_all(p.outputs, p.noutputs);
    r->keys = hold_all(p.keys, p.nkeys);
    r->args = hold_all(p.args, p.nargs);
    r->ninputs = p.ninputs;
    r->noutputs = p.noutputs;
    r->nkeys = p.nkeys;
    r->nargs = p.nargs;
    r->timeout_ms = p.timeout_ms > 0 ? p.timeout_ms : default_timeout_ms;
    if (SRIO_Config.execution_timeout_ms && r->timeout_ms > SRIO_Config.execution_timeout_ms) {
        r->timeout_ms = SRIO_Config.execution_timeout_ms;
    }
    r->deadline = SRIO_Now() + r->timeout_ms;
    SRIO_RequestBlock(ctx, r);
    SRIO_Dispatch(r, 0);
done:
    RedisModule_Free(scratch);
    return REDISMODULE_OK;
}

static int cmd_modelexecute(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    return execute(ctx, argv, argc, KIND_MODEL);
}

static int cmd_scriptrun(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    return execute(ctx, argv, argc, KIND_SCRIPT);
}

static int cmd_scriptexecute(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    return execute(ctx, argv, argc, KIND_SCRIPT_LISTS);
}

/* The model or script key is read (the legacy key range would ask for write access too). Inputs
 * and outputs are checked here against the caller's ACL; they are not declared, so that in a
 * cluster they may live on other shards (the worker reads and writes those itself). */
int SRIO_RegisterExecuteCommands(RedisModuleCtx *ctx) {
    const uint64_t read = REDISMODULE_CMD_KEY_RO | REDISMODULE_CMD_KEY_ACCESS;
    if (SRIO_CreateKeyCommand(ctx, "ai.modelexecute", cmd_modelexecute, "write deny-oom", -3, read) != REDISMODULE_OK ||
        SRIO_CreateKeyCommand(ctx, "ai.scriptexecute", cmd_scriptexecute, "write deny-oom", -3, read) != REDISMODULE_OK ||
        SRIO_CreateKeyCommand(ctx, "ai.scriptrun", cmd_scriptrun, "write deny-oom", -3, read) != REDISMODULE_OK) {
        return REDISMODULE_ERR;
    }
    return REDISMODULE_OK;
}
