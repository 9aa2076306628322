/* The smartredis_io Redis module: what its source files share.
 *
 * The module serves RedisAI's commands on a stock redis-server, over smartredis_io's own storage
 * (smartredis_io/wire.py and smartredis_io/protocol.py), so that SmartRedis clients in C, C++, Fortran
 * and Python and smartredis_io share one database:
 *
 * - a tensor is a Redis string: a header (magic "SRT1", layout, dtype code, ndim, the shape as
 *   little-endian u64) then the raw little-endian C-order bytes. A value too large for one string
 *   (the bulk limit) is chunked: its header also carries the chunk count, the CRC-32 of the payload,
 *   the payload's size and a 16-byte version, and the chunks are the strings
 *   tagged_key(key, ".chunk.<version hex>.<i>") on the key's slot;
 * - a model or script key holds a JSON manifest (kind, version, backend, device, batching, tag,
 *   inputs, outputs, blob) and its bytes are a uint8 tensor at tagged_key(key, ".blob.<version>")
 *   (or at the key named by "blob", for an alias of another model).
 *
 * Only APIs of Redis 7.0 are used (tests/smartredis_io/test_redis_module.py checks the list).
 */
#ifndef SRIO_H
#define SRIO_H

#include <stddef.h>
#include <stdint.h>

#include "redismodule.h"

#define SRIO_EXPORT __attribute__((visibility("default")))

/* ---- tensor values (smartredis_io/wire.py) ------------------------------------------------ */

#define SRIO_MAGIC "SRT1"
#define SRIO_MAX_NDIM 32
#define SRIO_FIXED_BYTES 8   /* magic, layout, dtype code, ndim, reserved */
#define SRIO_CHUNKS_BYTES 32 /* chunk count (u32), CRC-32 (u32), payload bytes (u64), version (16) */
#define SRIO_HEADER_MAX_BYTES (SRIO_FIXED_BYTES + 8 * SRIO_MAX_NDIM + SRIO_CHUNKS_BYTES)
#define SRIO_MAX_CHUNKS (1u << 20)
#define SRIO_VERSION_BYTES 16
#define SRIO_LAYOUT_INLINE 0
#define SRIO_LAYOUT_CHUNKED 1
#define SRIO_DEFAULT_BULK_LIMIT (512ull << 20) /* Redis' proto-max-bulk-len */

/* dtype codes of the wire format */
enum {
    SRIO_DOUBLE = 1, SRIO_FLOAT = 2, SRIO_INT8 = 3, SRIO_INT16 = 4, SRIO_INT32 = 5, SRIO_INT64 = 6,
    SRIO_UINT8 = 7, SRIO_UINT16 = 8, SRIO_FLOAT16 = 9, SRIO_BOOL = 10, SRIO_BFLOAT16 = 11,
    SRIO_DTYPE_MAX = 11
};

typedef struct SRIO_Header {
    int code;                    /* dtype code */
    int ndim;
    uint64_t shape[SRIO_MAX_NDIM];
    size_t size;                 /* bytes of the header itself */
    uint32_t chunks;             /* 0: inline */
    uint32_t crc;                /* chunked: CRC-32 of the payload */
    uint64_t payload;            /* chunked: bytes of the payload */
    unsigned char version[SRIO_VERSION_BYTES];
    uint64_t nbytes;             /* bytes the shape and dtype call for */
} SRIO_Header;

/* A piece of a value's payload, for writes that gather several buffers. */
typedef struct SRIO_Part {
    const char *ptr;
    size_t len;
} SRIO_Part;

/* Outcome of reading a key */
enum {
    SRIO_OK = 0,
    SRIO_EMPTY = 1,      /* no such key */
    SRIO_WRONGTYPE = 2,  /* not a string, or a string that is not a tensor / manifest */
    SRIO_CORRUPT = 3     /* a tensor whose header and stored bytes disagree (message in err) */
};

/* printf into a new string (free with RedisModule_Free) */
char *SRIO_Format(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* The bulk limit: values whose header plus payload exceed it are chunked (module argument
 * BULK_LIMIT_BYTES; default 512 MiB, the largest Redis string a client may send). */
extern uint64_t SRIO_BulkLimit;

int SRIO_DtypeItemsize(int code);
/* RedisAI's name of a dtype (FLOAT, DOUBLE, ...); FLOAT16 and BFLOAT16 are smartredis_io's own. */
const char *SRIO_DtypeName(int code);
/* The code of a RedisAI type name (case-insensitive), 0 if unknown. */
int SRIO_DtypeFromName(const char *name, size_t len);

/* Parse a header; SRIO_OK, SRIO_WRONGTYPE (not a tensor) or SRIO_CORRUPT (impossible shape). */
int SRIO_HeaderDecode(const char *buf, size_t len, SRIO_Header *h);
/* Write a header into out (SRIO_HEADER_MAX_BYTES); returns its size. chunks == 0: inline. */
size_t SRIO_HeaderEncode(char *out, int code, int ndim, const uint64_t *shape, uint32_t chunks, uint32_t crc,
                         uint64_t payload, const unsigned char *version);

/* tagged_key(key, suffix) of smartredis_io.wire: a key on the slot of `key` (its hash tag kept,
 * or "{key}" made the tag) followed by suffix. */
RedisModuleString *SRIO_TaggedKey(RedisModuleCtx *ctx, RedisModuleString *key, const char *suffix, size_t suffix_len);

uint32_t SRIO_Crc32(uint32_t crc, const void *buf, size_t len);

/* A tensor read from the keyspace. `data` points into the key's value (inline) or into `owned`
 * (chunked, checked against its CRC); valid until SRIO_TensorClose. */
typedef struct SRIO_Tensor {
    SRIO_Header h;
    RedisModuleKey *key;
    const char *data;
    char *owned;
} SRIO_Tensor;

/* Open the tensor at `keyname`. Returns SRIO_OK (then call SRIO_TensorClose), SRIO_EMPTY,
 * SRIO_WRONGTYPE or SRIO_CORRUPT (with a message in err, an allocated string to free with
 * RedisModule_Free). */
int SRIO_TensorOpen(RedisModuleCtx *ctx, RedisModuleString *keyname, SRIO_Tensor *t, char **err);
void SRIO_TensorClose(SRIO_Tensor *t);

/* Store a tensor (the payload gathered from `parts`, nbytes in all) at `keyname`, replacing any
 * value there (the caller has checked its type) and removing the chunks of a replaced tensor;
 * chunked when larger than the bulk limit. The key ends without an expiry, like SET. */
int SRIO_TensorWrite(RedisModuleCtx *ctx, RedisModuleString *keyname, int code, int ndim, const uint64_t *shape,
                     const SRIO_Part *parts, size_t nparts);

/* Delete the tensor at `keyname` with its chunks; 1 if a key was removed. */
int SRIO_TensorDelete(RedisModuleCtx *ctx, RedisModuleString *keyname);

/* Whether the value of an open key is a string starting with the tensor magic / a manifest. */
int SRIO_KeyHoldsTensor(RedisModuleKey *key);
int SRIO_KeyHoldsManifest(RedisModuleKey *key);

/* ---- models and scripts (smartredis_io/protocol.py) ----------------------------------------- */

#define SRIO_MANIFEST_PREFIX "{\"kind\": "
#define SRIO_VERSION_HEX 32

typedef struct SRIO_Manifest {
    char *kind;       /* "model" or "script" */
    char *version;
    char *backend;
    char *device;
    long long batch_size;
    long long min_batch_size;
    long long min_batch_timeout;
    char *tag;
    size_t tag_len;
    char **inputs;
    size_t ninputs;
    char **outputs;
    size_t noutputs;
    char *blob;       /* an alias's blob key; "" when the manifest owns its blob */
    size_t blob_len;
} SRIO_Manifest;

/* Read the manifest at `keyname`: SRIO_OK (free it with SRIO_ManifestFree), SRIO_EMPTY or
 * SRIO_WRONGTYPE (the key holds something else). */
int SRIO_ManifestRead(RedisModuleCtx *ctx, RedisModuleString *keyname, SRIO_Manifest *m);
/* Parse a manifest's JSON; SRIO_OK or SRIO_WRONGTYPE. */
int SRIO_ManifestParse(const char *json, size_t len, SRIO_Manifest *m);
void SRIO_ManifestFree(SRIO_Manifest *m);
/* The JSON of a manifest, as smartredis_io writes it (json.dumps of protocol.Manifest); NULL when a
 * string field is not UTF-8 text. Free with RedisModule_Free. */
char *SRIO_ManifestJson(const SRIO_Manifest *m, size_t *len);
/* The key of the blob a manifest stored at `keyname` points to. */
RedisModuleString *SRIO_ManifestBlobKey(RedisModuleCtx *ctx, RedisModuleString *keyname, const SRIO_Manifest *m);
/* A fresh version id: 32 lowercase hex characters (and a terminating NUL). */
void SRIO_NewVersion(char out[SRIO_VERSION_HEX + 1]);

/* Whether s is UTF-8 text */
int SRIO_IsUtf8(const char *s, size_t len);

/* ---- statistics of runs ------------------------------------------------------------------------ */

/* What the execution half (exec.c) counts for one model or script key: RedisAI's AI.INFO fields. */
typedef struct SRIO_ExecStats {
    long long duration_us; /* time spent running it, in microseconds */
    long long samples;     /* rows of the first input (a batch counts all its rows) */
    long long calls;       /* runs (a batch is one run) */
    long long errors;      /* requests answered with an error, timeouts included */
} SRIO_ExecStats;

/* The statistics of `key`; 0 (and zeros in `out`) when nothing was counted for it. */
int SRIO_ExecGetStats(RedisModuleString *key, SRIO_ExecStats *out);
/* Forget the statistics of `key` (AI.INFO key RESETSTAT, a model or script stored again or deleted). */
void SRIO_ExecResetStats(RedisModuleString *key);

/* ---- replies and registration --------------------------------------------------------------- */

/* Reply with the error of a failed read of `keyname` (RedisAI's wording for `what`: "tensor",
 * "model" or "script"). */
int SRIO_ReplyReadError(RedisModuleCtx *ctx, int status, const char *what, char *err);

/* Create a command with one key (argument 1) and its key spec. */
int SRIO_CreateKeyCommand(RedisModuleCtx *ctx, const char *name, RedisModuleCmdFunc fn, const char *flags,
                          int arity, uint64_t key_flags);

/* Whether the calling user may access `keyname` with `flags` (REDISMODULE_CMD_KEY_ACCESS, ...):
 * for keys the module reads or writes on the user's behalf beyond the command's own key. */
int SRIO_UserMayAccess(RedisModuleCtx *ctx, RedisModuleString *keyname, int flags);

int SRIO_RegisterTensorCommands(RedisModuleCtx *ctx);
int SRIO_RegisterModelCommands(RedisModuleCtx *ctx);
int SRIO_RegisterAdminCommands(RedisModuleCtx *ctx);
/* The module's load-time arguments (name value pairs); REDISMODULE_ERR after logging a bad one. */
int SRIO_Configure(RedisModuleCtx *ctx, RedisModuleString **argv, int argc);

/* AI.CONFIG's MODEL_CHUNK_SIZE: AI.MODELGET replies with the blob split in chunks of this size. */
extern long long SRIO_ModelChunkSize;

#endif
