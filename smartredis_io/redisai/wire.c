/* Tensor values in smartredis_io's wire format (see srio.h and smartredis_io/wire.py). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "srio.h"

uint64_t SRIO_BulkLimit = SRIO_DEFAULT_BULK_LIMIT;

static const struct {
    const char *name;
    int itemsize;
} DTYPES[SRIO_DTYPE_MAX + 1] = {
    [SRIO_DOUBLE] = {"DOUBLE", 8}, [SRIO_FLOAT] = {"FLOAT", 4},     [SRIO_INT8] = {"INT8", 1},
    [SRIO_INT16] = {"INT16", 2},   [SRIO_INT32] = {"INT32", 4},     [SRIO_INT64] = {"INT64", 8},
    [SRIO_UINT8] = {"UINT8", 1},   [SRIO_UINT16] = {"UINT16", 2},   [SRIO_FLOAT16] = {"FLOAT16", 2},
    [SRIO_BOOL] = {"BOOL", 1},     [SRIO_BFLOAT16] = {"BFLOAT16", 2},
};

int SRIO_DtypeItemsize(int code) {
    return code >= 1 && code <= SRIO_DTYPE_MAX ? DTYPES[code].itemsize : 0;
}

const char *SRIO_DtypeName(int code) {
    return code >= 1 && code <= SRIO_DTYPE_MAX ? DTYPES[code].name : NULL;
}

int SRIO_DtypeFromName(const char *name, size_t len) {
    for (int code = 1; code <= SRIO_DTYPE_MAX; code++) {
        if (strlen(DTYPES[code].name) == len && strncasecmp(DTYPES[code].name, name, len) == 0) return code;
    }
    return 0;
}

static uint64_t load_u64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static uint32_t load_u32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void store_u64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++, v >>= 8) p[i] = (unsigned char)v;
}

static void store_u32(unsigned char *p, uint32_t v) {
    for (int i = 0; i < 4; i++, v >>= 8) p[i] = (unsigned char)v;
}

int SRIO_HeaderDecode(const char *buf, size_t len, SRIO_Header *h) {
    const unsigned char *p = (const unsigned char *)buf;
    if (len < SRIO_FIXED_BYTES || memcmp(p, SRIO_MAGIC, 4) != 0) return SRIO_WRONGTYPE;
    int layout = p[4], code = p[5], ndim = p[6];
    if (code < 1 || code > SRIO_DTYPE_MAX || ndim > SRIO_MAX_NDIM) return SRIO_WRONGTYPE;
    size_t size = SRIO_FIXED_BYTES + 8 * (size_t)ndim;
    if (len < size) return SRIO_WRONGTYPE;
    memset(h, 0, sizeof(*h));
    h->code = code;
    h->ndim = ndim;
    /* numpy's limit on an array's extent, zero-length dimensions aside (as wire.decode_header) */
    unsigned __int128 extent = (unsigned __int128)DTYPES[code].itemsize;
    uint64_t nbytes = (uint64_t)DTYPES[code].itemsize;
    for (int i = 0; i < ndim; i++) {
        h->shape[i] = load_u64(p + SRIO_FIXED_BYTES + 8 * i);
        if (h->shape[i]) {
            extent *= h->shape[i];
            if (extent >= ((unsigned __int128)1 << 63)) return SRIO_CORRUPT;
        }
        nbytes *= h->shape[i];
    }
    h->nbytes = nbytes;
    if (layout != SRIO_LAYOUT_INLINE) {
        if (len < size + SRIO_CHUNKS_BYTES) return SRIO_WRONGTYPE;
        h->chunks = load_u32(p + size);
        h->crc = load_u32(p + size + 4);
        h->payload = load_u64(p + size + 8);
        memcpy(h->version, p + size + 16, SRIO_VERSION_BYTES);
        size += SRIO_CHUNKS_BYTES;
    }
    h->size = size;
    return SRIO_OK;
}

size_t SRIO_HeaderEncode(char *out, int code, int ndim, const uint64_t *shape, uint32_t chunks, uint32_t crc,
                         uint64_t payload, const unsigned char *version) {
    unsigned char *p = (unsigned char *)out;
    memcpy(p, SRIO_MAGIC, 4);
    p[4] = chunks ? SRIO_LAYOUT_CHUNKED : SRIO_LAYOUT_INLINE;
    p[5] = (unsigned char)code;
    p[6] = (unsigned char)ndim;
    p[7] = 0;
    size_t size = SRIO_FIXED_BYTES;
    for (int i = 0; i < ndim; i++, size += 8) store_u64(p + size, shape[i]);
    if (chunks) {
        store_u32(p + size, chunks);
        store_u32(p + size + 4, crc);
        store_u64(p + size + 8, payload);
        memcpy(p + size + 16, version, SRIO_VERSION_BYTES);
        size += SRIO_CHUNKS_BYTES;
    }
    return size;
}

RedisModuleString *SRIO_TaggedKey(RedisModuleCtx *ctx, RedisModuleString *key, const char *suffix, size_t suffix_len) {
    size_t len;
    const char *k = RedisModule_StringPtrLen(key, &len);
    const char *open = memchr(k, '{', len);
    int tagged = 0;
    if (open) {
        size_t from = (size_t)(open - k) + 2;
        tagged = from <= len && memchr(k + from, '}', len - from) != NULL;
    }
    RedisModuleString *out = tagged ? RedisModule_CreateString(ctx, k, len) : RedisModule_CreateString(ctx, "{", 1);
    if (!tagged) {
        RedisModule_StringAppendBuffer(ctx, out, k, len);
        RedisModule_StringAppendBuffer(ctx, out, "}", 1);
    }
    RedisModule_StringAppendBuffer(ctx, out, suffix, suffix_len);
    return out;
}

/* CRC-32 (IEEE 802.3, zlib's crc32), slicing by 8 */
static uint32_t CRC_TABLE[8][256];

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        CRC_TABLE[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++) {
        for (int t = 1; t < 8; t++) CRC_TABLE[t][i] = (CRC_TABLE[t - 1][i] >> 8) ^ CRC_TABLE[0][CRC_TABLE[t - 1][i] & 0xff];
    }
}

uint32_t SRIO_Crc32(uint32_t crc, const void *buf, size_t len) {
    if (!CRC_TABLE[0][1]) crc_init();
    const unsigned char *p = buf;
    crc = ~crc;
    while (len >= 8) {
        uint32_t lo = crc ^ load_u32(p), hi = load_u32(p + 4);
        crc = CRC_TABLE[7][lo & 0xff] ^ CRC_TABLE[6][(lo >> 8) & 0xff] ^ CRC_TABLE[5][(lo >> 16) & 0xff] ^
              CRC_TABLE[4][lo >> 24] ^ CRC_TABLE[3][hi & 0xff] ^ CRC_TABLE[2][(hi >> 8) & 0xff] ^
              CRC_TABLE[1][(hi >> 16) & 0xff] ^ CRC_TABLE[0][hi >> 24];
        p += 8;
        len -= 8;
    }
    while (len--) crc = CRC_TABLE[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return ~crc;
}

static void version_hex(const unsigned char *version, char out[SRIO_VERSION_HEX + 1]) {
    static const char HEX[] = "0123456789abcdef";
    for (int i = 0; i < SRIO_VERSION_BYTES; i++) {
        out[2 * i] = HEX[version[i] >> 4];
        out[2 * i + 1] = HEX[version[i] & 15];
    }
    out[SRIO_VERSION_HEX] = '\0';
}

static RedisModuleString *chunk_key(RedisModuleCtx *ctx, RedisModuleString *key, const unsigned char *version,
                                    uint32_t index) {
    char hex[SRIO_VERSION_HEX + 1], suffix[64];
    version_hex(version, hex);
    int n = snprintf(suffix, sizeof(suffix), ".chunk.%s.%u", hex, index);
    return SRIO_TaggedKey(ctx, key, suffix, (size_t)n);
}

static void delete_chunks(RedisModuleCtx *ctx, RedisModuleString *key, const unsigned char *version, uint32_t chunks) {
    for (uint32_t i = 0; i < chunks && i < SRIO_MAX_CHUNKS; i++) {
        RedisModuleString *name = chunk_key(ctx, key, version, i);
        RedisModuleKey *k = RedisModule_OpenKey(ctx, name, REDISMODULE_WRITE);
        if (RedisModule_KeyType(k) != REDISMODULE_KEYTYPE_EMPTY) RedisModule_DeleteKey(k);
        RedisModule_CloseKey(k);
        RedisModule_FreeString(ctx, name);
    }
}

char *SRIO_Format(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    char *out = RedisModule_Alloc((size_t)n + 1);
    va_start(ap, fmt);
    vsnprintf(out, (size_t)n + 1, fmt, ap);
    va_end(ap);
    return out;
}

#define KEY(k) RedisModule_StringPtrLen((k), NULL)

int SRIO_KeyHoldsTensor(RedisModuleKey *key) {
    if (RedisModule_KeyType(key) != REDISMODULE_KEYTYPE_STRING) return 0;
    size_t len;
    const char *p = RedisModule_StringDMA(key, &len, REDISMODULE_READ);
    return len >= 4 && memcmp(p, SRIO_MAGIC, 4) == 0;
}

int SRIO_KeyHoldsManifest(RedisModuleKey *key) {
    if (RedisModule_KeyType(key) != REDISMODULE_KEYTYPE_STRING) return 0;
    size_t len, plen = strlen(SRIO_MANIFEST_PREFIX);
    const char *p = RedisModule_StringDMA(key, &len, REDISMODULE_READ);
    return len >= plen && memcmp(p, SRIO_MANIFEST_PREFIX, plen) == 0;
}

int SRIO_TensorOpen(RedisModuleCtx *ctx, RedisModuleString *keyname, SRIO_Tensor *t, char **err) {
    memset(t, 0, sizeof(*t));
    *err = NULL;
    RedisModuleKey *key = RedisModule_OpenKey(ctx, keyname, REDISMODULE_READ);
    int type = RedisModule_KeyType(key);
    if (type == REDISMODULE_KEYTYPE_EMPTY || type != REDISMODULE_KEYTYPE_STRING) {
        RedisModule_CloseKey(key);
        return type == REDISMODULE_KEYTYPE_EMPTY ? SRIO_EMPTY : SRIO_WRONGTYPE;
    }
    size_t len;
    const char *p = RedisModule_StringDMA(key, &len, REDISMODULE_READ);
    int status = SRIO_HeaderDecode(p, len, &t->h);
    if (status == SRIO_CORRUPT) *err = SRIO_Format("the value at key '%s' is corrupt: no array has its shape", KEY(keyname));
    if (status != SRIO_OK) {
        RedisModule_CloseKey(key);
        return status;
    }
    if (!t->h.chunks) {
        if (t->h.size + t->h.nbytes != len) {
            *err = SRIO_Format("the value at key '%s' is corrupt or truncated: its header claims %llu bytes of data but %llu are stored",
                           KEY(keyname), (unsigned long long)t->h.nbytes, (unsigned long long)(len - t->h.size));
            RedisModule_CloseKey(key);
            return SRIO_CORRUPT;
        }
        t->key = key;
        t->data = p + t->h.size;
        return SRIO_OK;
    }
    RedisModule_CloseKey(key);
    if (t->h.chunks > SRIO_MAX_CHUNKS) {
        *err = SRIO_Format("the value at key '%s' is corrupt: its header claims %u chunks", KEY(keyname), t->h.chunks);
        return SRIO_CORRUPT;
    }
    /* what the chunks hold is summed before anything is allocated: a forged header costs what is stored */
    uint64_t stored = 0;
    for (uint32_t i = 0; i < t->h.chunks; i++) {
        RedisModuleString *name = chunk_key(ctx, keyname, t->h.version, i);
        RedisModuleKey *k = RedisModule_OpenKey(ctx, name, REDISMODULE_READ);
        size_t n = RedisModule_KeyType(k) == REDISMODULE_KEYTYPE_STRING ? RedisModule_ValueLength(k) : 0;
        RedisModule_CloseKey(k);
        RedisModule_FreeString(ctx, name);
        if (n == 0) {
            *err = SRIO_Format("the value at key '%s' is corrupt: its header names %u chunks and chunk %u does not exist",
                               KEY(keyname), t->h.chunks, i);
            return SRIO_CORRUPT;
        }
        stored += n;
    }
    if (stored != t->h.payload || t->h.payload != t->h.nbytes) {
        *err = SRIO_Format("the value at key '%s' is corrupt or truncated: its header claims %llu bytes of data but %llu are stored",
                       KEY(keyname), (unsigned long long)t->h.nbytes, (unsigned long long)stored);
        return SRIO_CORRUPT;
    }
    t->owned = RedisModule_Alloc(stored ? stored : 1);
    uint64_t at = 0;
    uint32_t crc = 0;
    for (uint32_t i = 0; i < t->h.chunks; i++) {
        RedisModuleString *name = chunk_key(ctx, keyname, t->h.version, i);
        RedisModuleKey *k = RedisModule_OpenKey(ctx, name, REDISMODULE_READ);
        size_t n;
        const char *c = RedisModule_StringDMA(k, &n, REDISMODULE_READ);
        memcpy(t->owned + at, c, n);
        crc = SRIO_Crc32(crc, c, n);
        at += n;
        RedisModule_CloseKey(k);
        RedisModule_FreeString(ctx, name);
    }
    if (crc != t->h.crc) {
        *err = SRIO_Format("the value at key '%s' is corrupt: its chunks do not match their checksum", KEY(keyname));
        SRIO_TensorClose(t);
        return SRIO_CORRUPT;
    }
    t->data = t->owned;
    return SRIO_OK;
}

void SRIO_TensorClose(SRIO_Tensor *t) {
    if (t->key) RedisModule_CloseKey(t->key);
    if (t->owned) RedisModule_Free(t->owned);
    t->key = NULL;
    t->owned = NULL;
    t->data = NULL;
}

/* Where a value is gathered from: parts consumed in order */
typedef struct {
    const SRIO_Part *parts;
    size_t nparts, index, offset;
} Gather;

/* Append the next n bytes of the gathered parts to str, updating crc when given */
static void gather(RedisModuleCtx *ctx, Gather *g, RedisModuleString *str, uint64_t n, uint32_t *crc) {
    while (n && g->index < g->nparts) {
        const SRIO_Part *part = &g->parts[g->index];
        size_t take = part->len - g->offset;
        if (take > n) take = (size_t)n;
        if (take) {
            RedisModule_StringAppendBuffer(ctx, str, part->ptr + g->offset, take);
            if (crc) *crc = SRIO_Crc32(*crc, part->ptr + g->offset, take);
        }
        g->offset += take;
        n -= take;
        if (g->offset == part->len) {
            g->index++;
            g->offset = 0;
        }
    }
}

/* Set the value of an open key to str as SET does (no expiry), then let str go. */
static void set_string(RedisModuleKey *key, RedisModuleString *str) {
    RedisModule_TrimStringAllocation(str);
    RedisModule_StringSet(key, str);
    RedisModule_FreeString(NULL, str);
}

static void new_chunk_version(unsigned char version[SRIO_VERSION_BYTES]) {
    /* the time it was made (ns, big-endian) then 8 random bytes, as wire.new_version */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    for (int i = 7; i >= 0; i--, ns >>= 8) version[i] = (unsigned char)ns;
    char hex[17];
    RedisModule_GetRandomHexChars(hex, 16);
    for (int i = 0; i < 8; i++) {
        unsigned hi = (unsigned)(hex[2 * i] <= '9' ? hex[2 * i] - '0' : (hex[2 * i] | 32) - 'a' + 10);
        unsigned lo = (unsigned)(hex[2 * i + 1] <= '9' ? hex[2 * i + 1] - '0' : (hex[2 * i + 1] | 32) - 'a' + 10);
        version[8 + i] = (unsigned char)((hi << 4) | lo);
    }
}

int SRIO_TensorWrite(RedisModuleCtx *ctx, RedisModuleString *keyname, int code, int ndim, const uint64_t *shape,
                     const SRIO_Part *parts, size_t nparts) {
    uint64_t nbytes = 0;
    for (size_t i = 0; i < nparts; i++) nbytes += parts[i].len;
    RedisModuleKey *key = RedisModule_OpenKey(ctx, keyname, REDISMODULE_READ | REDISMODULE_WRITE);
    SRIO_Header old;
    int replaced_chunks = 0;
    if (RedisModule_KeyType(key) == REDISMODULE_KEYTYPE_STRING) {
        size_t len;
        const char *p = RedisModule_StringDMA(key, &len, REDISMODULE_READ);
        replaced_chunks = SRIO_HeaderDecode(p, len, &old) == SRIO_OK && old.chunks;
    } else if (RedisModule_KeyType(key) != REDISMODULE_KEYTYPE_EMPTY) {
        RedisModule_DeleteKey(key);
    }
    char head[SRIO_HEADER_MAX_BYTES];
    Gather g = {parts, nparts, 0, 0};
    if (nbytes + SRIO_HEADER_MAX_BYTES <= SRIO_BulkLimit) {
        size_t hsize = SRIO_HeaderEncode(head, code, ndim, shape, 0, 0, 0, NULL);
        RedisModuleString *value = RedisModule_CreateString(NULL, head, hsize);
        gather(ctx, &g, value, nbytes, NULL);
        set_string(key, value);
    } else {
        unsigned char version[SRIO_VERSION_BYTES];
        new_chunk_version(version);
        uint64_t limit = SRIO_BulkLimit, nchunks = (nbytes + limit - 1) / limit;
        uint32_t crc = 0;
        for (uint32_t i = 0; i < nchunks; i++) {
            RedisModuleString *name = chunk_key(ctx, keyname, version, i);
            RedisModuleKey *k = RedisModule_OpenKey(ctx, name, REDISMODULE_WRITE);
            RedisModuleString *value = RedisModule_CreateString(NULL, "", 0);
            gather(ctx, &g, value, i + 1 < nchunks ? limit : nbytes - limit * i, &crc);
            set_string(k, value);
            RedisModule_CloseKey(k);
            RedisModule_FreeString(ctx, name);
        }
        size_t hsize = SRIO_HeaderEncode(head, code, ndim, shape, (uint32_t)nchunks, crc, nbytes, version);
        set_string(key, RedisModule_CreateString(NULL, head, hsize));
    }
    RedisModule_CloseKey(key);
    RedisModule_NotifyKeyspaceEvent(ctx, REDISMODULE_NOTIFY_STRING, "set", keyname);
    if (replaced_chunks) delete_chunks(ctx, keyname, old.version, old.chunks);
    return REDISMODULE_OK;
}

int SRIO_TensorDelete(RedisModuleCtx *ctx, RedisModuleString *keyname) {
    RedisModuleKey *key = RedisModule_OpenKey(ctx, keyname, REDISMODULE_READ | REDISMODULE_WRITE);
    if (RedisModule_KeyType(key) == REDISMODULE_KEYTYPE_EMPTY) {
        RedisModule_CloseKey(key);
        return 0;
    }
    SRIO_Header h;
    int chunked = 0;
    if (RedisModule_KeyType(key) == REDISMODULE_KEYTYPE_STRING) {
        size_t len;
        const char *p = RedisModule_StringDMA(key, &len, REDISMODULE_READ);
        chunked = SRIO_HeaderDecode(p, len, &h) == SRIO_OK && h.chunks;
    }
    RedisModule_DeleteKey(key);
    RedisModule_CloseKey(key);
    RedisModule_NotifyKeyspaceEvent(ctx, REDISMODULE_NOTIFY_GENERIC, "del", keyname);
    if (chunked) delete_chunks(ctx, keyname, h.version, h.chunks);
    return 1;
}

int SRIO_ReplyReadError(RedisModuleCtx *ctx, int status, const char *what, char *err) {
    int ret;
    if (status == SRIO_EMPTY) {
        char msg[96];
        /* RedisAI's wording: SmartRedis clients show it as is */
        snprintf(msg, sizeof(msg), strcmp(what, "tensor") == 0 ? "ERR tensor key is empty or in a different shard"
                                                                : "ERR %s key is empty", what);
        ret = RedisModule_ReplyWithError(ctx, msg);
    } else if (status == SRIO_CORRUPT && err) {
        RedisModuleString *msg = RedisModule_CreateStringPrintf(ctx, "ERR %s", err);
        ret = RedisModule_ReplyWithError(ctx, RedisModule_StringPtrLen(msg, NULL));
        RedisModule_FreeString(ctx, msg);
    } else {
        ret = RedisModule_ReplyWithError(ctx, REDISMODULE_ERRORMSG_WRONGTYPE);
    }
    if (err) RedisModule_Free(err);
    return ret;
}

int SRIO_CreateKeyCommand(RedisModuleCtx *ctx, const char *name, RedisModuleCmdFunc fn, const char *flags,
                          int arity, uint64_t key_flags) {
    if (RedisModule_CreateCommand(ctx, name, fn, flags, 1, 1, 1) == REDISMODULE_ERR) return REDISMODULE_ERR;
    RedisModuleCommand *command = RedisModule_GetCommand(ctx, name);
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

int SRIO_UserMayAccess(RedisModuleCtx *ctx, RedisModuleString *keyname, int flags) {
    RedisModuleString *name = RedisModule_GetCurrentUserName(ctx);
    if (name == NULL) return 1; /* no client user: the server itself (AOF loading, replication) */
    RedisModuleUser *user = RedisModule_GetModuleUserFromUserName(name);
    RedisModule_FreeString(ctx, name);
    if (user == NULL) return 0;
    int ok = RedisModule_ACLCheckKeyPermissions(user, keyname, flags) == REDISMODULE_OK;
    RedisModule_FreeModuleUser(user);
    return ok;
}
