/* Requests and the queue: what a caller waits for, and how it is answered (see exec.h). */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "exec.h"

const char *const SRIO_KindNames[] = {"model", "script", "script-lists"};
const char *const SRIO_KindWords[] = {"model", "script", "script"};

static Request *queue_head, *queue_tail;
static long long queue_length;
static RedisModuleDict *blocked; /* RedisModuleBlockedClient* -> Request */
static RedisModuleDict *stats;   /* model or script key -> SRIO_ExecStats */

typedef struct Answer {
    int ok;
    char *error;
} Answer;

long long SRIO_Now(void) { return RedisModule_Milliseconds(); }

RedisModuleString *SRIO_Hold(RedisModuleString *s) { return RedisModule_HoldString(NULL, s); }

void SRIO_QueueInit(void) {
    blocked = RedisModule_CreateDict(NULL);
    stats = RedisModule_CreateDict(NULL);
}

SRIO_ExecStats *SRIO_StatsOf(RedisModuleString *key, int create) {
    size_t len;
    const char *name = RedisModule_StringPtrLen(key, &len);
    SRIO_ExecStats *s = RedisModule_DictGetC(stats, (void *)name, len, NULL);
    if (s == NULL && create) {
        s = RedisModule_Calloc(1, sizeof *s);
        RedisModule_DictSetC(stats, (void *)name, len, s);
    }
    return s;
}

int SRIO_ExecGetStats(RedisModuleString *key, SRIO_ExecStats *out) {
    SRIO_ExecStats *s = stats ? SRIO_StatsOf(key, 0) : NULL;
    if (s == NULL) {
        memset(out, 0, sizeof *out);
        return 0;
    }
    *out = *s;
    return 1;
}

void SRIO_ExecResetStats(RedisModuleString *key) {
    if (stats == NULL) return;
    size_t len;
    const char *name = RedisModule_StringPtrLen(key, &len);
    SRIO_ExecStats *s = NULL;
    RedisModule_DictDelC(stats, (void *)name, len, &s);
    if (s) RedisModule_Free(s);
}

static void free_all(RedisModuleString **strings, int n) {
    for (int i = 0; i < n; i++) RedisModule_FreeString(NULL, strings[i]);
    RedisModule_Free(strings);
}

void SRIO_RequestFree(Request *r) {
    RedisModule_FreeString(NULL, r->key);
    if (r->fn) RedisModule_FreeString(NULL, r->fn);
    if (r->user) RedisModule_FreeString(NULL, r->user);
    if (r->worker) RedisModule_FreeString(NULL, r->worker);
    free_all(r->inputs, r->ninputs);
    free_all(r->outputs, r->noutputs);
    free_all(r->keys, r->nkeys);
    free_all(r->args, r->nargs);
    RedisModule_Free(r);
}

void SRIO_QueuePush(Request *r, int at_head) {
    r->where = AT_QUEUE;
    r->queued_at = SRIO_Now();
    r->prev = r->next = NULL;
    if (queue_head == NULL) {
        queue_head = queue_tail = r;
    } else if (at_head) {
        r->next = queue_head;
        queue_head->prev = r;
        queue_head = r;
    } else {
        r->prev = queue_tail;
        queue_tail->next = r;
        queue_tail = r;
    }
    queue_length++;
}

void SRIO_QueueUnlink(Request *r) {
    if (r->prev) r->prev->next = r->next; else queue_head = r->next;
    if (r->next) r->next->prev = r->prev; else queue_tail = r->prev;
    r->prev = r->next = NULL;
    queue_length--;
}

Request *SRIO_QueueHead(void) { return queue_head; }

long long SRIO_QueueLength(void) { return queue_length; }

/* ---- answering a caller -------------------------------------------------------------------- */

static int answer_reply(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    (void)argv;
    (void)argc;
    Answer *a = RedisModule_GetBlockedClientPrivateData(ctx);
    if (a == NULL) return SRIO_ReplyError(ctx, "ERR the request was abandoned");
    if (a->ok) return RedisModule_ReplyWithSimpleString(ctx, "OK");
    return RedisModule_ReplyWithError(ctx, a->error);
}

static void answer_free(RedisModuleCtx *ctx, void *privdata) {
    (void)ctx;
    Answer *a = privdata;
    if (a->error) RedisModule_Free(a->error);
    RedisModule_Free(a);
}

/* An error reply is one line: line breaks in a worker's message become spaces. */
static char *one_line(const char *message, size_t len) {
    char *out = RedisModule_Alloc(len + 1);
    for (size_t i = 0; i < len; i++) out[i] = (message[i] == '\r' || message[i] == '\n' || !message[i]) ? ' ' : message[i];
    out[len] = '\0';
    return out;
}

void SRIO_Answer(Request *r, const char *error, size_t error_len) {
    if (r->bc == NULL) return;
    Answer *a = RedisModule_Calloc(1, sizeof *a);
    a->ok = error == NULL;
    if (error) {
        a->error = one_line(error, error_len);
        SRIO_StatsOf(r->key, 1)->errors++;
    }
    RedisModule_DictDelC(blocked, &r->bc, sizeof r->bc, NULL);
    RedisModule_UnblockClient(r->bc, a);
    r->bc = NULL;
}

void SRIO_Answerf(Request *r, const char *format, ...) {
    char message[ERROR_MAX];
    va_list ap;
    va_start(ap, format);
    int n = vsnprintf(message, sizeof message, format, ap);
    va_end(ap);
    SRIO_Answer(r, message, n < 0 ? 0 : (size_t)(n < ERROR_MAX ? n : ERROR_MAX - 1));
}

static int timed_out_message(Request *r, char *out, size_t size) {
    return snprintf(out, size,
                    "TIMEDOUT %s '%s' did not finish within %lld ms (TIMEOUT, or SmartRedis's SR_MODEL_TIMEOUT)%s",
                    SRIO_KindWords[r->kind], SRIO_Name(r->key), r->timeout_ms,
                    r->where == AT_QUEUE
                        ? (SRIO_WorkerCount() ? ": no worker was free to take it"
                                              : ": no execution worker is registered on this server")
                        : ": the worker running it stops it and is replaced");
}

static Request *blocked_take(RedisModuleBlockedClient *bc) {
    Request *r = NULL;
    RedisModule_DictDelC(blocked, &bc, sizeof bc, &r);
    return r;
}

/* A caller's deadline passed: it gets the timeout error; a queued request is dropped, one in flight
 * is dropped when its worker answers or dies. */
static int request_timeout(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    (void)argv;
    (void)argc;
    RedisModuleBlockedClient *bc = RedisModule_GetBlockedClientHandle(ctx);
    Request *r = blocked_take(bc);
    if (r == NULL) return SRIO_ReplyError(ctx, "TIMEDOUT the request did not finish in time");
    char message[ERROR_MAX];
    timed_out_message(r, message, sizeof message);
    SRIO_StatsOf(r->key, 1)->errors++;
    RedisModule_ReplyWithError(ctx, message);
    r->bc = NULL;
    RedisModule_UnblockClient(bc, NULL); /* frees the handle; the reply above is the caller's */
    if (r->where == AT_QUEUE) {
        SRIO_QueueUnlink(r);
        SRIO_RequestFree(r);
    }
    return REDISMODULE_OK;
}

static void request_disconnected(RedisModuleCtx *ctx, RedisModuleBlockedClient *bc) {
    (void)ctx;
    Request *r = blocked_take(bc);
    if (r == NULL) return; /* already answered */
    r->bc = NULL;
    RedisModule_UnblockClient(bc, NULL); /* frees the handle */
    if (r->where == AT_QUEUE) {
        SRIO_QueueUnlink(r);
        SRIO_RequestFree(r);
    }
}

void SRIO_RequestBlock(RedisModuleCtx *ctx, Request *r) {
    r->bc = RedisModule_BlockClient(ctx, answer_reply, request_timeout, answer_free, r->timeout_ms);
    RedisModule_SetDisconnectCallback(r->bc, request_disconnected);
    RedisModule_DictSetC(blocked, &r->bc, sizeof r->bc, r);
}

void SRIO_Requeue(Request *r, int died, const char *why) {
    if (r->bc == NULL) {
        SRIO_RequestFree(r);
        return;
    }
    if (SRIO_Now() >= r->deadline) {
        char message[ERROR_MAX];
        int n = timed_out_message(r, message, sizeof message);
        SRIO_Answer(r, message, n < 0 ? 0 : (size_t)(n < ERROR_MAX ? n : ERROR_MAX - 1));
        SRIO_RequestFree(r);
        return;
    }
    if (died && r->attempt + 1 >= MAX_ATTEMPTS) {
        SRIO_Answerf(r, "ERR the worker %s %s while running %s %s, which had been retried once already",
                     r->worker ? SRIO_Name(r->worker) : "?", why, SRIO_KindWords[r->kind], SRIO_Name(r->key));
        SRIO_RequestFree(r);
        return;
    }
    if (died) r->attempt++;
    SRIO_Dispatch(r, 1);
}

void SRIO_QueueExpire(void) {
    long long now = SRIO_Now(), limit = SRIO_Config.queue_timeout_ms;
    int none = SRIO_NoWorkerComing();
    /* the module's first workers may take long to start (torch's import and warm-up on a busy CPU,
     * after they register): requests wait for them within their own deadline, and count QUEUE_TIMEOUT
     * from when the first of them asked for requests */
    if (SRIO_ServingCount() == 0 && (SRIO_WorkerCount() > 0 || SRIO_SpawnStarting())) limit = 0;
    long long since = SRIO_ServingSince();
    Request *r = queue_head;
    while (r) {
        Request *next = r->next;
        if (none) {
            SRIO_QueueUnlink(r);
            SRIO_Answerf(r, "ERR no execution worker is registered on this server%s", SRIO_NoWorkerHint());
            SRIO_RequestFree(r);
        } else if (limit && now - (r->queued_at > since ? r->queued_at : since) >= limit) {
            SRIO_QueueUnlink(r);
            SRIO_Answerf(r, "ERR no execution worker took the request within %lld ms (%llu registered, all busy; "
                            "QUEUE_TIMEOUT)", limit, SRIO_WorkerCount());
            SRIO_RequestFree(r);
        }
        r = next;
    }
}
