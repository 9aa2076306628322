/* Handing requests to workers: the workers waiting in SRIO.POP (one request) or SRIO.TAKE (a batch
 * of one model), and the reply a worker receives a request in (see exec.h). */
#include <stdint.h>
#include <string.h>

#include "exec.h"

#define EMBED_MAX_BYTES (64 * 1024) /* larger inputs are read by the worker itself */

static Waiter *waiters_head, *waiters_tail;
static RedisModuleDict *blocked;   /* RedisModuleBlockedClient* -> Waiter */
static RedisModuleDict *gathering; /* waiter id -> blocked SRIO.TAKE (ended by its own timer) */
static long long next_waiter_id = 1;

void SRIO_DispatchInit(void) {
    blocked = RedisModule_CreateDict(NULL);
    gathering = RedisModule_CreateDict(NULL);
}

static void waiters_unlink(Waiter *w) {
    if (w->prev) w->prev->next = w->next; else waiters_head = w->next;
    if (w->next) w->next->prev = w->prev; else waiters_tail = w->prev;
    w->prev = w->next = NULL;
}

static void waiters_push(Waiter *w) {
    w->prev = waiters_tail;
    w->next = NULL;
    if (waiters_tail) waiters_tail->next = w; else waiters_head = w;
    waiters_tail = w;
}

static Waiter *blocked_take(RedisModuleBlockedClient *bc) {
    Waiter *w = NULL;
    RedisModule_DictDelC(blocked, &bc, sizeof bc, &w);
    return w;
}

/* Take a blocked waiter out of every list, once: whoever comes second (its timer, its timeout, its
 * disconnection) finds it released. */
static void unlist(Waiter *w) {
    if (w->released) return;
    w->released = 1;
    if (w->id) RedisModule_DictDelC(gathering, &w->id, sizeof w->id, NULL);
    waiters_unlink(w);
    blocked_take(w->bc);
}

Waiter *SRIO_WaiterNew(RedisModuleString *worker, int take, RedisModuleString *key, long long max, long long min) {
    Waiter *w = RedisModule_Calloc(1, sizeof *w);
    w->worker = SRIO_Hold(worker);
    w->take = take;
    w->key = key ? SRIO_Hold(key) : NULL;
    w->max = max;
    w->min = min;
    w->cap = max < 8 ? max : 8; /* grown as requests come: never sized by what a worker only asks for */
    w->got = RedisModule_Calloc((size_t)w->cap, sizeof *w->got);
    return w;
}

void SRIO_WaiterAdd(Waiter *w, Request *r) {
    if (w->ngot == w->cap) {
        w->cap = w->cap * 2 < w->max ? w->cap * 2 : w->max;
        w->got = RedisModule_Realloc(w->got, sizeof *w->got * (size_t)w->cap);
    }
    r->where = AT_WAITER;
    w->got[w->ngot++] = r;
}

static void waiter_free_memory(Waiter *w) {
    RedisModule_FreeString(NULL, w->worker);
    if (w->key) RedisModule_FreeString(NULL, w->key);
    RedisModule_Free(w->got);
    RedisModule_Free(w);
}

/* Answer a blocked waiter: its reply callback hands over what it holds. */
static void release_waiter(Waiter *w) {
    if (w->released) return;
    unlist(w);
    RedisModule_UnblockClient(w->bc, w);
}

/* The waiting worker `r` goes to: one gathering a batch of its model, else the longest-waiting pop
 * (unless another worker is about to gather a batch of its model); NULL: none. */
static Waiter *taker_for(Request *r) {
    Waiter *pop = NULL;
    for (Waiter *w = waiters_head; w; w = w->next) {
        if (w->take) {
            if (r->kind == KIND_MODEL && RedisModule_StringCompare(w->key, r->key) == 0) return w;
        } else if (pop == NULL) {
            pop = w;
        }
    }
    return pop && !SRIO_Claimed(r) ? pop : NULL;
}

static void give(Waiter *w, Request *r) {
    if (!w->take) SRIO_Claim(r, w->worker); /* before the worker has it: requests arriving meanwhile wait for it */
    SRIO_WaiterAdd(w, r);
    if (!w->take || w->ngot >= w->min || w->ngot >= w->max) release_waiter(w);
}

void SRIO_Dispatch(Request *r, int at_head) {
    if (r->bc == NULL) {
        SRIO_RequestFree(r);
        return;
    }
    Waiter *w = taker_for(r);
    if (w) give(w, r); else SRIO_QueuePush(r, at_head);
}

void SRIO_Kick(void) {
    long long scanned = 0;
    for (Request *r = SRIO_QueueHead(); r && waiters_head && scanned < BATCH_SCAN_LIMIT; scanned++) {
        Request *next = r->next;
        Waiter *w = taker_for(r);
        if (w) {
            SRIO_QueueUnlink(r);
            give(w, r);
        }
        r = next;
    }
}

static void reply_strings(RedisModuleCtx *ctx, RedisModuleString **strings, int n) {
    RedisModule_ReplyWithArray(ctx, n);
    for (int i = 0; i < n; i++) RedisModule_ReplyWithString(ctx, strings[i]);
}

/* The value at `name` if it is a string of at most `limit` bytes held here; else a null. */
static void reply_local_value(RedisModuleCtx *ctx, RedisModuleString *name, size_t limit) {
    RedisModuleKey *key = RedisModule_OpenKey(ctx, name, REDISMODULE_READ);
    if (key && RedisModule_KeyType(key) == REDISMODULE_KEYTYPE_STRING) {
        size_t len;
        const char *value = RedisModule_StringDMA(key, &len, REDISMODULE_READ);
        if (value && len <= limit) {
            RedisModule_ReplyWithStringBuffer(ctx, value, len);
            RedisModule_CloseKey(key);
            return;
        }
    }
    if (key) RedisModule_CloseKey(key);
    RedisModule_ReplyWithNull(ctx);
}

void SRIO_ReplyRequest(RedisModuleCtx *ctx, Request *r, int with_manifest) {
    RedisModule_ReplyWithArray(ctx, 14);
    RedisModule_ReplyWithLongLong(ctx, r->id);
    RedisModule_ReplyWithSimpleString(ctx, SRIO_KindNames[r->kind]);
    RedisModule_ReplyWithString(ctx, r->key);
    if (r->fn) RedisModule_ReplyWithString(ctx, r->fn); else RedisModule_ReplyWithStringBuffer(ctx, "", 0);
    RedisModule_ReplyWithLongLong(ctx, r->deadline - SRIO_Now());
    RedisModule_ReplyWithLongLong(ctx, r->attempt);
    RedisModule_ReplyWithString(ctx, r->user);
    reply_strings(ctx, r->inputs, r->ninputs);
    reply_strings(ctx, r->outputs, r->noutputs);
    if (with_manifest) reply_local_value(ctx, r->key, EMBED_MAX_BYTES); else RedisModule_ReplyWithNull(ctx);
    RedisModule_ReplyWithArray(ctx, r->ninputs);
    for (int i = 0; i < r->ninputs; i++) reply_local_value(ctx, r->inputs[i], EMBED_MAX_BYTES);
    reply_strings(ctx, r->keys, r->nkeys);
    reply_strings(ctx, r->args, r->nargs);
    RedisModule_ReplyWithLongLong(ctx, r->variadic);
}

/* Deliver and reply the requests a waiter holds whose callers still wait (the others are dropped). */
static void waiter_deliver(RedisModuleCtx *ctx, Waiter *w) {
    unsigned long long owner = RedisModule_GetClientId(ctx);
    long long live = 0;
    for (long long i = 0; i < w->ngot; i++) {
        if (w->got[i]->bc == NULL) {
            if (!w->take) SRIO_Unclaim(w->got[i]->key, w->worker); /* it will not gather for this one */
            SRIO_RequestFree(w->got[i]);
            w->got[i] = NULL;
        } else {
            live++;
        }
    }
    w->delivered = 1;
    if (!w->take) {
        if (live == 0) {
            RedisModule_ReplyWithNull(ctx);
            return;
        }
        SRIO_Deliver(w->got[0], w->worker, owner);
        SRIO_ReplyRequest(ctx, w->got[0], 1);
        return;
    }
    RedisModule_ReplyWithArray(ctx, live);
    for (long long i = 0; i < w->ngot; i++) {
        if (w->got[i] == NULL) continue;
        SRIO_Deliver(w->got[i], w->worker, owner);
        SRIO_ReplyRequest(ctx, w->got[i], 0);
    }
    SRIO_Unclaim(w->key, w->worker);
}

void SRIO_WaiterAnswerNow(RedisModuleCtx *ctx, Waiter *w) {
    waiter_deliver(ctx, w);
    waiter_free_memory(w);
}

static int waiter_reply(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    (void)argv;
    (void)argc;
    waiter_deliver(ctx, RedisModule_GetBlockedClientPrivateData(ctx));
    return REDISMODULE_OK;
}

/* Requests handed to a worker that went away before receiving them go back to the head of the queue. */
static void waiter_free(RedisModuleCtx *ctx, void *privdata) {
    (void)ctx;
    Waiter *w = privdata;
    if (!w->delivered) {
        for (long long i = w->ngot - 1; i >= 0; i--) SRIO_Dispatch(w->got[i], 1);
    }
    waiter_free_memory(w);
}

static int waiter_timeout(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    (void)argv;
    (void)argc;
    Waiter *w = blocked_take(RedisModule_GetBlockedClientHandle(ctx));
    if (w == NULL || w->released) return RedisModule_ReplyWithNull(ctx);
    unlist(w);
    waiter_deliver(ctx, w);
    RedisModule_UnblockClient(w->bc, NULL); /* frees the handle */
    waiter_free_memory(w);
    return REDISMODULE_OK;
}

static void waiter_disconnected(RedisModuleCtx *ctx, RedisModuleBlockedClient *bc) {
    (void)ctx;
    Waiter *w = blocked_take(bc);
    if (w == NULL || w->released) return; /* released: waiter_free requeues what it held */
    unlist(w);
    RedisModule_UnblockClient(bc, w); /* not delivered: waiter_free requeues what it held */
}

/* A gathering SRIO.TAKE's wait is over: it gets what it has. A timer of its own ends it on time (a
 * blocked client's own timeout fires up to a server tick late). */
static void take_timer(RedisModuleCtx *ctx, void *data) {
    (void)ctx;
    long long id = (long long)(intptr_t)data;
    Waiter *w = RedisModule_DictGetC(gathering, &id, sizeof id, NULL);
    if (w) release_waiter(w);
}

void SRIO_WaiterBlock(RedisModuleCtx *ctx, Waiter *w, long long block_ms, long long wait_ms) {
    w->bc = RedisModule_BlockClient(ctx, waiter_reply, waiter_timeout, waiter_free, block_ms);
    RedisModule_SetDisconnectCallback(w->bc, waiter_disconnected);
    RedisModule_DictSetC(blocked, &w->bc, sizeof w->bc, w);
    waiters_push(w);
    if (wait_ms >= 0) {
        w->id = next_waiter_id++;
        RedisModule_DictSetC(gathering, &w->id, sizeof w->id, w);
        RedisModule_CreateTimer(ctx, wait_ms, take_timer, (void *)(intptr_t)w->id);
    }
}

long long SRIO_ReleaseWaitersOf(RedisModuleString *name) {
    long long n = 0;
    Waiter *w = waiters_head;
    while (w) {
        Waiter *next = w->next;
        if (RedisModule_StringCompare(w->worker, name) == 0) {
            release_waiter(w);
            n++;
        }
        w = next;
    }
    return n;
}

int SRIO_IsWaiting(RedisModuleString *name) {
    for (Waiter *w = waiters_head; w; w = w->next) {
        if (RedisModule_StringCompare(w->worker, name) == 0) return 1;
    }
    return 0;
}

void SRIO_Deliver(Request *r, RedisModuleString *name, unsigned long long owner) {
    r->where = AT_WORKER;
    r->owner = owner;
    if (r->worker) RedisModule_FreeString(NULL, r->worker);
    r->worker = SRIO_Hold(name);
    SRIO_InflightAdd(r);
}
