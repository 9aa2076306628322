/* The execution half of the smartredis_io Redis module.
 *
 * Clients send RedisAI's AI.MODELEXECUTE, AI.SCRIPTEXECUTE and AI.SCRIPTRUN (execute.c). Each
 * request is checked against the caller's ACL (read on the model or script and on every input, write
 * on every output), carries the caller's user name, and waits in this server's memory while the
 * caller is blocked (the client, never the server) until its deadline (queue.c). Execution workers
 * (`python -m smartredis_io.worker`) take requests with SRIO.POP / SRIO.TAKE (dispatch.c; batching
 * claims in claims.c) and answer them with SRIO.REPLY, which stores the outputs and unblocks the
 * caller in one step (workers.c). The queue, the requests in flight, the workers and their
 * statistics live here and in no key, so no client user can read, forge or delete them; the worker
 * commands serve only connections that said SRIO.HELLO with the worker secret, whatever the ACLs.
 * A worker whose connection closes, or whose heartbeat stops for HEARTBEAT_TTL_MS, has its requests
 * run once more on another worker, then answered with an error.
 *
 * Every pointer below is touched from the server's main thread only.
 */
#ifndef SRIO_EXEC_H
#define SRIO_EXEC_H

#include "srio.h"

#define MAX_ATTEMPTS 2          /* a request whose worker dies runs once more */
#define HEARTBEAT_TTL_MS 3000   /* a worker silent this long is dead */
#define REAP_INTERVAL_MS 250    /* how often silent workers and stale requests are looked for */
#define BATCH_SCAN_LIMIT 1024   /* queued requests one SRIO.POP / SRIO.TAKE looks at */
#define MAX_WAIT_MS (24LL * 3600 * 1000) /* SRIO.POP / SRIO.TAKE wait at most this long */
#define MAX_TAKE 65536          /* SRIO.TAKE gathers at most this many requests */
#define ERROR_MAX 512

enum { KIND_MODEL, KIND_SCRIPT, KIND_SCRIPT_LISTS };
extern const char *const SRIO_KindNames[];  /* as workers receive them */
extern const char *const SRIO_KindWords[];  /* "model" or "script", for messages */
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
    long long deadline;  /* RedisModule_Milliseconds() */
    long long timeout_ms;
    long long queued_at; /* when it was last queued (the queue deadline counts from there) */
    unsigned long long owner;     /* client id of the worker connection running it */
    RedisModuleBlockedClient *bc; /* the caller; NULL once answered or gone */
    struct Request *prev, *next;  /* queue links */
} Request;

/* A worker blocked in SRIO.POP (one request) or SRIO.TAKE (gathering a batch of one model). */
typedef struct Waiter {
    RedisModuleBlockedClient *bc;
    RedisModuleString *worker;
    int take;
    RedisModuleString *key; /* SRIO.TAKE's model */
    long long max, min;
    Request **got;
    long long ngot, cap;
    int delivered;
    int released;  /* unblocked (answered, timed out or gone): in no list any more */
    long long id;  /* a gathering SRIO.TAKE: its key in the gathering dict, ended by its own timer */
    struct Waiter *prev, *next;
} Waiter;

/* ---- queue.c: requests, the queue, answering callers -------------------------------------- */

long long SRIO_Now(void);
RedisModuleString *SRIO_Hold(RedisModuleString *s);
void SRIO_RequestFree(Request *r);
void SRIO_QueuePush(Request *r, int at_head);
void SRIO_QueueUnlink(Request *r);
Request *SRIO_QueueHead(void);
long long SRIO_QueueLength(void);
/* Block the caller of `r` until it is answered or its deadline passes. */
void SRIO_RequestBlock(RedisModuleCtx *ctx, Request *r);
/* Unblock the caller of `r` with OK (error == NULL) or the error; a no-op once it is gone. */
void SRIO_Answer(Request *r, const char *error, size_t error_len);
void SRIO_Answerf(Request *r, const char *format, ...) __attribute__((format(printf, 2, 3)));
/* A request whose worker died or stopped: run again (the first time a worker dies running it), or
 * answered with an error. `died`: 0 when the worker handed it back without running it to the end. */
void SRIO_Requeue(Request *r, int died, const char *why);
/* Answer the queued requests no worker can take: none registered past the start-up window, or
 * queued longer than QUEUE_TIMEOUT. */
void SRIO_QueueExpire(void);
SRIO_ExecStats *SRIO_StatsOf(RedisModuleString *key, int create);
void SRIO_QueueInit(void);

/* ---- dispatch.c: handing requests to waiting workers -------------------------------------- */

/* Give `r` to a waiting worker, or queue it (at the head: a request that ran before). */
void SRIO_Dispatch(Request *r, int at_head);
/* Hand queued requests to waiting workers (after a claim ended, requests it held back may go). */
void SRIO_Kick(void);
/* `r` is now run by the worker `name` on connection `owner`. */
void SRIO_Deliver(Request *r, RedisModuleString *name, unsigned long long owner);
/* Reply `r` as a worker receives it (docs/smartredis.md, "The worker protocol"). */
void SRIO_ReplyRequest(RedisModuleCtx *ctx, Request *r, int with_manifest);
Waiter *SRIO_WaiterNew(RedisModuleString *worker, int take, RedisModuleString *key, long long max, long long min);
/* Reply what the waiter holds and free it (it never blocked). */
void SRIO_WaiterAnswerNow(RedisModuleCtx *ctx, Waiter *w);
/* Block the worker's connection until the waiter gets requests or block_ms pass (a gathering
 * SRIO.TAKE: until it has enough, or its own timer after wait_ms). */
void SRIO_WaiterBlock(RedisModuleCtx *ctx, Waiter *w, long long block_ms, long long wait_ms);
/* Add a request to a waiter's (SRIO.TAKE's) batch. */
void SRIO_WaiterAdd(Waiter *w, Request *r);
/* Release every waiting pop or gather of the worker `name` (a paused pop answers nil). */
long long SRIO_ReleaseWaitersOf(RedisModuleString *name);
/* Whether the worker `name` has a pop or gather waiting. */
int SRIO_IsWaiting(RedisModuleString *name);
void SRIO_DispatchInit(void);

/* ---- claims.c: a worker about to gather a batch holds its model's requests ----------------- */

/* The worker `worker` takes `r`: if its model batches, the model's next requests wait for that worker. */
void SRIO_Claim(Request *r, RedisModuleString *worker);
/* End the claim on `key` if `worker` holds it (NULL: whoever holds it); the requests it held back go on. */
void SRIO_Unclaim(RedisModuleString *key, RedisModuleString *worker);
/* End every claim `worker` holds (it died or left). */
void SRIO_UnclaimAll(RedisModuleString *worker);
/* Whether `r` waits for another worker's batch. */
int SRIO_Claimed(Request *r);
void SRIO_ClaimsInit(void);

/* ---- workers.c: the registry of workers ---------------------------------------------------- */

/* Keep `r` as run by its worker until it answers, hands it back or dies. */
void SRIO_InflightAdd(Request *r);
/* How many workers are registered. */
unsigned long long SRIO_WorkerCount(void);
/* How many registered workers have asked for requests, and since when (SRIO_Now()) at least one has:
 * QUEUE_TIMEOUT counts from then. */
unsigned long long SRIO_ServingCount(void);
long long SRIO_ServingSince(void);
/* Whether a request with no worker registered fails at once (the module's workers cannot start,
 * or no worker is coming), rather than waiting for one: the module's workers are starting (within
 * the request's deadline), or the last worker died and is being replaced (WORKER_STARTUP_MS). */
int SRIO_NoWorkerComing(void);
/* Why no worker is registered, for the error a request then gets. */
const char *SRIO_NoWorkerHint(void);

/* ---- spawn.c: the workers the module starts ------------------------------------------------- */

/* Whether the module's workers are starting: none of them registered yet, and nothing failed or
 * refused; requests wait for them within their own deadline. */
int SRIO_SpawnStarting(void);
/* Why the module's workers cannot start ("" when nothing failed): a refusal, for good, or the last
 * start's error, until one of its workers registers. */
const char *SRIO_SpawnError(void);
/* Whether the module's last start failed (not refused) and none of its workers registered since. */
int SRIO_SpawnFailed(void);
/* For INFO srio: off (WORKERS 0), refused, failed, replica, starting or ok. */
const char *SRIO_SpawnState(void);
/* The interpreter of the last start ("" before the first). */
const char *SRIO_SpawnPython(void);
/* The supervisor's pid (0: none). */
long long SRIO_SupervisorPid(void);
/* A worker registered with this pid (one of the module's, when its parent is the supervisor). */
void SRIO_SpawnWorkerSeen(long long pid);

/* ---- registration -------------------------------------------------------------------------- */

int SRIO_RegisterExecuteCommands(RedisModuleCtx *ctx);
int SRIO_RegisterWorkerCommands(RedisModuleCtx *ctx);

#endif
