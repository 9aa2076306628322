/* The smartredis_io Redis module: what its source files share.
 *
 * The module serves RedisAI's commands on a stock redis-server, over smartredis_io's own storage
 * (smartredis_io/_client/wire.py and smartredis_io/_client/protocol.py), so that SmartRedis clients
 * in C, C++, Fortran and Python and smartredis_io share one database:
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
 * Every size a client sends is checked before it is used, and nothing is allocated for what a
 * client only claims: a tensor's bytes are at most SRIO_Config.max_tensor_bytes, a stored value
 * costs what is stored, a manifest is parsed within SRIO_MANIFEST_MAX_BYTES and
 * SRIO_MANIFEST_MAX_DEPTH. Writes are replicated as the plain commands that reproduce them, so
 * replicas and the AOF hold the same keys as this server.
 *
 * Only APIs of Redis 7.0 are used (tests/smartredis_io/test_redis_module.py checks the list).
 */
#ifndef SRIO_H
#define SRIO_H

#include <stddef.h>
#include <stdint.h>

#include "redismodule.h"

#ifdef SRIO_SANITIZE
/* The sanitizer build allocates from the C library, where AddressSanitizer sees every access
 * (Redis' own allocator is not instrumented). */
#include <stdlib.h>
#include <string.h>
#define RedisModule_Alloc(n) malloc(n)
#define RedisModule_Calloc(n, size) calloc((n), (size))
#define RedisModule_Realloc(p, n) realloc((p), (n))
#define RedisModule_Free(p) free(p)
#define RedisModule_Strdup(s) strdup(s)
#endif

#define SRIO_EXPORT __attribute__((visibility("default")))

/* ---- settings (config.c): the module's load-time arguments -------------------------------- */

/* A worker secret is 16 to 256 bytes of printable ASCII without spaces (0x21 to 0x7e), the rule
 * smartredis_io.worker.worker_protocol.secret_from_line applies on the Python side. */
#define SRIO_SECRET_MIN 16
#define SRIO_SECRET_MAX 256
#define SRIO_MAX_WORKERS 64

typedef struct SRIO_Settings {
    uint64_t bulk_limit;           /* BULK_LIMIT_BYTES: larger values are chunked */
    uint64_t max_tensor_bytes;     /* MAX_TENSOR_BYTES; 0: Redis' proto-max-bulk-len */
    long long model_chunk_size;    /* MODEL_CHUNK_SIZE: AI.MODELGET's pieces */
    char *backends_path;           /* BACKENDSPATH (reported by AI.CONFIG GET) */
    int workers;                   /* WORKERS (or THREADS_PER_QUEUE): processes the module starts */
    char *worker_python;           /* WORKER_PYTHON, $SRIO_WORKER_PYTHON; NULL: found next to the module */
    char *worker_device;           /* WORKER_DEVICE: cpu, cuda or cuda:N */
    char *worker_user;             /* WORKER_USER, $SRIO_WORKER_USER; NULL: the server's own user */
    long long worker_uid, worker_gid; /* worker_user's ids, checked at load (-1: no worker_user) */
    int threads;                   /* INTRA_OP_PARALLELISM: the workers' --threads (0: their default) */
    int interop_threads;           /* INTER_OP_PARALLELISM: --interop-threads (0: their default) */
    long long execution_timeout_ms; /* MODEL_EXECUTION_TIMEOUT: caps a run's deadline (0: none) */
    long long queue_timeout_ms;    /* QUEUE_TIMEOUT: a request no worker takes this long fails */
    long long startup_ms;          /* WORKER_STARTUP_MS: how long requests wait for starting workers */
    unsigned char secret[SRIO_SECRET_MAX]; /* what SRIO.HELLO must say */
    size_t secret_len;
} SRIO_Settings;

extern SRIO_Settings SRIO_Config;

/* Whether `len` bytes at `s` make a worker secret (see SRIO_SECRET_MIN). */
int SRIO_SecretValid(const unsigned char *s, size_t len);

/* Parse the module's arguments (NAME value pairs, keywords case-insensitive) into SRIO_Config and
 * read or make the worker secret; REDISMODULE_ERR after logging why. */
int SRIO_Configure(RedisModuleCtx *ctx, RedisModuleString **argv, int argc);
/* The largest tensor a client may store: MAX_TENSOR_BYTES, else Redis' proto-max-bulk-len. */
uint64_t SRIO_MaxTensorBytes(void);
/* Read proto-max-bulk-len again (at load, and when CONFIG SET changes it). */
void SRIO_RefreshServerLimits(RedisModuleCtx *ctx);

/* ---- commands, replies and keywords (command.c) --------------------------------------------- */

/* The one keyword matcher: whether `arg` is `word`, ignoring case (RedisAI's keywords). */
int SRIO_Is(RedisModuleString *arg, const char *word);
/* printf into a new string (free with RedisModule_Free) */
char *SRIO_Format(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* The one error style: reply an error made with printf, "CODE message" (ERR, NOPERM, TIMEDOUT...),
 * on one line (line breaks of names in it become spaces). Returns REDISMODULE_OK. */
int SRIO_ReplyError(RedisModuleCtx *ctx, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* A key or name for a message: at most 200 bytes of it, as text. */
const char *SRIO_Name(RedisModuleString *s);

/* The one backend check: 1 for TORCH (served by the workers), 0 for a RedisAI backend this
 * database does not serve (TF, TFLITE, ONNX), -1 for an unknown one. */
int SRIO_BackendServed(RedisModuleString *arg);
/* The backend argument of a command: 1 for TORCH; otherwise replies with the error and returns 0. */
int SRIO_CheckBackend(RedisModuleCtx *ctx, RedisModuleString *arg);

/* Create a command with one key (argument 1) and its key spec. */
int SRIO_CreateKeyCommand(RedisModuleCtx *ctx, const char *name, RedisModuleCmdFunc fn, const char *flags,
                          int arity, uint64_t key_flags);
/* Create a command without keys. */
int SRIO_CreateCommand(RedisModuleCtx *ctx, const char *name, RedisModuleCmdFunc fn, const char *flags, int arity);

/* Whether the calling user may access `keyname` with `flags` (REDISMODULE_CMD_KEY_ACCESS, ...):
 * for keys the module reads or writes on the user's behalf beyond the command's own key. */
int SRIO_UserMayAccess(RedisModuleCtx *ctx, RedisModuleString *keyname, int flags);

/* Reply with the error of a failed read of `keyname` (RedisAI's wording for `what`: "tensor",
 * "model" or "script"); frees err. */
int SRIO_ReplyReadError(RedisModuleCtx *ctx, int status, const char *what, char *err);

/* ---- tensor values (wire.c; smartredis_io/_client/wire.py) ---------------------------------- */

#define SRIO_MAGIC "SRT1"
#define SRIO_MAX_NDIM 32
#define SRIO_FIXED_BYTES 8   /* magic, layout, dtype code, ndim, reserved */
#define SRIO_CHUNKS_BYTES 32 /* chunk count (u32), CRC-32 (u32), payload bytes (u64), version (16) */
#define SRIO_HEADER_MAX_BYTES (SRIO_FIXED_BYTES + 8 * SRIO_MAX_NDIM + SRIO_CHUNKS_BYTES)
#define SRIO_MAX_CHUNKS (1u << 20)
#define SRIO_VERSION_BYTES 16
#define SRIO_LAYOUT_INLINE 0
#define SRIO_LAYOUT_CHUNKED 1
#define SRIO_DEFAULT_BULK_LIMIT (512ull << 20) /* Redis' default proto-max-bulk-len */

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

/* A piece of a value's payload, for writes that gather several buffers. `str`, when set, is the
 * command argument the bytes are (replicated without a copy). */
typedef struct SRIO_Part {
    const char *ptr;
    size_t len;
    RedisModuleString *str;
} SRIO_Part;

/* Outcome of reading a key */
enum {
    SRIO_OK = 0,
    SRIO_EMPTY = 1,      /* no such key */
    SRIO_WRONGTYPE = 2,  /* not a string, or a string that is not a tensor / manifest */
    SRIO_CORRUPT = 3     /* a tensor whose header and stored bytes disagree (message in err) */
};

int SRIO_DtypeItemsize(int code);
/* RedisAI's name of a dtype (FLOAT, DOUBLE, ...); FLOAT16 and BFLOAT16 are smartredis_io's own. */
const char *SRIO_DtypeName(int code);
/* The code of a RedisAI type name (case-insensitive), 0 if unknown. */
int SRIO_DtypeFromName(RedisModuleString *name);

/* Whether an array of `ndim` dimensions `shape` of items of `itemsize` bytes can exist: numpy's
 * limit on an array's extent (the product of the non-zero dimensions times the item size is below
 * 2**63). Its bytes (0 with a zero dimension) in *nbytes. */
int SRIO_ShapeFits(const uint64_t *shape, int ndim, int itemsize, uint64_t *nbytes);
/* Parse a header; SRIO_OK, SRIO_WRONGTYPE (not a tensor) or SRIO_CORRUPT (impossible shape). */
int SRIO_HeaderDecode(const char *buf, size_t len, SRIO_Header *h);
/* Write a header into out (SRIO_HEADER_MAX_BYTES); returns its size. chunks == 0: inline. */
size_t SRIO_HeaderEncode(char *out, int code, int ndim, const uint64_t *shape, uint32_t chunks, uint32_t crc,
                         uint64_t payload, const unsigned char *version);

/* tagged_key(key, suffix) of smartredis_io._client.wire: a key on the cluster slot of `key` followed by
 * suffix. Redis hashes the text between the first '{' and the first '}' after it when that is not
 * empty, else the whole key; so the key is kept as the prefix when it has such a tag, wrapped as
 * "{key}" when it has no '}', and otherwise prefixed by "{srio<n>}", the first such tag whose slot
 * is the key's. */
RedisModuleString *SRIO_TaggedKey(RedisModuleCtx *ctx, RedisModuleString *key, const char *suffix, size_t suffix_len);
/* Redis' cluster slot of a key. */
unsigned SRIO_KeySlot(const char *key, size_t len);

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

/* Store a tensor of `nbytes` bytes (gathered from `parts`, or zeros when parts is NULL) at
 * `keyname`, replacing any value there (the caller has checked its type) and removing the chunks of
 * a replaced tensor; chunked when larger than the bulk limit. The key ends without an expiry, like
 * SET. The writes are replicated. REDISMODULE_OK, or REDISMODULE_ERR with a message in *err. */
int SRIO_TensorWrite(RedisModuleCtx *ctx, RedisModuleString *keyname, int code, int ndim, const uint64_t *shape,
                     const SRIO_Part *parts, size_t nparts, uint64_t nbytes, char **err);

/* Delete the tensor at `keyname` with its chunks (replicated); 1 if a key was removed. */
int SRIO_TensorDelete(RedisModuleCtx *ctx, RedisModuleString *keyname);

/* Set `keyname` to a string, as SET does, and replicate it. REDISMODULE_OK or REDISMODULE_ERR. */
int SRIO_SetString(RedisModuleCtx *ctx, RedisModuleString *keyname, const char *value, size_t len);
/* Delete `keyname` (whatever it holds) and replicate it; 1 if a key was removed. */
int SRIO_DeleteKey(RedisModuleCtx *ctx, RedisModuleString *keyname);

/* Whether the value of an open key is a string starting with the tensor magic / a manifest. */
int SRIO_KeyHoldsTensor(RedisModuleKey *key);
int SRIO_KeyHoldsManifest(RedisModuleKey *key);

/* ---- models and scripts (manifest.c; smartredis_io/_client/protocol.py) -------------------- */

#define SRIO_MANIFEST_PREFIX "{\"kind\": "
#define SRIO_VERSION_HEX 32
#define SRIO_MANIFEST_MAX_BYTES (1u << 20) /* a longer value is no manifest */
#define SRIO_MANIFEST_MAX_DEPTH 32         /* nesting of the values of fields this module skips */

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
/* The JSON of a manifest, as smartredis_io writes it (json.dumps of smartredis_io._client.protocol.Manifest);
 * NULL when a string field is not UTF-8 text. Free with RedisModule_Free. */
char *SRIO_ManifestJson(const SRIO_Manifest *m, size_t *len);
/* The key of the blob a manifest stored at `keyname` points to. */
RedisModuleString *SRIO_ManifestBlobKey(RedisModuleCtx *ctx, RedisModuleString *keyname, const SRIO_Manifest *m);
/* A fresh version id: 32 lowercase hex characters (and a terminating NUL). */
void SRIO_NewVersion(char out[SRIO_VERSION_HEX + 1]);

/* Whether s is UTF-8 text */
int SRIO_IsUtf8(const char *s, size_t len);

/* ---- statistics of runs ------------------------------------------------------------------------ */

/* What the execution half counts for one model or script key: RedisAI's AI.INFO fields. */
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

/* ---- registration ------------------------------------------------------------------------------ */

int SRIO_RegisterTensorCommands(RedisModuleCtx *ctx);
int SRIO_RegisterModelCommands(RedisModuleCtx *ctx);
int SRIO_RegisterAdminCommands(RedisModuleCtx *ctx);
/* The execution half (exec.h): its state, client and worker commands, events and timers. */
int SRIO_ExecRegister(RedisModuleCtx *ctx);
/* The workers the module starts itself (spawn.c): scheduled once the server serves. */
int SRIO_SpawnRegister(RedisModuleCtx *ctx);

#endif
