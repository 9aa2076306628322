/* Tensor values in smartredis_io's wire format (see srio.h and smartredis_io/_client/wire.py). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "srio.h"

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

int SRIO_DtypeFromName(RedisModuleString *name) {
    for (int code = 1; code <= SRIO_DTYPE_MAX; code++) {
        if (SRIO_Is(name, DTYPES[code].name)) return code;
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

int SRIO_ShapeFits(const uint64_t *shape, int ndim, int itemsize, uint64_t *nbytes) {
    unsigned __int128 extent = (unsigned __int128)itemsize;
    uint64_t n = (uint64_t)itemsize;
    for (int i = 0; i < ndim; i++) {
        if (shape[i]) {
            extent *= shape[i];
            if (extent >= ((unsigned __int128)1 << 63)) return 0;
        }
        n *= shape[i]; /* no wrap: bounded by the extent, or 0 */
    }
    *nbytes = n;
    return 1;
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
    for (int i = 0; i < ndim; i++) h->shape[i] = load_u64(p + SRIO_FIXED_BYTES + 8 * i);
    if (!SRIO_ShapeFits(h->shape, ndim, DTYPES[code].itemsize, &h->nbytes)) return SRIO_CORRUPT;
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

/* ---- cluster slots and hash tags ------------------------------------------------------------ */

/* CRC-16/XMODEM, Redis Cluster's key hash */
static uint16_t crc16(const char *buf, size_t len) {
    uint16_t crc = 0;
    for (size_t i = 0; i < len; i++) {
        crc ^= (uint16_t)((unsigned char)buf[i] << 8);
        for (int k = 0; k < 8; k++) crc = crc & 0x8000 ? (uint16_t)((crc << 1) ^ 0x1021) : (uint16_t)(crc << 1);
    }
    return crc;
}

/* Where Redis' hash tag of `key` starts and how long it is; 0 when the key has none (the whole
 * key is hashed): the text between the first '{' and the first '}' after it, when not empty. */
static int hash_tag(const char *key, size_t len, size_t *start, size_t *tag_len) {
    const char *open = memchr(key, '{', len);
    if (open == NULL) return 0;
    size_t from = (size_t)(open - key) + 1;
    const char *close = memchr(key + from, '}', len - from);
    if (close == NULL || close == key + from) return 0;
    *start = from;
    *tag_len = (size_t)(close - key) - from;
    return 1;
}

unsigned SRIO_KeySlot(const char *key, size_t len) {
    size_t start, tag_len;
    if (hash_tag(key, len, &start, &tag_len)) return crc16(key + start, tag_len) & 16383;
    return crc16(key, len) & 16383;
}

#define SLOT_TAG_PREFIX "srio"

/* The tag "srio<n>" of the smallest n whose slot is `slot` (found once per slot). */
static int slot_tag(unsigned slot, char out[32]) {
    static int32_t found[16384];
    if (found[slot] == 0) {
        char tag[32];
        for (int32_t n = 0; n < (1 << 30); n++) {
            int len = snprintf(tag, sizeof tag, SLOT_TAG_PREFIX "%d", n);
            unsigned s = crc16(tag, (size_t)len) & 16383;
            if (found[s] == 0) found[s] = n + 1;
            if (s == slot) break;
        }
    }
    return snprintf(out, 32, SLOT_TAG_PREFIX "%d", found[slot] - 1);
}

RedisModuleString *SRIO_TaggedKey(RedisModuleCtx *ctx, RedisModuleString *key, const char *suffix, size_t suffix_len) {
    size_t len, start, tag_len;
    const char *k = RedisModule_StringPtrLen(key, &len);
    RedisModuleString *out;
    if (hash_tag(k, len, &start, &tag_len)) {
        out = RedisModule_CreateString(ctx, k, len);
    } else if (len && memchr(k, '}', len) == NULL) {
        out = RedisModule_CreateString(ctx, "{", 1);
        RedisModule_StringAppendBuffer(ctx, out, k, len);
        RedisModule_StringAppendBuffer(ctx, out, "}", 1);
    } else {
        char tag[32];
        int n = slot_tag(SRIO_KeySlot(k, len), tag);
        out = RedisModule_CreateString(ctx, "{", 1);
        RedisModule_StringAppendBuffer(ctx, out, tag, (size_t)n);
        RedisModule_StringAppendBuffer(ctx, out, "}", 1);
        RedisModule_StringAppendBuffer(ctx, out, k, len);
    }
    RedisModule_StringAppendBuffer(ctx, out, suffix, suffix_len);
    return out;
}

/* ---- CRC-32 (IEEE 802.3, zlib's crc32), slicing by 8 ----------------------------------------- */

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

/* ---- reading --------------------------------------------------------------------------------- */

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

int SRIO_KeyHoldsTensor(RedisModuleKey *key) {
    if (RedisModule_KeyType(key) != REDISMODULE_KEYTYPE_STRING) return 0;
    size_t len;
    const char *p = RedisModule_StringDMA(key, &len, REDISMODULE_READ);
    return p && len >= 4 && memcmp(p, SRIO_MAGIC, 4) == 0;
}

int SRIO_KeyHoldsManifest(RedisModuleKey *key) {
    if (RedisModule_KeyType(key) != REDISMODULE_KEYTYPE_STRING) return 0;
    size_t len, plen = strlen(SRIO_MANIFEST_PREFIX);
    const char *p = RedisModule_StringDMA(key, &len, REDISMODULE_READ);
    return p && len >= plen && memcmp(p, SRIO_MANIFEST_PREFIX, plen) == 0;
}

int SRIO_TensorOpen(RedisModuleCtx *ctx, RedisModuleString *keyname, SRIO_Tensor *t, char **err) {
    memset(t, 0, sizeof(*t));
    *err = NULL;
    RedisModuleKey *key = RedisModule_OpenKey(ctx, keyname, REDISMODULE_READ);
    int type = RedisModule_KeyType(key);
    if (type != REDISMODULE_KEYTYPE_STRING) {
        RedisModule_CloseKey(key);
        return type == REDISMODULE_KEYTYPE_EMPTY ? SRIO_EMPTY : SRIO_WRONGTYPE;
    }
    size_t len;
    const char *p = RedisModule_StringDMA(key, &len, REDISMODULE_READ);
    int status = SRIO_HeaderDecode(p, len, &t->h);
    if (status == SRIO_CORRUPT) {
        *err = SRIO_Format("the value at key '%s' is corrupt: no array has its shape", SRIO_Name(keyname));
    }
    if (status != SRIO_OK) {
        RedisModule_CloseKey(key);
        return status;
    }
    if (!t->h.chunks) {
        if (t->h.size + t->h.nbytes != len) {
            *err = SRIO_Format("the value at key '%s' is corrupt or truncated: its header claims %llu bytes of data but "
                               "%llu are stored", SRIO_Name(keyname), (unsigned long long)t->h.nbytes,
                               (unsigned long long)(len - t->h.size));
            RedisModule_CloseKey(key);
            return SRIO_CORRUPT;
        }
        t->key = key;
        t->data = p + t->h.size;
        return SRIO_OK;
    }
    RedisModule_CloseKey(key);
    if (t->h.chunks > SRIO_MAX_CHUNKS) {
        *err = SRIO_Format("the value at key '%s' is corrupt: its header claims %u chunks", SRIO_Name(keyname),
                           t->h.chunks);
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
                               SRIO_Name(keyname), t->h.chunks, i);
            return SRIO_CORRUPT;
        }
        stored += n;
    }
    if (stored != t->h.payload || t->h.payload != t->h.nbytes) {
        *err = SRIO_Format("the value at key '%s' is corrupt or truncated: its header claims %llu bytes of data but %llu "
                           "are stored", SRIO_Name(keyname), (unsigned long long)t->h.nbytes, (unsigned long long)stored);
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
        *err = SRIO_Format("the value at key '%s' is corrupt: its chunks do not match their checksum", SRIO_Name(keyname));
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

/* ---- writing, replicated as plain commands ------------------------------------------------- */

int SRIO_DeleteKey(RedisModuleCtx *ctx, RedisModuleString *keyname) {
    RedisModuleKey *key = RedisModule_OpenKey(ctx, keyname, REDISMODULE_WRITE);
    int existed = RedisModule_KeyType(key) != REDISMODULE_KEYTYPE_EMPTY;
    if (existed) {
        RedisModule_DeleteKey(key);
        RedisModule_Replicate(ctx, "DEL", "s", keyname);
    }
    RedisModule_CloseKey(key);
    return existed;
}

static void delete_chunks(RedisModuleCtx *ctx, RedisModuleString *key, const unsigned char *version, uint32_t chunks) {
    for (uint32_t i = 0; i < chunks && i < SRIO_MAX_CHUNKS; i++) {
        RedisModuleString *name = chunk_key(ctx, key, version, i);
        SRIO_DeleteKey(ctx, name);
        RedisModule_FreeString(ctx, name);
    }
}

/* Where a value's payload comes from: parts consumed in order, or zeros (parts == NULL). */
typedef struct {
    const SRIO_Part *parts;
    size_t nparts, index, offset;
} Gather;

/* Copy the next n bytes of the payload to out (NULL: only move on), updating crc when given, and
 * replicate them as appended to `name` (the value's replication began with a SET). */
static void gather(RedisModuleCtx *ctx, Gather *g, char *out, uint64_t n, uint32_t *crc, RedisModuleString *name,
                   uint64_t value_len) {
    if (g->parts == NULL) {
        if (crc) {
            static const char zeros[4096];
            for (uint64_t left = n; left; left -= left < sizeof zeros ? left : sizeof zeros)
                *crc = SRIO_Crc32(*crc, zeros, left < sizeof zeros ? (size_t)left : sizeof zeros);
        }
        /* zeros: SETRANGE pads the value with them up to its length */
        if (n) RedisModule_Replicate(ctx, "SETRANGE", "slb", name, (long long)(value_len - 1), "", (size_t)1);
        return;
    }
    while (n && g->index < g->nparts) {
        const SRIO_Part *part = &g->parts[g->index];
        size_t take = part->len - g->offset;
        if (take > n) take = (size_t)n;
        if (take) {
            memcpy(out, part->ptr + g->offset, take);
            out += take;
            if (crc) *crc = SRIO_Crc32(*crc, part->ptr + g->offset, take);
            if (part->str && take == part->len) {
                RedisModule_Replicate(ctx, "APPEND", "ss", name, part->str); /* the argument itself, no copy */
            } else {
                RedisModule_Replicate(ctx, "APPEND", "sb", name, part->ptr + g->offset, take);
            }
        }
        g->offset += take;
        n -= take;
        if (g->offset == part->len) {
            g->index++;
            g->offset = 0;
        }
    }
}

/* Set `name` to `head` followed by the next `n` bytes of the payload, as SET does (no expiry),
 * in one allocation of the value's exact size. */
static int write_value(RedisModuleCtx *ctx, RedisModuleString *name, const char *head, size_t hsize, Gather *g,
                       uint64_t n, uint32_t *crc) {
    RedisModuleKey *key = RedisModule_OpenKey(ctx, name, REDISMODULE_READ | REDISMODULE_WRITE);
    if (RedisModule_KeyType(key) != REDISMODULE_KEYTYPE_EMPTY) RedisModule_DeleteKey(key);
    size_t total = hsize + (size_t)n, len = 0;
    char *value = NULL;
    /* an empty key grows to a zeroed string of exactly this size */
    if (RedisModule_StringTruncate(key, total) == REDISMODULE_OK) value = RedisModule_StringDMA(key, &len, REDISMODULE_WRITE);
    if (value == NULL || len != total) {
        RedisModule_CloseKey(key);
        return REDISMODULE_ERR;
    }
    memcpy(value, head, hsize);
    RedisModule_Replicate(ctx, "SET", "sb", name, head, hsize);
    gather(ctx, g, value + hsize, n, crc, name, total);
    RedisModule_CloseKey(key);
    return REDISMODULE_OK;
}

static void new_chunk_version(unsigned char version[SRIO_VERSION_BYTES]) {
    /* the time it was made (ns, big-endian) then 8 random bytes, as smartredis_io._client.wire.new_version */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    for (int i = 7; i >= 0; i--, ns >>= 8) version[i] = (unsigned char)ns;
    RedisModule_GetRandomBytes(version + 8, 8);
}

int SRIO_TensorWrite(RedisModuleCtx *ctx, RedisModuleString *keyname, int code, int ndim, const uint64_t *shape,
                     const SRIO_Part *parts, size_t nparts, uint64_t nbytes, char **err) {
    *err = NULL;
    SRIO_Header old;
    int replaced_chunks = 0;
    RedisModuleKey *key = RedisModule_OpenKey(ctx, keyname, REDISMODULE_READ);
    if (RedisModule_KeyType(key) == REDISMODULE_KEYTYPE_STRING) {
        size_t len;
        const char *p = RedisModule_StringDMA(key, &len, REDISMODULE_READ);
        replaced_chunks = SRIO_HeaderDecode(p, len, &old) == SRIO_OK && old.chunks;
    }
    RedisModule_CloseKey(key);
    char head[SRIO_HEADER_MAX_BYTES];
    Gather g = {parts, nparts, 0, 0};
    uint64_t limit = SRIO_Config.bulk_limit;
    int status = REDISMODULE_OK;
    if (nbytes + SRIO_HEADER_MAX_BYTES <= limit) {
        size_t hsize = SRIO_HeaderEncode(head, code, ndim, shape, 0, 0, 0, NULL);
        status = write_value(ctx, keyname, head, hsize, &g, nbytes, NULL);
    } else {
        unsigned char version[SRIO_VERSION_BYTES];
        new_chunk_version(version);
        uint64_t nchunks = (nbytes + limit - 1) / limit;
        if (nchunks > SRIO_MAX_CHUNKS) {
            *err = SRIO_Format("a value of %llu bytes needs more than %u chunks of %llu bytes",
                               (unsigned long long)nbytes, SRIO_MAX_CHUNKS, (unsigned long long)limit);
            return REDISMODULE_ERR;
        }
        uint32_t crc = 0, written = 0;
        for (; written < nchunks && status == REDISMODULE_OK; written++) {
            RedisModuleString *name = chunk_key(ctx, keyname, version, written);
            status = write_value(ctx, name, "", 0, &g, written + 1 < nchunks ? limit : nbytes - limit * written, &crc);
            RedisModule_FreeString(ctx, name);
        }
        if (status == REDISMODULE_OK) {
            size_t hsize = SRIO_HeaderEncode(head, code, ndim, shape, (uint32_t)nchunks, crc, nbytes, version);
            Gather none = {NULL, 0, 0, 0};
            status = write_value(ctx, keyname, head, hsize, &none, 0, NULL);
        } else {
            delete_chunks(ctx, keyname, version, written);
        }
    }
    if (status != REDISMODULE_OK) {
        *err = SRIO_Format("the server could not store %llu bytes at key '%s'", (unsigned long long)nbytes,
                           SRIO_Name(keyname));
        return REDISMODULE_ERR;
    }
    RedisModule_NotifyKeyspaceEvent(ctx, REDISMODULE_NOTIFY_STRING, "set", keyname);
    if (replaced_chunks) delete_chunks(ctx, keyname, old.version, old.chunks);
    return REDISMODULE_OK;
}

int SRIO_SetString(RedisModuleCtx *ctx, RedisModuleString *keyname, const char *value, size_t len) {
    RedisModuleKey *key = RedisModule_OpenKey(ctx, keyname, REDISMODULE_WRITE);
    RedisModuleString *str = RedisModule_CreateString(ctx, value, len);
    int status = RedisModule_StringSet(key, str);
    RedisModule_FreeString(ctx, str);
    RedisModule_CloseKey(key);
    if (status != REDISMODULE_OK) return REDISMODULE_ERR;
    RedisModule_Replicate(ctx, "SET", "sb", keyname, value, len);
    RedisModule_NotifyKeyspaceEvent(ctx, REDISMODULE_NOTIFY_STRING, "set", keyname);
    return REDISMODULE_OK;
}

int SRIO_TensorDelete(RedisModuleCtx *ctx, RedisModuleString *keyname) {
    RedisModuleKey *key = RedisModule_OpenKey(ctx, keyname, REDISMODULE_READ);
    SRIO_Header h;
    int chunked = 0;
    if (RedisModule_KeyType(key) == REDISMODULE_KEYTYPE_STRING) {
        size_t len;
        const char *p = RedisModule_StringDMA(key, &len, REDISMODULE_READ);
        chunked = SRIO_HeaderDecode(p, len, &h) == SRIO_OK && h.chunks;
    }
    RedisModule_CloseKey(key);
    if (!SRIO_DeleteKey(ctx, keyname)) return 0;
    RedisModule_NotifyKeyspaceEvent(ctx, REDISMODULE_NOTIFY_GENERIC, "del", keyname);
    if (chunked) delete_chunks(ctx, keyname, h.version, h.chunks);
    return 1;
}
