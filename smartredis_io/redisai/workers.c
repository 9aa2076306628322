/* The worker commands (SRIO.*), the guard in front of them, and the registry of workers.
 *
 * SRIO.HELLO secret                      prove a connection is a worker's (the module's worker secret)
 * SRIO.POP worker block-ms               the next request, waiting up to block-ms (0: not at all)
 * SRIO.TAKE worker model max min wait-ms up to max queued requests for model, waiting for min
 * SRIO.REPLY worker id duration-us samples calls OK [key value]... | ERROR message
 * SRIO.RETURN worker id                  hand back a request taken but not run
 * SRIO.PAUSE worker                      answer the worker's waiting pops here with nil
 * SRIO.HEARTBEAT worker pid              register the worker, or keep it registered
 * SRIO.UNREGISTER worker                 leave; requests it holds go back to the queue
 * SRIO.WORKERS                           [name, pid, running, waiting, ms since seen] per worker
 *
 * Every command but SRIO.HELLO answers NOPERM on a connection that has not said SRIO.HELLO with the
 * secret, whatever the server's ACLs: on a plain redis-server every client is the default user,
 * which may run anything, and the worker protocol hands out other users' requests and stores their
 * outputs. The syntax is in docs/smartredis.md.
 */
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "exec.h"

#define WORKER_CONNECTIONS 8 /* a worker's connections to one server: pops, pauses, heartbeats */
#define HEAD_BYTES 296       /* smartredis_io._client.wire.HEADER_MAX_BYTES: a replaced value's header */
#define NOT_A_WORKER \
    "NOPERM this command is for smartredis_io execution workers (a worker first says SRIO.HELLO with the module's " \
    "worker secret)"

typedef struct Worker {
    RedisModuleString *name;
    long long pid;
    long long beat; /* last sign of life, SRIO_Now() */
    unsigned long long connections[WORKER_CONNECTIONS]; /* client ids it spoke on (the latest ones) */
    int nconnections;
    int serving; /* it has asked for requests (it registers with its first heartbeat, before that) */
} Worker;

static RedisModuleDict *workers;  /* name -> Worker */
static RedisModuleDict *inflight; /* request id -> Request, AT_WORKER */
static RedisModuleDict *greeted;  /* client id -> (void *)1: connections that said SRIO.HELLO */
static long long starting_until;  /* requests wait for a worker to register until then */
static unsigned long long serving; /* registered workers that have asked for requests */
static long long serving_since;    /* when `serving` last rose from 0 */

/* ---- the guard ----------------------------------------------------------------------------- */

static int is_worker_connection(RedisModuleCtx *ctx) {
    unsigned long long id = RedisModule_GetClientId(ctx);
    return id && RedisModule_DictGetC(greeted, &id, sizeof id, NULL) != NULL;
}

/* Constant-time comparison: how long it takes says nothing of how much of the secret matched. */
static int secret_matches(RedisModuleString *given) {
    size_t len;
    const unsigned char *p = (const unsigned char *)RedisModule_StringPtrLen(given, &len);
    unsigned char diff = len != SRIO_Config.secret_len;
    for (size_t i = 0; i < SRIO_Config.secret_len; i++) diff |= (unsigned char)(SRIO_Config.secret[i] ^ (i < len ? p[i] : 0));
    return diff == 0;
}

/* ---- failed SRIO.HELLOs: answered late, and logged a few times a minute ------------------- */

#define HELLO_DELAY_MIN_MS 100     /* a failed SRIO.HELLO is answered after this, */
#define HELLO_DELAY_MAX_MS 5000    /* doubling with each failure of the window, up to this */
#define HELLO_WINDOW_MS 10000      /* failures are counted, and logged, per window */

static long long hello_window_start, hello_window_failures, hello_failures_total, hello_logged;
static char hello_latest[96];      /* the address of the latest failure */
static int hello_log_pending;

static void client_address(RedisModuleCtx *ctx, char *out, size_t size) {
    RedisModuleClientInfo ci = REDISMODULE_CLIENTINFO_INITIALIZER_V1;
    unsigned long long id = RedisModule_GetClientId(ctx);
    if (RedisModule_GetClientInfoById(&ci, id) != REDISMODULE_OK) snprintf(out, size, "client id %llu", id);
    else if (ci.flags & REDISMODULE_CLIENTINFO_FLAG_UNIXSOCKET) snprintf(out, size, "the unix socket (client id %llu)", id);
    else snprintf(out, size, "%.46s:%u (client id %llu)", ci.addr, (unsigned)ci.port, id);
}

static void hello_log(RedisModuleCtx *ctx, void *data) {
    (void)data;
    hello_log_pending = 0;
    long long n = hello_failures_total - hello_logged;
    if (n <= 0) return;
    hello_logged = hello_failures_total;
    RedisModule_Log(ctx, "warning", "%lld SRIO.HELLO with a wrong worker secret, the latest from %s: a client that is "
                    "no worker of this module tried to become one (answers are delayed up to %d ms)", n, hello_latest,
                    HELLO_DELAY_MAX_MS);
}

/* Count a failure; the delay of its answer. The first failure of a window is logged at once, the
 * others at the window's end, together. */
static long long hello_failed(RedisModuleCtx *ctx) {
    long long now = SRIO_Now();
    if (now - hello_window_start >= HELLO_WINDOW_MS) {
        hello_window_start = now;
        hello_window_failures = 0;
    }
    hello_failures_total++;
    client_address(ctx, hello_latest, sizeof hello_latest);
    if (hello_window_failures == 0) {
        hello_log(ctx, NULL);
    } else if (!hello_log_pending) {
        hello_log_pending = 1;
        RedisModule_CreateTimer(ctx, hello_window_start + HELLO_WINDOW_MS - now, hello_log, NULL);
    }
    long long shift = hello_window_failures < 6 ? hello_window_failures : 6;
    hello_window_failures++;
    long long delay = (long long)HELLO_DELAY_MIN_MS << shift;
    return delay < HELLO_DELAY_MAX_MS ? delay : HELLO_DELAY_MAX_MS;
}

static int hello_refused(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    (void)argv;
    (void)argc;
    return RedisModule_ReplyWithError(ctx, "NOPERM wrong worker secret");
}

static int cmd_hello(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc != 2) return RedisModule_WrongArity(ctx);
    /* a failed one is answered late: inside MULTI nothing can wait, so none is taken there */
    if (RedisModule_GetContextFlags(ctx) & REDISMODULE_CTX_FLAGS_DENY_BLOCKING)
        return SRIO_ReplyError(ctx, "ERR SRIO.HELLO cannot run inside MULTI");
    unsigned long long id = RedisModule_GetClientId(ctx);
    if (id == 0) return SRIO_ReplyError(ctx, "NOPERM SRIO.HELLO needs a client connection");
    if (!secret_matches(argv[1])) {
        RedisModule_BlockClient(ctx, NULL, hello_refused, NULL, hello_failed(ctx));
        return REDISMODULE_OK;
    }
    RedisModule_DictReplaceC(greeted, &id, sizeof id, (void *)1);
    return RedisModule_ReplyWithSimpleString(ctx, "OK");
}

/* ---- the registry -------------------------------------------------------------------------- */

unsigned long long SRIO_WorkerCount(void) { return workers ? RedisModule_DictSize(workers) : 0; }

unsigned long long SRIO_ServingCount(void) { return serving; }

long long SRIO_ServingSince(void) { return serving_since; }

/* The worker `w` asks for requests: from the first one that does, queued requests count QUEUE_TIMEOUT. */
static void now_serving(Worker *w) {
    if (w->serving) return;
    w->serving = 1;
    if (serving++ == 0) serving_since = SRIO_Now();
}

int SRIO_NoWorkerComing(void) {
    if (SRIO_WorkerCount()) return 0;
    if (SRIO_SpawnFailed()) return 1;
    return !SRIO_SpawnStarting() && SRIO_Now() >= starting_until;
}

/* Requests wait up to SRIO_Config.startup_ms for the replacement of a worker that died. */
static void replacement_window(void) {
    long long until = SRIO_Now() + SRIO_Config.startup_ms;
    if (until > starting_until) starting_until = until;
}

const char *SRIO_NoWorkerHint(void) {
    static char hint[ERROR_MAX + 128];
    const char *error = SRIO_SpawnError();
    if (SRIO_SpawnFailed()) {
        snprintf(hint, sizeof hint, ": the module's workers cannot start: %s", error);
    } else if (*error) {
        snprintf(hint, sizeof hint, ": the module starts none: %s", error);
    } else if (SRIO_Config.workers == 0) {
        snprintf(hint, sizeof hint, ": load the module with WORKERS n, or start workers with `python -m "
                 "smartredis_io.worker --address HOST:PORT --secret-file FILE` (the module's WORKER_SECRET_FILE)");
    } else {
        snprintf(hint, sizeof hint, ": no worker replaced the last one within %lld s (WORKER_STARTUP_MS; the workers' "
                 "log is the server's)", SRIO_Config.startup_ms / 1000);
    }
    return hint;
}

void SRIO_InflightAdd(Request *r) { RedisModule_DictSetC(inflight, &r->id, sizeof r->id, r); }

static Worker *touch_worker(RedisModuleCtx *ctx, RedisModuleString *name, long long pid) {
    size_t len;
    const char *key = RedisModule_StringPtrLen(name, &len);
    Worker *w = RedisModule_DictGetC(workers, (void *)key, len, NULL);
    if (w == NULL) {
        w = RedisModule_Calloc(1, sizeof *w);
        w->name = SRIO_Hold(name);
        RedisModule_DictSetC(workers, (void *)key, len, w);
    }
    if (pid > 0 && w->pid != pid) SRIO_SpawnWorkerSeen(pid);
    if (pid >= 0) w->pid = pid;
    w->beat = SRIO_Now();
    unsigned long long id = RedisModule_GetClientId(ctx);
    int known = 0;
    for (int i = 0; i < w->nconnections; i++) known |= w->connections[i] == id;
    if (!known) {
        if (w->nconnections == WORKER_CONNECTIONS) {
            memmove(w->connections, w->connections + 1, sizeof w->connections[0] * (WORKER_CONNECTIONS - 1));
            w->nconnections--;
        }
        w->connections[w->nconnections++] = id;
    }
    return w;
}

/* Forget the worker `name`; when it died (it did not unregister) and was the last one, requests
 * wait the start-up window for its replacement. */
static void forget_worker(RedisModuleString *name, int died) {
    size_t len;
    const char *key = RedisModule_StringPtrLen(name, &len);
    Worker *w = NULL;
    RedisModule_DictDelC(workers, (void *)key, len, &w);
    if (w) {
        if (w->serving) serving--;
        RedisModule_FreeString(NULL, w->name);
        RedisModule_Free(w);
        if (died && SRIO_WorkerCount() == 0) replacement_window();
    }
}

/* Take out of flight every request matching (owner, name); either may be 0 / NULL for any. */
static long long take_inflight(unsigned long long owner, RedisModuleString *name, Request ***out) {
    long long n = 0, cap = (long long)RedisModule_DictSize(inflight);
    *out = NULL;
    if (cap == 0) return 0;
    *out = RedisModule_Alloc(sizeof **out * (size_t)cap);
    RedisModuleDictIter *it = RedisModule_DictIteratorStartC(inflight, "^", NULL, 0);
    Request *r;
    while (RedisModule_DictNextC(it, NULL, (void **)&r)) {
        if ((owner && r->owner != owner) || (name && RedisModule_StringCompare(r->worker, name) != 0)) continue;
        (*out)[n++] = r;
    }
    RedisModule_DictIteratorStop(it);
    for (long long i = 0; i < n; i++) RedisModule_DictDelC(inflight, &(*out)[i]->id, sizeof(long long), NULL);
    return n;
}

/* The worker `id` was a connection of, when it closes: that worker is unregistered (a live one
 * registers again with its next command). */
static void forget_connection(unsigned long long id) {
    RedisModuleString *gone = NULL;
    RedisModuleDictIter *it = RedisModule_DictIteratorStartC(workers, "^", NULL, 0);
    Worker *w;
    while (!gone && RedisModule_DictNextC(it, NULL, (void **)&w)) {
        for (int i = 0; i < w->nconnections; i++)
            if (w->connections[i] == id) gone = SRIO_Hold(w->name);
    }
    RedisModule_DictIteratorStop(it);
    if (gone == NULL) return;
    SRIO_UnclaimAll(gone);
    forget_worker(gone, 1);
    RedisModule_FreeString(NULL, gone);
}

static void client_change(RedisModuleCtx *ctx, RedisModuleEvent event, uint64_t subevent, void *data) {
    (void)event;
    if (subevent != REDISMODULE_SUBEVENT_CLIENT_CHANGE_DISCONNECTED) return;
    RedisModuleClientInfo *info = data;
    unsigned long long id = info->id;
    RedisModule_DictDelC(greeted, &id, sizeof id, NULL);
    if (RedisModule_DictSize(workers)) forget_connection(id);
    if (RedisModule_DictSize(inflight) == 0) return;
    Request **gone;
    long long n = take_inflight(id, NULL, &gone);
    for (long long i = 0; i < n; i++) {
        RedisModule_Log(ctx, "warning", "the worker %s disconnected while running %s %s: run again or failed",
                        SRIO_Name(gone[i]->worker), SRIO_KindWords[gone[i]->kind], SRIO_Name(gone[i]->key));
        SRIO_Unclaim(gone[i]->key, gone[i]->worker);
        SRIO_Requeue(gone[i], 1, "died");
    }
    RedisModule_Free(gone);
}

/* Silent workers are dead; requests no worker can take are answered. */
static void reap(RedisModuleCtx *ctx, void *data) {
    (void)data;
    long long now = SRIO_Now();
    RedisModuleString **silent = NULL;
    long long nsilent = 0, cap = 0;
    RedisModuleDictIter *it = RedisModule_DictIteratorStartC(workers, "^", NULL, 0);
    Worker *w;
    while (RedisModule_DictNextC(it, NULL, (void **)&w)) {
        if (now - w->beat <= HEARTBEAT_TTL_MS) continue;
        if (nsilent == cap) {
            cap = cap ? 2 * cap : 8;
            silent = RedisModule_Realloc(silent, sizeof *silent * (size_t)cap);
        }
        silent[nsilent++] = SRIO_Hold(w->name);
    }
    RedisModule_DictIteratorStop(it);
    for (long long i = 0; i < nsilent; i++) {
        RedisModule_Log(ctx, "warning", "the worker %s sent no heartbeat for %d ms: unregistered", SRIO_Name(silent[i]),
                        HEARTBEAT_TTL_MS);
        SRIO_ReleaseWaitersOf(silent[i]);
        SRIO_UnclaimAll(silent[i]);
        Request **gone;
        long long n = take_inflight(0, silent[i], &gone);
        for (long long j = 0; j < n; j++) SRIO_Requeue(gone[j], 1, "stopped sending heartbeats");
        RedisModule_Free(gone);
        forget_worker(silent[i], 1);
        RedisModule_FreeString(NULL, silent[i]);
    }
    RedisModule_Free(silent);
    SRIO_QueueExpire();
    RedisModule_CreateTimer(ctx, REAP_INTERVAL_MS, reap, NULL);
}

/* ---- worker commands ----------------------------------------------------------------------- */

/* An integer argument of at least `min`, as `max` when larger (a batch size or wait a user stored
 * in a model reaches the worker commands: it is bounded, not refused); otherwise replies with the
 * error and returns 0. */
static int parse_count(RedisModuleCtx *ctx, RedisModuleString *arg, long long min, long long max, long long *out,
                       const char *what) {
    if (RedisModule_StringToLongLong(arg, out) != REDISMODULE_OK || *out < min) {
        SRIO_ReplyError(ctx, "ERR %s must be an integer of at least %lld", what, min);
        return 0;
    }
    if (*out > max) *out = max;
    return 1;
}

/* The guard and the arity of a worker command: 1 when the command may go on, else replied. */
static int admitted(RedisModuleCtx *ctx, int argc, int min_argc, int max_argc) {
    if (!is_worker_connection(ctx)) {
        RedisModule_ReplyWithError(ctx, NOT_A_WORKER);
        return 0;
    }
    if (argc < min_argc || (max_argc && argc > max_argc)) {
        RedisModule_WrongArity(ctx);
        return 0;
    }
    return 1;
}

static int deny_blocking(RedisModuleCtx *ctx) {
    return (RedisModule_GetContextFlags(ctx) & REDISMODULE_CTX_FLAGS_DENY_BLOCKING) != 0;
}

static int cmd_pop(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (!admitted(ctx, argc, 3, 3)) return REDISMODULE_OK;
    long long block_ms;
    if (!parse_count(ctx, argv[2], 0, MAX_WAIT_MS, &block_ms, "block-ms")) return REDISMODULE_OK;
    now_serving(touch_worker(ctx, argv[1], -1));
    Request *r = SRIO_QueueHead();
    for (long long scanned = 0; r && SRIO_Claimed(r) && scanned < BATCH_SCAN_LIMIT; scanned++) r = r->next;
    if (r && !SRIO_Claimed(r)) {
        SRIO_QueueUnlink(r);
        SRIO_Deliver(r, argv[1], RedisModule_GetClientId(ctx));
        SRIO_Claim(r, argv[1]);
        SRIO_ReplyRequest(ctx, r, 1);
        return REDISMODULE_OK;
    }
    if (block_ms == 0 || deny_blocking(ctx)) return RedisModule_ReplyWithNull(ctx);
    SRIO_WaiterBlock(ctx, SRIO_WaiterNew(argv[1], 0, NULL, 1, 1), block_ms, -1);
    return REDISMODULE_OK;
}

static int cmd_take(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (!admitted(ctx, argc, 6, 6)) return REDISMODULE_OK;
    long long max, min, wait_ms;
    if (!parse_count(ctx, argv[3], 1, MAX_TAKE, &max, "max") || !parse_count(ctx, argv[4], 0, MAX_TAKE, &min, "min") ||
        !parse_count(ctx, argv[5], 0, MAX_WAIT_MS, &wait_ms, "wait-ms"))
        return REDISMODULE_OK;
    now_serving(touch_worker(ctx, argv[1], -1));
    Waiter *w = SRIO_WaiterNew(argv[1], 1, argv[2], max, min);
    long long scanned = 0;
    for (Request *r = SRIO_QueueHead(); r && w->ngot < max && scanned < BATCH_SCAN_LIMIT; scanned++) {
        Request *next = r->next;
        if (r->kind == KIND_MODEL && RedisModule_StringCompare(r->key, w->key) == 0) {
            SRIO_QueueUnlink(r);
            SRIO_WaiterAdd(w, r);
        }
        r = next;
    }
    if (w->ngot >= min || w->ngot >= max || wait_ms == 0 || deny_blocking(ctx)) {
        SRIO_WaiterAnswerNow(ctx, w);
        return REDISMODULE_OK;
    }
    SRIO_WaiterBlock(ctx, w, wait_ms + 1000, wait_ms);
    return REDISMODULE_OK;
}

static Request *inflight_of(RedisModuleString *worker, RedisModuleString *id_arg) {
    long long id;
    if (RedisModule_StringToLongLong(id_arg, &id) != REDISMODULE_OK) return NULL;
    Request *r = RedisModule_DictGetC(inflight, &id, sizeof id, NULL);
    if (r == NULL || RedisModule_StringCompare(r->worker, worker) != 0) return NULL;
    return r;
}

static void end_flight(Request *r) { RedisModule_DictDelC(inflight, &r->id, sizeof r->id, NULL); }

/* Whether the value at `name` is a stored model or script (a manifest, or any module type). */
static int holds_model(RedisModuleCtx *ctx, RedisModuleString *name) {
    RedisModuleKey *key = RedisModule_OpenKey(ctx, name, REDISMODULE_READ);
    int found = RedisModule_KeyType(key) == REDISMODULE_KEYTYPE_MODULE || SRIO_KeyHoldsManifest(key);
    RedisModule_CloseKey(key);
    return found;
}

static int is_output_of(Request *r, RedisModuleString *key) {
    for (int i = 0; i < r->noutputs; i++)
        if (RedisModule_StringCompare(r->outputs[i], key) == 0) return 1;
    return 0;
}

static void add_count(long long *total, long long n) { *total = n > LLONG_MAX - *total ? LLONG_MAX : *total + n; }

/* Refuse outputs that are not the request's, or would replace a model or script: the caller gets
 * the error, nothing is written. 1 when every output may be stored. */
static int outputs_allowed(RedisModuleCtx *ctx, Request *r, RedisModuleString **pairs, int n) {
    for (int i = 0; i < n; i++) {
        RedisModuleString *key = pairs[2 * i];
        char message[ERROR_MAX];
        if (!is_output_of(r, key)) {
            snprintf(message, sizeof message, "ERR the worker replied with key '%s', which is not an output of the "
                     "request", SRIO_Name(key));
        } else if (holds_model(ctx, key)) {
            snprintf(message, sizeof message, "ERR output key '%s' holds a model or script; a run does not replace it",
                     SRIO_Name(key));
        } else {
            continue;
        }
        SRIO_Answer(r, message, strlen(message));
        SRIO_ReplyError(ctx, "%s", message);
        return 0;
    }
    return 1;
}

/* Stores the outputs and answers the caller in one step. Replies the first HEAD_BYTES of what each
 * output held (nil: nothing), or nil when the request no longer waits (nothing is written). */
static int cmd_reply(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (!admitted(ctx, argc, 7, 0)) return REDISMODULE_OK;
    long long duration, samples, calls;
    if (!parse_count(ctx, argv[3], 0, LLONG_MAX, &duration, "duration-us") ||
        !parse_count(ctx, argv[4], 0, LLONG_MAX, &samples, "samples") ||
        !parse_count(ctx, argv[5], 0, LLONG_MAX, &calls, "calls"))
        return REDISMODULE_OK;
    int ok = SRIO_Is(argv[6], "OK");
    if (!ok && !(SRIO_Is(argv[6], "ERROR") && argc == 8)) return SRIO_ReplyError(ctx, "ERR syntax: OK [key value]... or ERROR message");
    if (ok && (argc - 7) % 2) return SRIO_ReplyError(ctx, "ERR OK takes key value pairs");
    Request *r = inflight_of(argv[1], argv[2]);
    touch_worker(ctx, argv[1], -1);
    if (r == NULL) return RedisModule_ReplyWithNull(ctx);
    SRIO_Unclaim(r->key, argv[1]); /* answered without gathering a batch (or after it) */
    if (calls) {
        SRIO_ExecStats *s = SRIO_StatsOf(r->key, 1);
        add_count(&s->duration_us, duration);
        add_count(&s->samples, samples);
        add_count(&s->calls, calls);
    }
    end_flight(r);
    if (r->bc == NULL) {
        SRIO_RequestFree(r);
        return RedisModule_ReplyWithNull(ctx);
    }
    if (!ok) {
        size_t len;
        const char *message = RedisModule_StringPtrLen(argv[7], &len);
        SRIO_Answer(r, message, len);
        SRIO_RequestFree(r);
        return RedisModule_ReplyWithSimpleString(ctx, "OK");
    }
    int n = (argc - 7) / 2;
    if (!outputs_allowed(ctx, r, argv + 7, n)) {
        SRIO_RequestFree(r);
        return REDISMODULE_OK;
    }
    RedisModule_ReplyWithArray(ctx, n);
    for (int i = 0; i < n; i++) {
        RedisModuleString *key = argv[7 + 2 * i];
        RedisModuleKey *old = RedisModule_OpenKey(ctx, key, REDISMODULE_READ);
        size_t len;
        const char *value = RedisModule_KeyType(old) == REDISMODULE_KEYTYPE_STRING
                                ? RedisModule_StringDMA(old, &len, REDISMODULE_READ) : NULL;
        if (value) RedisModule_ReplyWithStringBuffer(ctx, value, len < HEAD_BYTES ? len : HEAD_BYTES);
        else RedisModule_ReplyWithNull(ctx);
        RedisModule_CloseKey(old);
        RedisModuleCallReply *set = RedisModule_Call(ctx, "SET", "!ss", key, argv[8 + 2 * i]);
        int stored = set && RedisModule_CallReplyType(set) != REDISMODULE_REPLY_ERROR;
        if (!stored) {
            /* the caller learns why; what was stored before this output stays */
            size_t elen = 0;
            const char *why = set ? RedisModule_CallReplyStringPtr(set, &elen) : NULL;
            SRIO_Answerf(r, "ERR output key '%s' could not be stored: %.*s", SRIO_Name(key), (int)(elen < 200 ? elen : 200),
                         why ? why : "the server refused it");
        }
        if (set) RedisModule_FreeCallReply(set);
        if (!stored) {
            for (int j = i + 1; j < n; j++) RedisModule_ReplyWithNull(ctx);
            SRIO_RequestFree(r);
            return REDISMODULE_OK;
        }
    }
    SRIO_Answer(r, NULL, 0);
    SRIO_RequestFree(r);
    return REDISMODULE_OK;
}

static int cmd_return(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (!admitted(ctx, argc, 3, 3)) return REDISMODULE_OK;
    Request *r = inflight_of(argv[1], argv[2]);
    if (r == NULL) return RedisModule_ReplyWithNull(ctx);
    end_flight(r);
    SRIO_Requeue(r, 0, "returned it");
    return RedisModule_ReplyWithSimpleString(ctx, "OK");
}

static int cmd_pause(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (!admitted(ctx, argc, 2, 2)) return REDISMODULE_OK;
    return RedisModule_ReplyWithLongLong(ctx, SRIO_ReleaseWaitersOf(argv[1]));
}

static int cmd_heartbeat(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (!admitted(ctx, argc, 3, 3)) return REDISMODULE_OK;
    long long pid;
    if (!parse_count(ctx, argv[2], 0, LLONG_MAX, &pid, "pid")) return REDISMODULE_OK;
    touch_worker(ctx, argv[1], pid);
    return RedisModule_ReplyWithSimpleString(ctx, "OK");
}

static int cmd_unregister(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (!admitted(ctx, argc, 2, 2)) return REDISMODULE_OK;
    SRIO_ReleaseWaitersOf(argv[1]);
    SRIO_UnclaimAll(argv[1]);
    Request **held;
    long long n = take_inflight(0, argv[1], &held);
    for (long long i = n - 1; i >= 0; i--) SRIO_Requeue(held[i], 0, "stopped");
    RedisModule_Free(held);
    forget_worker(argv[1], 0);
    return RedisModule_ReplyWithLongLong(ctx, n);
}

static int cmd_workers(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    (void)argv;
    if (!admitted(ctx, argc, 1, 1)) return REDISMODULE_OK;
    long long now = SRIO_Now();
    RedisModule_ReplyWithArray(ctx, (long)RedisModule_DictSize(workers));
    RedisModuleDictIter *it = RedisModule_DictIteratorStartC(workers, "^", NULL, 0);
    Worker *w;
    while (RedisModule_DictNextC(it, NULL, (void **)&w)) {
        long long busy = 0;
        RedisModuleDictIter *requests = RedisModule_DictIteratorStartC(inflight, "^", NULL, 0);
        Request *r;
        while (RedisModule_DictNextC(requests, NULL, (void **)&r))
            if (RedisModule_StringCompare(r->worker, w->name) == 0) busy++;
        RedisModule_DictIteratorStop(requests);
        RedisModule_ReplyWithArray(ctx, 5);
        RedisModule_ReplyWithString(ctx, w->name);
        RedisModule_ReplyWithLongLong(ctx, w->pid);
        RedisModule_ReplyWithLongLong(ctx, busy);
        RedisModule_ReplyWithLongLong(ctx, SRIO_IsWaiting(w->name));
        RedisModule_ReplyWithLongLong(ctx, now - w->beat);
    }
    RedisModule_DictIteratorStop(it);
    return REDISMODULE_OK;
}

/* A text as an INFO field's value: one line, without commas (clients such as redis-py read a value
 * with commas as a list, or with equals signs too as key=value pairs): they become semicolons. */
static char *info_text(const char *text) {
    static char out[ERROR_MAX];
    snprintf(out, sizeof out, "%s", text);
    for (char *c = out; *c; c++) {
        if ((unsigned char)*c < 0x20 || *c == 0x7f) *c = ' ';
        else if (*c == ',') *c = ';';
    }
    return out;
}

/* INFO srio: what an operator (or a test) sees without the worker secret. */
static void info(RedisModuleInfoCtx *ctx, int for_crash_report) {
    (void)for_crash_report;
    RedisModule_InfoAddSection(ctx, "");
    RedisModule_InfoAddFieldULongLong(ctx, "workers", SRIO_WorkerCount());
    RedisModule_InfoAddFieldLongLong(ctx, "supervisor_pid", SRIO_SupervisorPid());
    RedisModule_InfoAddFieldLongLong(ctx, "queued", SRIO_QueueLength());
    RedisModule_InfoAddFieldULongLong(ctx, "running", RedisModule_DictSize(inflight));
    RedisModule_InfoAddFieldCString(ctx, "worker_start", SRIO_SpawnState());
    RedisModule_InfoAddFieldCString(ctx, "worker_start_error", info_text(SRIO_SpawnError()));
    RedisModule_InfoAddFieldCString(ctx, "worker_python", info_text(SRIO_SpawnPython()));
    RedisModule_InfoAddFieldLongLong(ctx, "failed_hellos", hello_failures_total);
}

int SRIO_RegisterWorkerCommands(RedisModuleCtx *ctx) {
    workers = RedisModule_CreateDict(NULL);
    inflight = RedisModule_CreateDict(NULL);
    greeted = RedisModule_CreateDict(NULL);
    /* no keys; never in a script (a script's connection is shared by every caller); the secret is
     * kept out of MONITOR and the slow log */
    if (SRIO_CreateCommand(ctx, "srio.hello", cmd_hello, "fast deny-script no-monitor no-slowlog", -1) != REDISMODULE_OK ||
        SRIO_CreateCommand(ctx, "srio.pop", cmd_pop, "write deny-script", -1) != REDISMODULE_OK ||
        SRIO_CreateCommand(ctx, "srio.take", cmd_take, "write deny-script", -1) != REDISMODULE_OK ||
        SRIO_CreateCommand(ctx, "srio.reply", cmd_reply, "write deny-script", -1) != REDISMODULE_OK ||
        SRIO_CreateCommand(ctx, "srio.return", cmd_return, "write fast deny-script", -1) != REDISMODULE_OK ||
        SRIO_CreateCommand(ctx, "srio.pause", cmd_pause, "write fast deny-script", -1) != REDISMODULE_OK ||
        SRIO_CreateCommand(ctx, "srio.heartbeat", cmd_heartbeat, "write fast deny-script", -1) != REDISMODULE_OK ||
        SRIO_CreateCommand(ctx, "srio.unregister", cmd_unregister, "write deny-script", -1) != REDISMODULE_OK ||
        SRIO_CreateCommand(ctx, "srio.workers", cmd_workers, "readonly deny-script", -1) != REDISMODULE_OK)
        return REDISMODULE_ERR;
    if (RedisModule_SubscribeToServerEvent(ctx, RedisModuleEvent_ClientChange, client_change) != REDISMODULE_OK)
        return REDISMODULE_ERR;
    if (RedisModule_RegisterInfoFunc(ctx, info) != REDISMODULE_OK) return REDISMODULE_ERR;
    RedisModule_CreateTimer(ctx, REAP_INTERVAL_MS, reap, NULL);
    return REDISMODULE_OK;
}

int SRIO_ExecRegister(RedisModuleCtx *ctx) {
    SRIO_QueueInit();
    SRIO_DispatchInit();
    SRIO_ClaimsInit();
    if (SRIO_RegisterExecuteCommands(ctx) != REDISMODULE_OK || SRIO_RegisterWorkerCommands(ctx) != REDISMODULE_OK)
        return REDISMODULE_ERR;
    return REDISMODULE_OK;
}
