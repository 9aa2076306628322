/* Batching claims: model key -> name of the worker that took a request for it and is about to
 * gather a batch (SRIO.TAKE). Until then, other requests for that model wait for that worker rather
 * than go to other workers, as RedisAI batches them (see exec.h). */
#include "exec.h"

static RedisModuleDict *claims;

void SRIO_ClaimsInit(void) { claims = RedisModule_CreateDict(NULL); }

static RedisModuleString *claim_of(RedisModuleString *key) {
    size_t len;
    const char *name = RedisModule_StringPtrLen(key, &len);
    return RedisModule_DictGetC(claims, (void *)name, len, NULL);
}

void SRIO_Claim(Request *r, RedisModuleString *worker) {
    if (!r->batched || claim_of(r->key)) return;
    size_t len;
    const char *name = RedisModule_StringPtrLen(r->key, &len);
    RedisModule_DictSetC(claims, (void *)name, len, SRIO_Hold(worker));
}

void SRIO_Unclaim(RedisModuleString *key, RedisModuleString *worker) {
    RedisModuleString *holder = claim_of(key);
    if (holder == NULL || (worker && RedisModule_StringCompare(holder, worker) != 0)) return;
    size_t len;
    const char *name = RedisModule_StringPtrLen(key, &len);
    RedisModule_DictDelC(claims, (void *)name, len, NULL);
    RedisModule_FreeString(NULL, holder);
    SRIO_Kick();
}

void SRIO_UnclaimAll(RedisModuleString *worker) {
    RedisModuleString **keys = NULL;
    long long n = 0, cap = 0;
    RedisModuleDictIter *it = RedisModule_DictIteratorStartC(claims, "^", NULL, 0);
    char *name;
    size_t len;
    RedisModuleString *holder;
    while ((name = RedisModule_DictNextC(it, &len, (void **)&holder))) {
        if (RedisModule_StringCompare(holder, worker) != 0) continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 8;
            keys = RedisModule_Realloc(keys, sizeof *keys * (size_t)cap);
        }
        keys[n++] = RedisModule_CreateString(NULL, name, len);
    }
    RedisModule_DictIteratorStop(it);
    for (long long i = 0; i < n; i++) {
        SRIO_Unclaim(keys[i], worker);
        RedisModule_FreeString(NULL, keys[i]);
    }
    RedisModule_Free(keys);
}

int SRIO_Claimed(Request *r) { return r->kind == KIND_MODEL && claim_of(r->key) != NULL; }
