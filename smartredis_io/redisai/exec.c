/* The execution half of the smartredis_io Redis module.
 *
 * Clients send RedisAI's AI.MODELEXECUTE, AI.SCRIPTEXECUTE and AI.SCRIPTRUN. Each request is checked
 * against the caller's ACL (read on the model or script and on every input, write on every output),
 * carries the caller's user name, and waits in this server's memory while the caller is blocked
 * (the client, never the server) until its deadline. Execution workers (`python -m
 * smartredis_io.worker`) take requests with SRIO.POP / SRIO.TAKE and answer them with SRIO.REPLY,
 * which stores the outputs and unblocks the caller in one step. The queue, the requests in flight,
 * the workers and their statistics live here and in no key, so no client user can read, forge or
 * delete them. A worker whose connection closes, or whose heartbeat stops for HEARTBEAT_TTL_MS,
 * has its requests run once more on another worker, then answered with an error.
 *
 * Every pointer below is touched from the server's main thread only.
 */
#define _GNU_SOURCE /* memmem */
#include "exec.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define MAX_ATTEMPTS 2              /* a request whose worker dies runs once more */
#define HEARTBEAT_TTL_MS 3000       /* a worker silent this long is dead */
#define REAP_INTERVAL_MS 250        /* how often silent workers are looked for */
#define EMBED_MAX_BYTES (64 * 1024) /* larger inputs are read by the worker itself */
#define HEAD_BYTES 296              /* smartredis_io.wire.HEADER_MAX_BYTES: a replaced value's header */
#define BATCH_SCAN_LIMIT 1024       /* queued requests SRIO.TAKE looks at */
#define MANIFEST_PREFIX "{\"kind\": \""
#define ERROR_MAX 512

enum { KIND_MODEL, KIND_SCRIPT, KIND_SCRIPT_LISTS };
static const char *KIND_NAMES[] = {"model", "script", "script-lists"};
static const char *KIND_WORDS[] = {"model", "script", "script"};
enum { AT_QUEUE, AT_WAITER, AT_WORKER };

typedef struct Request {
    long long id;
    int kind;
    int where;
    int attempt;
    int variadic; /* AI.SCRIPTRUN's `$`: index of the first input passed as one list; -1: none */
    int batched;  /* a model set with batch_size > 1 (read when the request came) */
    RedisModuleString *key, *fn, *user;
    RedisModuleString *worker; /* name of the worker running it (AT_WORKER) */
    RedisModuleString **inputs, **outputs, **keys, **args;
    int ninputs, noutputs, nkeys, nargs;
    long long deadline; /* RedisModule_Milliseconds() */
    long long timeout_ms;
    unsigned long long owner;     /* client id of the worker connection running it */
    RedisModuleBlockedClient *bc; /* the caller; NULL once answered or gone */
    struct Request *prev, *next;  /* queue links */
} Request;

typedef struct Waiter {
    RedisModuleBlockedClient *bc;
    RedisModuleString *worker;
    int take;               /* SRIO.TAKE (gathering a batch for `key`) rather than SRIO.POP */
    RedisModuleString *key;
    long long max, min;
    Request **got;
    long long ngot;
    int delivered;
    long long id; /* a gathering SRIO.TAKE: its key in `gathering` */
    struct Waiter *prev, *next;
} Waiter;

#define WORKER_CONNECTIONS 8 /* a worker's connections to one server: pops, pauses, heartbeats */

typedef struct Worker {
    RedisModuleString *name;
    long long pid;
    long long beat; /* last sign of life, RedisModule_Milliseconds() */
    unsigned long long connections[WORKER_CONNECTIONS]; /* client ids it spoke on (the latest ones) */
    int nconnections;
} Worker;

typedef struct Answer {
    int ok;
    char *error;
} Answer;

static Request *queue_head, *queue_tail;
static long long queue_length;
static Waiter *waiters_head, *waiters_tail;
static RedisModuleDict *inflight; /* request id -> Request, AT_WORKER */
static RedisModuleDict *blocked;  /* RedisModuleBlockedClient* -> Request (callers) or Waiter (workers) */
static RedisModuleDict *workers;  /* name -> Worker */
static RedisModuleDict *stats;    /* model or script key -> SRIO_ExecStats */
static RedisModuleDict *gathering; /* waiter id -> blocked SRIO.TAKE (ended by its own timer) */
/* model key -> name of the worker that took a request for it and is about to gather a batch
 * (SRIO.TAKE): until then, other requests for that model wait for it rather than go to other
 * workers, as RedisAI batches them. */
static RedisModuleDict *claims;
static long long next_id = 1, next_waiter_id = 1;
static long long default_timeout_ms = 60000;

/* ---- small helpers ------------------------------------------------------------------------- */

static long long now_ms(void) { return RedisModule_Milliseconds(); }

static const char *str(RedisModuleString *s) { return RedisModule_StringPtrLen(s, NULL); }

static int str_is(RedisModuleString *s, const char *word) { return strcasecmp(str(s), word) == 0; }

static void map_set(RedisModuleDict *d, const void *key, size_t len, void *value) {
    RedisModule_DictReplaceC(d, (void *)key, len, value);
}

static void *map_take(RedisModuleDict *d, const void *key, size_t len) {
    void *value = NULL;
    RedisModule_DictDelC(d, (void *)key, len, &value);
    return value;
}

static void blocked_set(RedisModuleBlockedClient *bc, void *value) { map_set(blocked, &bc, sizeof bc, value); }

static void *blocked_take(RedisModuleBlockedClient *bc) { return map_take(blocked, &bc, sizeof bc); }

static SRIO_ExecStats *stats_of(RedisModuleString *key, int create) {
    size_t len;
    const char *name = RedisModule_StringPtrLen(key, &len);
    SRIO_ExecStats *s = RedisModule_DictGetC(stats, (void *)name, len, NULL);
    if (s == NULL && create) {
        s = RedisModule_Calloc(1, sizeof *s);
        RedisModule_DictSetC(stats, (void *)name, len, s);
    }
    return s;
}

static RedisModuleString *hold(RedisModuleString *s) { return RedisModule_HoldString(NULL, s); }

static RedisModuleString **hold_all(RedisModuleString **argv, int n) {
    if (n <= 0) return NULL;
    RedisModuleString **out = RedisModule_Alloc(sizeof *out * n);
    for (int i = 0; i < n; i++) out[i] = hold(argv[i]);
    return out;
}

static void free_all(RedisModuleString **strings, int n) {
    for (int i = 0; i < n; i++) RedisModule_FreeString(NULL, strings[i]);
    RedisModule_Free(strings);
}

static void free_request(Request *r) {
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

/* ---- the queue ----------------------------------------------------------------------------- */

static void queue_push(Request *r, int at_head) {
    r->where = AT_QUEUE;
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

static void queue_unlink(Request *r) {
    if (r->prev) r->prev->next = r->next; else queue_head = r->next;
    if (r->next) r->next->prev = r->prev; else queue_tail = r->prev;
    r->prev = r->next = NULL;
    queue_length--;
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

/* ---- answering a caller -------------------------------------------------------------------- */

static int answer_reply(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    (void)argv;
    (void)argc;
    Answer *a = RedisModule_GetBlockedClientPrivateData(ctx);
    if (a == NULL) return RedisModule_ReplyWithError(ctx, "ERR the request was abandoned");
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
    for (size_t i = 0; i < len; i++) out[i] = (message[i] == '\r' || message[i] == '\n') ? ' ' : message[i];
    out[len] = '\0';
    return out;
}

/* Unblock the caller of `r` with OK (error == NULL) or the error; a no-op once it is gone. */
static void answer(Request *r, const char *error, size_t error_len) {
    if (r->bc == NULL) return;
    Answer *a = RedisModule_Calloc(1, sizeof *a);
    a->ok = error == NULL;
    if (error) {
        a->error = one_line(error, error_len);
        stats_of(r->key, 1)->errors++;
    }
    blocked_take(r->bc);
    RedisModule_UnblockClient(r->bc, a);
    r->bc = NULL;
}

static void answerf(Request *r, const char *format, ...) __attribute__((format(printf, 2, 3)));
static void answerf(Request *r, const char *format, ...) {
    char message[ERROR_MAX];
    va_list ap;
    va_start(ap, format);
    int n = vsnprintf(message, sizeof message, format, ap);
    va_end(ap);
    answer(r, message, n < 0 ? 0 : (size_t)(n < ERROR_MAX ? n : ERROR_MAX - 1));
}

static int timed_out_message(Request *r, char *out, size_t size) {
    return snprintf(out, size,
                    "TIMEDOUT %s '%s' did not finish within %lld ms (TIMEOUT, or SmartRedis's SR_MODEL_TIMEOUT)%s",
                    KIND_WORDS[r->kind], str(r->key), r->timeout_ms,
                    r->where == AT_QUEUE
                        ? (RedisModule_DictSize(workers) ? ": no worker was free to take it"
                                                         : ": no execution worker is registered on this server")
                        : ": the worker running it stops it and is replaced");
}

/* A caller's deadline passed: it gets the timeout error; a queued request is dropped, one in flight
 * is dropped when its worker answers or dies. */
static int request_timeout(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    (void)argv;
    (void)argc;
    RedisModuleBlockedClient *bc = RedisModule_GetBlockedClientHandle(ctx);
    Request *r = blocked_take(bc);
    if (r == NULL) return RedisModule_ReplyWithError(ctx, "TIMEDOUT the request did not finish in time");
    char message[ERROR_MAX];
    timed_out_message(r, message, sizeof message);
    stats_of(r->key, 1)->errors++;
    RedisModule_ReplyWithError(ctx, message);
    r->bc = NULL;
    RedisModule_UnblockClient(bc, NULL); /* releases the handle; the reply above is the caller's */
    if (r->where == AT_QUEUE) {
        queue_unlink(r);
        free_request(r);
    }
    return REDISMODULE_OK;
}

static void request_disconnected(RedisModuleCtx *ctx, RedisModuleBlockedClient *bc) {
    (void)ctx;
    Request *r = blocked_take(bc);
    if (r == NULL) return; /* already answered */
    r->bc = NULL;
    RedisModule_UnblockClient(bc, NULL);
    if (r->where == AT_QUEUE) {
        queue_unlink(r);
        free_request(r);
    }
}

/* ---- batching claims ------------------------------------------------------------------------ */

/* Whether the manifest at `name` asks for batching (batch_size > 1). */
static int batches(RedisModuleCtx *ctx, RedisModuleString *name) {
    RedisModuleKey *key = RedisModule_OpenKey(ctx, name, REDISMODULE_READ);
    if (key == NULL) return 0;
    int found = 0;
    if (RedisModule_KeyType(key) == REDISMODULE_KEYTYPE_STRING) {
        size_t len;
        const char *value = RedisModule_StringDMA(key, &len, REDISMODULE_READ);
        const char *field = "\"batch_size\": ";
        const char *at = memmem(value, len, field, strlen(field));
        if (at) {
            at += strlen(field);
            long long n = 0;
            while (at < value + len && *at >= '0' && *at <= '9') n = n * 10 + (*at++ - '0');
            found = n > 1;
        }
    }
    RedisModule_CloseKey(key);
    return found;
}

static RedisModuleString *claim_of(RedisModuleString *key) {
    size_t len;
    const char *name = RedisModule_StringPtrLen(key, &len);
    return RedisModule_DictGetC(claims, (void *)name, len, NULL);
}

/* The worker `worker` takes `r`: if its model batches, the model's next requests wait for that worker. */
static void claim(Request *r, RedisModuleString *worker) {
    if (!r->batched || claim_of(r->key)) return;
    size_t len;
    const char *name = RedisModule_StringPtrLen(r->key, &len);
    RedisModule_DictSetC(claims, (void *)name, len, hold(worker));
}

static void kick(void);

/* End the claim on `key` if `worker` holds it (NULL: whoever holds it); the requests it held back go on. */
static void unclaim(RedisModuleString *key, RedisModuleString *worker) {
    RedisModuleString *holder = claim_of(key);
    if (holder == NULL || (worker && RedisModule_StringCompare(holder, worker) != 0)) return;
    size_t len;
    const char *name = RedisModule_StringPtrLen(key, &len);
    RedisModule_DictDelC(claims, (void *)name, len, NULL);
    RedisModule_FreeString(NULL, holder);
    kick();
}

/* End every claim `worker` holds (it died or left). */
static void unclaim_all(RedisModuleString *worker) {
    RedisModuleString **keys = NULL;
    long long n = 0;
    RedisModuleDictIter *it = RedisModule_DictIteratorStartC(claims, "^", NULL, 0);
    char *name;
    size_t len;
    RedisModuleString *holder;
    while ((name = RedisModule_DictNextC(it, &len, (void **)&holder))) {
        if (RedisModule_StringCompare(holder, worker) != 0) continue;
        keys = RedisModule_Realloc(keys, sizeof *keys * (n + 1));
        keys[n++] = RedisModule_CreateString(NULL, name, len);
    }
    RedisModule_DictIteratorStop(it);
    for (long long i = 0; i < n; i++) {
        unclaim(keys[i], worker);
        RedisModule_FreeString(NULL, keys[i]);
    }
    RedisModule_Free(keys);
}

static int claimed(Request *r) { return r->kind == KIND_MODEL && claim_of(r->key) != NULL; }

/* ---- handing requests to workers ----------------------------------------------------------- */

static void release_waiter(Waiter *w) {
    if (w->id) RedisModule_DictDelC(gathering, &w->id, sizeof w->id, NULL);
    waiters_unlink(w);
    blocked_take(w->bc);
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
    return pop && !claimed(r) ? pop : NULL;
}

static void give(Waiter *w, Request *r) {
    r->where = AT_WAITER;
    if (!w->take) claim(r, w->worker); /* before the worker has it: requests arriving meanwhile wait for it */
    w->got[w->ngot++] = r;
    if (!w->take || w->ngot >= w->min || w->ngot >= w->max) release_waiter(w);
}

/* Give `r` to a waiting worker, or queue it. */
static void dispatch(Request *r, int at_head) {
    if (r->bc == NULL) {
        free_request(r);
        return;
    }
    Waiter *w = taker_for(r);
    if (w) give(w, r); else queue_push(r, at_head);
}

/* Hand queued requests to waiting workers (after a claim ended, requests it held back may go). */
static void kick(void) {
    long long scanned = 0;
    for (Request *r = queue_head; r && waiters_head && scanned < BATCH_SCAN_LIMIT; scanned++) {
        Request *next = r->next;
        Waiter *w = taker_for(r);
        if (w) {
            queue_unlink(r);
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
        if (len <= limit) {
            RedisModule_ReplyWithStringBuffer(ctx, value, len);
            RedisModule_CloseKey(key);
            return;
        }
    }
    if (key) RedisModule_CloseKey(key);
    RedisModule_ReplyWithNull(ctx);
}

/* A request as a worker receives it (see docs/smartredis.md, "The worker protocol"). */
static void reply_request(RedisModuleCtx *ctx, Request *r, int with_manifest) {
    RedisModule_ReplyWithArray(ctx, 14);
    RedisModule_ReplyWithLongLong(ctx, r->id);
    RedisModule_ReplyWithSimpleString(ctx, KIND_NAMES[r->kind]);
    RedisModule_ReplyWithString(ctx, r->key);
    if (r->fn) RedisModule_ReplyWithString(ctx, r->fn); else RedisModule_ReplyWithStringBuffer(ctx, "", 0);
    RedisModule_ReplyWithLongLong(ctx, r->deadline - now_ms());
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

/* `r` is now run by the worker `name` on connection `owner`. */
static void deliver(Request *r, RedisModuleString *name, unsigned long long owner) {
    r->where = AT_WORKER;
    r->owner = owner;
    if (r->worker) RedisModule_FreeString(NULL, r->worker);
    r->worker = hold(name);
    RedisModule_DictSetC(inflight, &r->id, sizeof r->id, r);
}

/* Deliver and reply the requests a waiter holds whose callers still wait (the others are dropped). */
static void waiter_deliver(RedisModuleCtx *ctx, Waiter *w) {
    unsigned long long owner = RedisModule_GetClientId(ctx);
    long long live = 0;
    for (long long i = 0; i < w->ngot; i++) {
        if (w->got[i]->bc == NULL) {
            if (!w->take) unclaim(w->got[i]->key, w->worker); /* it will not gather for this one */
            free_request(w->got[i]);
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
        deliver(w->got[0], w->worker, owner);
        reply_request(ctx, w->got[0], 1);
        return;
    }
    RedisModule_ReplyWithArray(ctx, live);
    for (long long i = 0; i < w->ngot; i++) {
        if (w->got[i] == NULL) continue;
        deliver(w->got[i], w->worker, owner);
        reply_request(ctx, w->got[i], 0);
    }
    unclaim(w->key, w->worker);
}

static void waiter_free_memory(Waiter *w) {
    if (w->id) RedisModule_DictDelC(gathering, &w->id, sizeof w->id, NULL);
    RedisModule_FreeString(NULL, w->worker);
    if (w->key) RedisModule_FreeString(NULL, w->key);
    RedisModule_Free(w->got);
    RedisModule_Free(w);
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
        for (long long i = w->ngot - 1; i >= 0; i--) dispatch(w->got[i], 1);
    }
    waiter_free_memory(w);
}

static int waiter_timeout(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    (void)argv;
    (void)argc;
    RedisModuleBlockedClient *bc = RedisModule_GetBlockedClientHandle(ctx);
    Waiter *w = blocked_take(bc);
    if (w == NULL) return RedisModule_ReplyWithNull(ctx);
    waiters_unlink(w);
    waiter_deliver(ctx, w);
    RedisModule_UnblockClient(bc, NULL);
    waiter_free_memory(w);
    return REDISMODULE_OK;
}

/* A gathering SRIO.TAKE's wait is over: it gets what it has. A timer of its own ends it on time (a
 * blocked client's own timeout fires up to a server tick late). */
static void take_timer(RedisModuleCtx *ctx, void *data) {
    (void)ctx;
    long long id = (long long)(intptr_t)data;
    Waiter *w = RedisModule_DictGetC(gathering, &id, sizeof id, NULL);
    if (w) release_waiter(w);
}

static void waiter_disconnected(RedisModuleCtx *ctx, RedisModuleBlockedClient *bc) {
    (void)ctx;
    Waiter *w = blocked_take(bc);
    if (w == NULL) return; /* released: waiter_free requeues what it held */
    waiters_unlink(w);
    RedisModule_UnblockClient(bc, w); /* not delivered: waiter_free requeues what it held */
}

/* ---- workers ------------------------------------------------------------------------------- */

static Worker *touch_worker(RedisModuleCtx *ctx, RedisModuleString *name, long long pid) {
    size_t len;
    const char *key = RedisModule_StringPtrLen(name, &len);
    Worker *w = RedisModule_DictGetC(workers, (void *)key, len, NULL);
    if (w == NULL) {
        w = RedisModule_Calloc(1, sizeof *w);
        w->name = hold(name);
        RedisModule_DictSetC(workers, (void *)key, len, w);
    }
    if (pid >= 0) w->pid = pid;
    w->beat = now_ms();
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

/* A request whose worker died or stopped: run again (the first time a worker dies running it), or
 * answered with an error. `died`: 0 when the worker handed it back without running it to the end. */
static void requeue(Request *r, int died, const char *why) {
    if (r->bc == NULL) {
        free_request(r);
        return;
    }
    if (now_ms() >= r->deadline) {
        char message[ERROR_MAX];
        int n = timed_out_message(r, message, sizeof message);
        answer(r, message, n < 0 ? 0 : (size_t)(n < ERROR_MAX ? n : ERROR_MAX - 1));
        free_request(r);
        return;
    }
    if (died && r->attempt + 1 >= MAX_ATTEMPTS) {
        answerf(r, "ERR the worker %s %s while running %s %s, which had been retried once already",
                r->worker ? str(r->worker) : "?", why, KIND_WORDS[r->kind], str(r->key));
        free_request(r);
        return;
    }
    if (died) r->attempt++;
    dispatch(r, 1);
}

/* Take out of flight every request matching (owner, name); either may be 0 / NULL for any. */
static long long take_inflight(unsigned long long owner, RedisModuleString *name, Request ***out) {
    long long n = 0, cap = (long long)RedisModule_DictSize(inflight);
    *out = NULL;
    if (cap == 0) return 0;
    *out = RedisModule_Alloc(sizeof **out * cap);
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

/* Release every waiting pop or gather of the worker `name` (a paused pop answers nil). */
static long long release_waiters_of(RedisModuleString *name) {
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

static void forget_worker(RedisModuleString *name) {
    size_t len;
    const char *key = RedisModule_StringPtrLen(name, &len);
    Worker *w = map_take(workers, key, len);
    if (w) {
        RedisModule_FreeString(NULL, w->name);
        RedisModule_Free(w);
    }
}

/* The worker `id` was a connection of, when it closes: that worker is unregistered (a live one
 * registers again with its next command); NULL when it was no worker's. */
static void forget_connection(unsigned long long id) {
    RedisModuleString *gone = NULL;
    RedisModuleDictIter *it = RedisModule_DictIteratorStartC(workers, "^", NULL, 0);
    Worker *w;
    while (!gone && RedisModule_DictNextC(it, NULL, (void **)&w)) {
        for (int i = 0; i < w->nconnections; i++)
            if (w->connections[i] == id) gone = hold(w->name);
    }
    RedisModule_DictIteratorStop(it);
    if (gone == NULL) return;
    unclaim_all(gone);
    forget_worker(gone);
    RedisModule_FreeString(NULL, gone);
}

static void client_change(RedisModuleCtx *ctx, RedisModuleEvent event, uint64_t subevent, void *data) {
    (void)event;
    if (subevent != REDISMODULE_SUBEVENT_CLIENT_CHANGE_DISCONNECTED) return;
    RedisModuleClientInfo *info = data;
    if (RedisModule_DictSize(workers)) forget_connection(info->id);
    if (RedisModule_DictSize(inflight) == 0) return;
    Request **gone;
    long long n = take_inflight(info->id, NULL, &gone);
    for (long long i = 0; i < n; i++) {
        RedisModule_Log(ctx, "warning", "the worker %s disconnected while running %s %s: run again or failed",
                        str(gone[i]->worker), KIND_WORDS[gone[i]->kind], str(gone[i]->key));
        unclaim(gone[i]->key, gone[i]->worker);
        requeue(gone[i], 1, "died");
    }
    RedisModule_Free(gone);
}

static void reap(RedisModuleCtx *ctx, void *data) {
    (void)data;
    long long now = now_ms();
    RedisModuleString **silent = NULL;
    long long nsilent = 0;
    RedisModuleDictIter *it = RedisModule_DictIteratorStartC(workers, "^", NULL, 0);
    Worker *w;
    while (RedisModule_DictNextC(it, NULL, (void **)&w)) {
        if (now - w->beat <= HEARTBEAT_TTL_MS) continue;
        silent = RedisModule_Realloc(silent, sizeof *silent * (nsilent + 1));
        silent[nsilent++] = hold(w->name);
    }
    RedisModule_DictIteratorStop(it);
    for (long long i = 0; i < nsilent; i++) {
        RedisModule_Log(ctx, "warning", "the worker %s sent no heartbeat for %d ms: unregistered", str(silent[i]),
                        HEARTBEAT_TTL_MS);
        release_waiters_of(silent[i]);
        unclaim_all(silent[i]);
        Request **gone;
        long long n = take_inflight(0, silent[i], &gone);
        for (long long j = 0; j < n; j++) requeue(gone[j], 1, "stopped sending heartbeats");
        RedisModule_Free(gone);
        forget_worker(silent[i]);
        RedisModule_FreeString(NULL, silent[i]);
    }
    RedisModule_Free(silent);
    RedisModule_CreateTimer(ctx, REAP_INTERVAL_MS, reap, NULL);
}

/* ---- client commands ----------------------------------------------------------------------- */

/* -1: nothing at `name`; KIND_MODEL or KIND_SCRIPT for a stored manifest; 99: anything else. */
static int stored_kind(RedisModuleCtx *ctx, RedisModuleString *name) {
    RedisModuleKey *key = RedisModule_OpenKey(ctx, name, REDISMODULE_READ);
    if (key == NULL) return -1;
    int kind = 99;
    int type = RedisModule_KeyType(key);
    if (type == REDISMODULE_KEYTYPE_EMPTY) {
        kind = -1;
    } else if (type == REDISMODULE_KEYTYPE_STRING) {
        size_t len;
        const char *value = RedisModule_StringDMA(key, &len, REDISMODULE_READ);
        size_t prefix = strlen(MANIFEST_PREFIX);
        if (len > prefix && memcmp(value, MANIFEST_PREFIX, prefix) == 0) {
            if (len >= prefix + 6 && memcmp(value + prefix, "model\"", 6) == 0) kind = KIND_MODEL;
            if (len >= prefix + 7 && memcmp(value + prefix, "script\"", 7) == 0) kind = KIND_SCRIPT;
        }
    }
    RedisModule_CloseKey(key);
    return kind;
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
    if (RedisModule_StringToLongLong(argv[*pos], timeout_ms) != REDISMODULE_OK || *timeout_ms <= 0)
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
    if (!str_is(argv[pos++], "INPUTS")) return "ERR INPUTS not specified";
    const char *error = parse_counted(argv, argc, &pos, 1, &p->inputs, &p->ninputs, "ERR Invalid argument for input_count",
                                      "ERR Input count must be a positive integer",
                                      "ERR number of input keys to AI.MODELEXECUTE command does not match the number of "
                                      "given arguments");
    if (error) return error;
    if (pos >= argc || !str_is(argv[pos++], "OUTPUTS")) return "ERR OUTPUTS not specified";
    error = parse_counted(argv, argc, &pos, 1, &p->outputs, &p->noutputs, "ERR Invalid argument for output_count",
                          "ERR Output count must be a positive integer",
                          "ERR number of output keys to AI.MODELEXECUTE command does not match the number of "
                          "given arguments");
    if (error) return error;
    if (pos < argc) {
        if (!str_is(argv[pos++], "TIMEOUT")) return "ERR Invalid argument after OUTPUTS (only TIMEOUT may follow)";
        if ((error = parse_timeout(argv, argc, &pos, &p->timeout_ms))) return error;
    }
    if (pos != argc) return "ERR Invalid argument after TIMEOUT";
    return NULL;
}

/* AI.SCRIPTEXECUTE key function [KEYS n key...] [INPUTS n input...] [ARGS n arg...] [OUTPUTS m output...] [TIMEOUT ms] */
static const char *parse_scriptexecute(RedisModuleString **argv, int argc, Parsed *p) {
    if (argc < 4) return "ERR wrong number of arguments for 'AI.SCRIPTEXECUTE' command";
    p->kind = KIND_SCRIPT_LISTS;
    p->key = argv[1];
    p->fn = argv[2];
    if (!str_is(argv[3], "KEYS") && !str_is(argv[3], "INPUTS"))
        return "ERR KEYS or INPUTS scope must be provided first for AI.SCRIPTEXECUTE command";
    int pos = 3, keys = 0, inputs = 0, args = 0, outputs = 0;
    const char *error = NULL;
    while (pos < argc && !error) {
        RedisModuleString *word = argv[pos++];
        if (str_is(word, "TIMEOUT")) {
            if ((error = parse_timeout(argv, argc, &pos, &p->timeout_ms))) return error;
            if (pos != argc) return "ERR Invalid AI.SCRIPTEXECUTE command: TIMEOUT must come last";
            break;
        } else if (str_is(word, "KEYS")) {
            if (keys++) return "ERR Already Encountered KEYS scope in AI.SCRIPTEXECUTE command";
            error = parse_counted(argv, argc, &pos, 1, &p->keys, &p->nkeys,
                                  "ERR Invalid argument for keys count in AI.SCRIPTEXECUTE",
                                  "ERR Invalid or negative value found in number of KEYS",
                                  "ERR number of keys to AI.SCRIPTEXECUTE command does not match the number of given "
                                  "arguments");
        } else if (str_is(word, "INPUTS")) {
            if (inputs++) return "ERR Already Encountered INPUTS scope in AI.SCRIPTEXECUTE command";
            error = parse_counted(argv, argc, &pos, 0, &p->inputs, &p->ninputs,
                                  "ERR Invalid argument for inputs count in AI.SCRIPTEXECUTE",
                                  "ERR Invalid argument for inputs count in AI.SCRIPTEXECUTE",
                                  "ERR number of inputs to AI.SCRIPTEXECUTE command does not match the number of given "
                                  "arguments");
        } else if (str_is(word, "ARGS")) {
            if (args++) return "ERR Already Encountered ARGS scope in AI.SCRIPTEXECUTE command";
            error = parse_counted(argv, argc, &pos, 0, &p->args, &p->nargs,
                                  "ERR Invalid argument for args count in AI.SCRIPTEXECUTE",
                                  "ERR Invalid argument for args count in AI.SCRIPTEXECUTE",
                                  "ERR number of args to AI.SCRIPTEXECUTE command does not match the number of given "
                                  "arguments");
        } else if (str_is(word, "OUTPUTS")) {
            if (outputs++) return "ERR Already Encountered OUTPUTS scope in AI.SCRIPTEXECUTE command";
            error = parse_counted(argv, argc, &pos, 0, &p->outputs, &p->noutputs,
                                  "ERR Invalid argument for outputs count in AI.SCRIPTEXECUTE",
                                  "ERR Invalid argument for outputs count in AI.SCRIPTEXECUTE",
                                  "ERR number of outputs to AI.SCRIPTEXECUTE command does not match the number of "
                                  "given arguments");
        } else {
            return "ERR Invalid AI.SCRIPTEXECUTE command. Unexpected argument";
        }
    }
    return error;
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
        if (str_is(word, "TIMEOUT")) {
            if (timeout_set++) return "ERR Already encountered an TIMEOUT section in SCRIPTRUN";
            pos++;
            const char *error = parse_timeout(argv, argc, &pos, &p->timeout_ms);
            if (error) return error;
            pos--;
        } else if (str_is(word, "INPUTS")) {
            if (inputs_done) return "ERR Already encountered an INPUTS section in SCRIPTRUN";
            if (section == 1) return "ERR Already encountered an INPUTS keyword in SCRIPTRUN";
            section = 1;
        } else if (str_is(word, "OUTPUTS")) {
            if (section == 2) return "ERR Already encountered an OUTPUTS keyword in SCRIPTRUN";
            section = 2;
            inputs_done = 1;
        } else if (strcmp(str(word), "$") == 0) {
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
            char message[ERROR_MAX];
            snprintf(message, sizeof message,
                     "NOPERM user '%s' has no permission to %s %s key '%s' (a run needs read on its %s and inputs, "
                     "write on its outputs)",
                     str(name), (flags & REDISMODULE_CMD_KEY_UPDATE) ? "write" : "read", what, str(keys[i]),
                     "model or script");
            RedisModule_ReplyWithError(ctx, message);
            return 0;
        }
    }
    return 1;
}

static int execute(RedisModuleCtx *ctx, RedisModuleString **argv, int argc, int command) {
    const char *names[] = {"AI.MODELEXECUTE", "AI.SCRIPTRUN", "AI.SCRIPTEXECUTE"};
    Parsed p = {.variadic = -1};
    RedisModuleString **scratch = NULL;
    const char *error = command == KIND_MODEL    ? parse_modelexecute(argv, argc, &p)
                        : command == KIND_SCRIPT ? parse_scriptrun(argv, argc, &p, &scratch)
                                                 : parse_scriptexecute(argv, argc, &p);
    int result = REDISMODULE_OK;
    if (error) {
        RedisModule_ReplyWithError(ctx, error);
        goto done;
    }
    if (RedisModule_GetContextFlags(ctx) & REDISMODULE_CTX_FLAGS_DENY_BLOCKING) {
        char message[ERROR_MAX];
        snprintf(message, sizeof message,
                 "ERR %s waits for an execution worker and cannot run inside MULTI, a Lua script or a module call",
                 names[command]);
        RedisModule_ReplyWithError(ctx, message);
        goto done;
    }
    int stored = stored_kind(ctx, p.key);
    int wanted = p.kind == KIND_MODEL ? KIND_MODEL : KIND_SCRIPT;
    if (stored < 0) {
        RedisModule_ReplyWithError(ctx, wanted == KIND_MODEL ? "ERR model key is empty" : "ERR script key is empty");
        goto done;
    }
    if (stored != wanted) {
        RedisModule_ReplyWithError(ctx, REDISMODULE_ERRORMSG_WRONGTYPE);
        goto done;
    }
    RedisModuleString *user_name = RedisModule_GetCurrentUserName(ctx);
    RedisModuleUser *user = RedisModule_GetModuleUserFromUserName(user_name);
    if (user == NULL) {
        RedisModule_FreeString(NULL, user_name);
        RedisModule_ReplyWithError(ctx, "NOPERM the calling user no longer exists");
        goto done;
    }
    const char *what = wanted == KIND_MODEL ? "model" : "script";
    int allowed = check_keys(ctx, user, user_name, &p.key, 1, REDISMODULE_CMD_KEY_ACCESS, what) &&
                  check_keys(ctx, user, user_name, p.inputs, p.ninputs, REDISMODULE_CMD_KEY_ACCESS, "input") &&
                  check_keys(ctx, user, user_name, p.keys, p.nkeys, REDISMODULE_CMD_KEY_ACCESS, "KEYS") &&
                  check_keys(ctx, user, user_name, p.outputs, p.noutputs,
                             REDISMODULE_CMD_KEY_UPDATE | REDISMODULE_CMD_KEY_INSERT, "output");
    RedisModule_FreeModuleUser(user);
    if (!allowed) {
        RedisModule_FreeString(NULL, user_name);
        goto done;
    }
    Request *r = RedisModule_Calloc(1, sizeof *r);
    r->id = next_id++;
    r->kind = p.kind;
    r->variadic = p.variadic;
    r->batched = p.kind == KIND_MODEL && batches(ctx, p.key);
    r->key = hold(p.key);
    r->fn = p.fn ? hold(p.fn) : NULL;
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
    r->deadline = now_ms() + r->timeout_ms;
    r->bc = RedisModule_BlockClient(ctx, answer_reply, request_timeout, answer_free, r->timeout_ms);
    RedisModule_SetDisconnectCallback(r->bc, request_disconnected);
    blocked_set(r->bc, r);
    dispatch(r, 0);
done:
    RedisModule_Free(scratch);
    return result;
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

/* ---- worker commands ----------------------------------------------------------------------- */

static int parse_count(RedisModuleCtx *ctx, RedisModuleString *arg, long long min, long long *out, const char *what) {
    if (RedisModule_StringToLongLong(arg, out) != REDISMODULE_OK || *out < min) {
        char message[128];
        snprintf(message, sizeof message, "ERR %s must be an integer >= %lld", what, min);
        RedisModule_ReplyWithError(ctx, message);
        return 0;
    }
    return 1;
}

static void block_waiter(RedisModuleCtx *ctx, Waiter *w, long long block_ms) {
    w->bc = RedisModule_BlockClient(ctx, waiter_reply, waiter_timeout, waiter_free, block_ms);
    RedisModule_SetDisconnectCallback(w->bc, waiter_disconnected);
    blocked_set(w->bc, w);
    waiters_push(w);
}

/* SRIO.POP worker block-ms: the next request, waiting up to block-ms (0: not at all); nil if none. */
static int cmd_pop(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc != 3) return RedisModule_WrongArity(ctx);
    long long block_ms;
    if (!parse_count(ctx, argv[2], 0, &block_ms, "block-ms")) return REDISMODULE_OK;
    touch_worker(ctx, argv[1], -1);
    Request *r = queue_head;
    for (long long scanned = 0; r && claimed(r) && scanned < BATCH_SCAN_LIMIT; scanned++) r = r->next;
    if (r && !claimed(r)) {
        queue_unlink(r);
        deliver(r, argv[1], RedisModule_GetClientId(ctx));
        claim(r, argv[1]);
        reply_request(ctx, r, 1);
        return REDISMODULE_OK;
    }
    if (block_ms == 0 || (RedisModule_GetContextFlags(ctx) & REDISMODULE_CTX_FLAGS_DENY_BLOCKING))
        return RedisModule_ReplyWithNull(ctx);
    Waiter *w = RedisModule_Calloc(1, sizeof *w);
    w->worker = hold(argv[1]);
    w->got = RedisModule_Calloc(1, sizeof *w->got);
    block_waiter(ctx, w, block_ms);
    return REDISMODULE_OK;
}

/* SRIO.TAKE worker model max min wait-ms: up to max queued requests for model (a batch), waiting up
 * to wait-ms for at least min; an array, possibly empty. */
static int cmd_take(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc != 6) return RedisModule_WrongArity(ctx);
    long long max, min, wait_ms;
    if (!parse_count(ctx, argv[3], 1, &max, "max") || !parse_count(ctx, argv[4], 0, &min, "min") ||
        !parse_count(ctx, argv[5], 0, &wait_ms, "wait-ms"))
        return REDISMODULE_OK;
    touch_worker(ctx, argv[1], -1);
    Waiter *w = RedisModule_Calloc(1, sizeof *w);
    w->take = 1;
    w->worker = hold(argv[1]);
    w->key = hold(argv[2]);
    w->max = max;
    w->min = min;
    w->got = RedisModule_Calloc(max, sizeof *w->got);
    long long scanned = 0;
    for (Request *r = queue_head; r && w->ngot < max && scanned < BATCH_SCAN_LIMIT; scanned++) {
        Request *next = r->next;
        if (r->kind == KIND_MODEL && RedisModule_StringCompare(r->key, w->key) == 0) {
            queue_unlink(r);
            r->where = AT_WAITER;
            w->got[w->ngot++] = r;
        }
        r = next;
    }
    if (w->ngot >= min || w->ngot >= max || wait_ms == 0 ||
        (RedisModule_GetContextFlags(ctx) & REDISMODULE_CTX_FLAGS_DENY_BLOCKING)) {
        waiter_deliver(ctx, w);
        waiter_free_memory(w);
        return REDISMODULE_OK;
    }
    w->id = next_waiter_id++;
    RedisModule_DictSetC(gathering, &w->id, sizeof w->id, w);
    block_waiter(ctx, w, wait_ms + 1000);
    RedisModule_CreateTimer(ctx, wait_ms, take_timer, (void *)(intptr_t)w->id);
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
    if (key == NULL) return 0;
    int type = RedisModule_KeyType(key), found = type == REDISMODULE_KEYTYPE_MODULE;
    if (type == REDISMODULE_KEYTYPE_STRING) {
        size_t len;
        const char *value = RedisModule_StringDMA(key, &len, REDISMODULE_READ);
        found = len >= strlen(MANIFEST_PREFIX) && memcmp(value, MANIFEST_PREFIX, strlen(MANIFEST_PREFIX)) == 0;
    }
    RedisModule_CloseKey(key);
    return found;
}

static int is_output_of(Request *r, RedisModuleString *key) {
    for (int i = 0; i < r->noutputs; i++)
        if (RedisModule_StringCompare(r->outputs[i], key) == 0) return 1;
    return 0;
}

/* SRIO.REPLY worker id duration-us samples calls OK [key value]...  |  ... ERROR message
 * Stores the outputs and answers the caller in one step; an output that holds a model or script
 * is refused (the caller gets the error, nothing is written). Replies the first HEAD_BYTES of what
 * each output held (nil: nothing), or nil when the request no longer waits (nothing is written). */
static int cmd_reply(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc < 7) return RedisModule_WrongArity(ctx);
    long long duration, samples, calls;
    if (!parse_count(ctx, argv[3], 0, &duration, "duration-us") || !parse_count(ctx, argv[4], 0, &samples, "samples") ||
        !parse_count(ctx, argv[5], 0, &calls, "calls"))
        return REDISMODULE_OK;
    int ok = str_is(argv[6], "OK");
    if (!ok && !(str_is(argv[6], "ERROR") && argc == 8)) return RedisModule_ReplyWithError(ctx, "ERR syntax: OK [key value]... or ERROR message");
    if (ok && (argc - 7) % 2) return RedisModule_ReplyWithError(ctx, "ERR OK takes key value pairs");
    Request *r = inflight_of(argv[1], argv[2]);
    touch_worker(ctx, argv[1], -1);
    if (r == NULL) return RedisModule_ReplyWithNull(ctx);
    unclaim(r->key, argv[1]); /* answered without gathering a batch (or after it) */
    if (calls) {
        SRIO_ExecStats *s = stats_of(r->key, 1);
        s->duration_us += duration;
        s->samples += samples;
        s->calls += calls;
    }
    end_flight(r);
    if (r->bc == NULL) {
        free_request(r);
        return RedisModule_ReplyWithNull(ctx);
    }
    if (!ok) {
        size_t len;
        const char *message = RedisModule_StringPtrLen(argv[7], &len);
        answer(r, message, len);
        free_request(r);
        return RedisModule_ReplyWithSimpleString(ctx, "OK");
    }
    int n = (argc - 7) / 2;
    for (int i = 0; i < n; i++) {
        RedisModuleString *key = argv[7 + 2 * i];
        char message[ERROR_MAX];
        int refused = 0;
        if (!is_output_of(r, key)) {
            snprintf(message, sizeof message, "ERR the worker replied with key '%s', which is not an output of the request",
                     str(key));
            refused = 1;
        } else if (holds_model(ctx, key)) {
            snprintf(message, sizeof message, "ERR output key '%s' holds a model or script; a run does not replace it",
                     str(key));
            refused = 1;
        }
        if (refused) {
            answer(r, message, strlen(message));
            free_request(r);
            return RedisModule_ReplyWithError(ctx, message);
        }
    }
    RedisModule_ReplyWithArray(ctx, n);
    for (int i = 0; i < n; i++) {
        RedisModuleString *key = argv[7 + 2 * i];
        RedisModuleKey *old = RedisModule_OpenKey(ctx, key, REDISMODULE_READ);
        if (old && RedisModule_KeyType(old) == REDISMODULE_KEYTYPE_STRING) {
            size_t len;
            const char *value = RedisModule_StringDMA(old, &len, REDISMODULE_READ);
            RedisModule_ReplyWithStringBuffer(ctx, value, len < HEAD_BYTES ? len : HEAD_BYTES);
        } else {
            RedisModule_ReplyWithNull(ctx);
        }
        if (old) RedisModule_CloseKey(old);
        RedisModuleCallReply *set = RedisModule_Call(ctx, "SET", "!ss", key, argv[8 + 2 * i]);
        if (set) RedisModule_FreeCallReply(set);
    }
    answer(r, NULL, 0);
    free_request(r);
    return REDISMODULE_OK;
}

/* SRIO.RETURN worker id: hand back a request taken but not run; it goes to the head of the queue. */
static int cmd_return(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc != 3) return RedisModule_WrongArity(ctx);
    Request *r = inflight_of(argv[1], argv[2]);
    if (r == NULL) return RedisModule_ReplyWithNull(ctx);
    end_flight(r);
    requeue(r, 0, "returned it");
    return RedisModule_ReplyWithSimpleString(ctx, "OK");
}

/* SRIO.PAUSE worker: answer the worker's waiting pops here with nil (it is busy with another shard's request). */
static int cmd_pause(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc != 2) return RedisModule_WrongArity(ctx);
    return RedisModule_ReplyWithLongLong(ctx, release_waiters_of(argv[1]));
}

/* SRIO.HEARTBEAT worker pid: register the worker, or keep it registered. */
static int cmd_heartbeat(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc != 3) return RedisModule_WrongArity(ctx);
    long long pid;
    if (!parse_count(ctx, argv[2], 0, &pid, "pid")) return REDISMODULE_OK;
    touch_worker(ctx, argv[1], pid);
    return RedisModule_ReplyWithSimpleString(ctx, "OK");
}

/* SRIO.UNREGISTER worker: leave; requests it holds go back to the queue (not counted as a death). */
static int cmd_unregister(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc != 2) return RedisModule_WrongArity(ctx);
    release_waiters_of(argv[1]);
    unclaim_all(argv[1]);
    Request **held;
    long long n = take_inflight(0, argv[1], &held);
    for (long long i = n - 1; i >= 0; i--) requeue(held[i], 0, "stopped");
    RedisModule_Free(held);
    forget_worker(argv[1]);
    return RedisModule_ReplyWithLongLong(ctx, n);
}

/* SRIO.WORKERS: [name, pid, requests in flight, waiting (0/1), ms since its last sign of life] per worker. */
static int cmd_workers(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    (void)argv;
    if (argc != 1) return RedisModule_WrongArity(ctx);
    long long now = now_ms();
    RedisModule_ReplyWithArray(ctx, RedisModule_DictSize(workers));
    RedisModuleDictIter *it = RedisModule_DictIteratorStartC(workers, "^", NULL, 0);
    Worker *w;
    while (RedisModule_DictNextC(it, NULL, (void **)&w)) {
        long long busy = 0, waiting = 0;
        RedisModuleDictIter *requests = RedisModule_DictIteratorStartC(inflight, "^", NULL, 0);
        Request *r;
        while (RedisModule_DictNextC(requests, NULL, (void **)&r))
            if (RedisModule_StringCompare(r->worker, w->name) == 0) busy++;
        RedisModule_DictIteratorStop(requests);
        for (Waiter *x = waiters_head; x; x = x->next)
            if (RedisModule_StringCompare(x->worker, w->name) == 0) waiting = 1;
        RedisModule_ReplyWithArray(ctx, 5);
        RedisModule_ReplyWithString(ctx, w->name);
        RedisModule_ReplyWithLongLong(ctx, w->pid);
        RedisModule_ReplyWithLongLong(ctx, busy);
        RedisModule_ReplyWithLongLong(ctx, waiting);
        RedisModule_ReplyWithLongLong(ctx, now - w->beat);
    }
    RedisModule_DictIteratorStop(it);
    return REDISMODULE_OK;
}

/* ---- registration -------------------------------------------------------------------------- */

int SRIO_ExecGetStats(RedisModuleString *key, SRIO_ExecStats *out) {
    SRIO_ExecStats *s = stats ? stats_of(key, 0) : NULL;
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
    SRIO_ExecStats *s = map_take(stats, name, len);
    if (s) RedisModule_Free(s);
}

void SRIO_ExecSetDefaultTimeout(long long ms) {
    if (ms > 0) default_timeout_ms = ms;
}

static int create(RedisModuleCtx *ctx, const char *name, RedisModuleCmdFunc fn, const char *flags, int first_key) {
    if (RedisModule_CreateCommand(ctx, name, fn, flags, first_key, first_key, first_key) != REDISMODULE_OK)
        return REDISMODULE_ERR;
    if (!first_key) return REDISMODULE_OK;
    /* The model or script key is read (the legacy key range would ask for write access too). Inputs
     * and outputs are checked here against the caller's ACL; they are not declared, so that in a
     * cluster they may live on other shards (the worker reads and writes those itself). */
    RedisModuleCommandKeySpec specs[] = {
        {.flags = REDISMODULE_CMD_KEY_RO | REDISMODULE_CMD_KEY_ACCESS,
         .begin_search_type = REDISMODULE_KSPEC_BS_INDEX,
         .bs.index.pos = 1,
         .find_keys_type = REDISMODULE_KSPEC_FK_RANGE,
         .fk.range = {0, 1, 0}},
        {0}};
    RedisModuleCommandInfo info = {.version = REDISMODULE_COMMAND_INFO_VERSION, .arity = -3, .key_specs = specs};
    RedisModuleCommand *command = RedisModule_GetCommand(ctx, name);
    if (command == NULL || RedisModule_SetCommandInfo(command, &info) != REDISMODULE_OK) return REDISMODULE_ERR;
    return REDISMODULE_OK;
}

int SRIO_ExecRegister(RedisModuleCtx *ctx) {
    inflight = RedisModule_CreateDict(NULL);
    blocked = RedisModule_CreateDict(NULL);
    workers = RedisModule_CreateDict(NULL);
    stats = RedisModule_CreateDict(NULL);
    gathering = RedisModule_CreateDict(NULL);
    claims = RedisModule_CreateDict(NULL);
    if (create(ctx, "ai.modelexecute", cmd_modelexecute, "write deny-oom", 1) != REDISMODULE_OK ||
        create(ctx, "ai.scriptexecute", cmd_scriptexecute, "write deny-oom", 1) != REDISMODULE_OK ||
        create(ctx, "ai.scriptrun", cmd_scriptrun, "write deny-oom", 1) != REDISMODULE_OK ||
        create(ctx, "srio.pop", cmd_pop, "write", 0) != REDISMODULE_OK ||
        create(ctx, "srio.take", cmd_take, "write", 0) != REDISMODULE_OK ||
        create(ctx, "srio.reply", cmd_reply, "write", 0) != REDISMODULE_OK ||
        create(ctx, "srio.return", cmd_return, "write fast", 0) != REDISMODULE_OK ||
        create(ctx, "srio.pause", cmd_pause, "write fast", 0) != REDISMODULE_OK ||
        create(ctx, "srio.heartbeat", cmd_heartbeat, "write fast", 0) != REDISMODULE_OK ||
        create(ctx, "srio.unregister", cmd_unregister, "write", 0) != REDISMODULE_OK ||
        create(ctx, "srio.workers", cmd_workers, "readonly", 0) != REDISMODULE_OK)
        return REDISMODULE_ERR;
    if (RedisModule_SubscribeToServerEvent(ctx, RedisModuleEvent_ClientChange, client_change) != REDISMODULE_OK)
        return REDISMODULE_ERR;
    RedisModule_CreateTimer(ctx, REAP_INTERVAL_MS, reap, NULL);
    return REDISMODULE_OK;
}
