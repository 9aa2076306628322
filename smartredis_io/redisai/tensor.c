/* AI.TENSORSET and AI.TENSORGET, as RedisAI 1.2.7 documents them, on smartredis_io's tensor values.
 *
 * AI.TENSORSET key type dim1..dimN [BLOB data | VALUES val1..valN]
 * AI.TENSORGET key [META] [BLOB | VALUES]
 *
 * Beyond RedisAI: dimensions of length 0 (empty tensors) and the types FLOAT16 and BFLOAT16, which
 * smartredis_io stores; STRING tensors are refused.
 */
#include <math.h>
#include <string.h>

#include "srio.h"

#define TENSOR_META 1
#define TENSOR_BLOB 2
#define TENSOR_VALUES 4

static uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, exp = (x >> 23) & 0xffu, mant = x & 0x7fffffu;
    if (exp == 0xff) return (uint16_t)(sign | 0x7c00u | (mant ? 0x200u : 0)); /* inf, nan */
    int e = (int)exp - 127 + 15;
    if (e >= 31) return (uint16_t)(sign | 0x7c00u); /* overflow: inf */
    if (e <= 0) {                                   /* subnormal or zero, rounded to nearest even */
        if (e < -10) return (uint16_t)sign;
        mant |= 0x800000u;
        int shift = 14 - e;
        uint32_t half = mant >> shift, rest = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rest > mid || (rest == mid && (half & 1))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = sign | ((uint32_t)e << 10) | (mant >> 13), rest = mant & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (half & 1))) half++; /* may carry into the exponent: right */
    return (uint16_t)half;
}

static double half_to_double(uint16_t h) {
    int exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    double v;
    if (exp == 0) v = ldexp(mant, -24);
    else if (exp == 31) v = mant ? NAN : INFINITY;
    else v = ldexp(mant | 0x400, exp - 25);
    return h & 0x8000 ? -v : v;
}

static uint16_t float_to_bfloat16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u); /* nan stays nan */
    x += 0x7fffu + ((x >> 16) & 1u);                                            /* round to nearest even */
    return (uint16_t)(x >> 16);
}

static double bfloat16_to_double(uint16_t b) {
    uint32_t x = (uint32_t)b << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

static int is_float(int code) {
    return code == SRIO_DOUBLE || code == SRIO_FLOAT || code == SRIO_FLOAT16 || code == SRIO_BFLOAT16;
}

/* Store one value parsed from VALUES at element i; 0 when it does not fit the type. */
static int put_value(char *data, int code, uint64_t i, RedisModuleString *arg) {
    if (is_float(code)) {
        double v;
        if (RedisModule_StringToDouble(arg, &v) != REDISMODULE_OK) return 0;
        if (code == SRIO_DOUBLE) {
            memcpy(data + 8 * i, &v, 8);
        } else if (code == SRIO_FLOAT) {
            float f = (float)v;
            memcpy(data + 4 * i, &f, 4);
        } else {
            uint16_t h = code == SRIO_FLOAT16 ? float_to_half((float)v) : float_to_bfloat16((float)v);
            memcpy(data + 2 * i, &h, 2);
        }
        return 1;
    }
    long long v;
    if (RedisModule_StringToLongLong(arg, &v) != REDISMODULE_OK) return 0;
    switch (code) {
    case SRIO_INT8: if (v < INT8_MIN || v > INT8_MAX) return 0; ((int8_t *)data)[i] = (int8_t)v; return 1;
    case SRIO_INT16: if (v < INT16_MIN || v > INT16_MAX) return 0; { int16_t x = (int16_t)v; memcpy(data + 2 * i, &x, 2); } return 1;
    case SRIO_INT32: if (v < INT32_MIN || v > INT32_MAX) return 0; { int32_t x = (int32_t)v; memcpy(data + 4 * i, &x, 4); } return 1;
    case SRIO_INT64: memcpy(data + 8 * i, &v, 8); return 1;
    case SRIO_UINT8: if (v < 0 || v > UINT8_MAX) return 0; ((uint8_t *)data)[i] = (uint8_t)v; return 1;
    case SRIO_UINT16: if (v < 0 || v > UINT16_MAX) return 0; { uint16_t x = (uint16_t)v; memcpy(data + 2 * i, &x, 2); } return 1;
    case SRIO_BOOL: if (v != 0 && v != 1) return 0; ((uint8_t *)data)[i] = (uint8_t)v; return 1;
    }
    return 0;
}

/* AI.TENSORSET key type dim1..dimN [BLOB data | VALUES val1..valN]
 *
 * The shape is checked before anything is allocated: its bytes (numpy's limit on an array's extent,
 * then MAX_TENSOR_BYTES) and, for BLOB and VALUES, the data that came with it. */
static int TensorSet(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc < 4) return RedisModule_WrongArity(ctx);
    RedisModuleKey *key = RedisModule_OpenKey(ctx, argv[1], REDISMODULE_READ);
    int type = RedisModule_KeyType(key);
    int foreign = type != REDISMODULE_KEYTYPE_EMPTY && !SRIO_KeyHoldsTensor(key);
    RedisModule_CloseKey(key);
    if (foreign) return RedisModule_ReplyWithError(ctx, REDISMODULE_ERRORMSG_WRONGTYPE);

    int code = SRIO_DtypeFromName(argv[2]);
    if (!code) {
        return SRIO_ReplyError(ctx, SRIO_Is(argv[2], "STRING") ? "ERR invalid data type: STRING tensors are not supported"
                                                               : "ERR invalid data type");
    }
    uint64_t shape[SRIO_MAX_NDIM];
    int ndim = 0, fmt = 0, pos = 3;
    for (; pos < argc; pos++) {
        if (SRIO_Is(argv[pos], "BLOB")) {
            fmt = TENSOR_BLOB;
            pos++;
            break;
        }
        if (SRIO_Is(argv[pos], "VALUES")) {
            fmt = TENSOR_VALUES;
            pos++;
            break;
        }
        long long dim;
        if (RedisModule_StringToLongLong(argv[pos], &dim) != REDISMODULE_OK || dim < 0) {
            return SRIO_ReplyError(ctx, "ERR invalid or negative value found in tensor shape");
        }
        if (ndim == SRIO_MAX_NDIM) {
            return SRIO_ReplyError(ctx, "ERR tensors of more than %d dimensions are not supported", SRIO_MAX_NDIM);
        }
        shape[ndim++] = (uint64_t)dim;
    }
    int itemsize = SRIO_DtypeItemsize(code);
    uint64_t nbytes;
    if (!SRIO_ShapeFits(shape, ndim, itemsize, &nbytes)) {
        return SRIO_ReplyError(ctx, "ERR invalid tensor shape: no array of %s has that many elements", SRIO_DtypeName(code));
    }
    uint64_t limit = SRIO_MaxTensorBytes();
    if (nbytes > limit) {
        return SRIO_ReplyError(ctx, "ERR a tensor of this shape and type holds %llu bytes, more than this server stores "
                                    "(%llu: MAX_TENSOR_BYTES, or Redis' proto-max-bulk-len)",
                               (unsigned long long)nbytes, (unsigned long long)limit);
    }
    uint64_t nelem = nbytes / (uint64_t)itemsize;
    if (fmt == TENSOR_BLOB && argc - pos != 1) {
        return SRIO_ReplyError(ctx, "ERR a single binary string should come after the BLOB argument in 'AI.TENSORSET' command");
    }
    if (fmt == TENSOR_VALUES && (uint64_t)(argc - pos) != nelem) {
        return SRIO_ReplyError(ctx, "ERR wrong number of values was given in 'AI.TENSORSET' command");
    }
    SRIO_Part part = {0};
    char *owned = NULL;
    if (fmt == TENSOR_BLOB) {
        part.str = argv[pos];
        part.ptr = RedisModule_StringPtrLen(argv[pos], &part.len);
        if (part.len != nbytes) return SRIO_ReplyError(ctx, "ERR data length does not match tensor shape and type");
        if (code == SRIO_BOOL) {
            for (size_t i = 0; i < part.len; i++) {
                if ((unsigned char)part.ptr[i] > 1) return SRIO_ReplyError(ctx, "ERR BOOL tensor elements must be 0 or 1");
            }
        }
    } else if (fmt == TENSOR_VALUES) {
        /* as many values as elements came with the command: sized by what was sent */
        owned = RedisModule_Alloc(nbytes ? nbytes : 1);
        for (uint64_t i = 0; i < nelem; i++) {
            if (!put_value(owned, code, i, argv[pos + i])) {
                RedisModule_Free(owned);
                return SRIO_ReplyError(ctx, "ERR invalid value");
            }
        }
        part.ptr = owned;
        part.len = nbytes;
    }
    char *err;
    int status = SRIO_TensorWrite(ctx, argv[1], code, ndim, shape, fmt ? &part : NULL, fmt ? 1 : 0, nbytes, &err);
    if (owned) RedisModule_Free(owned);
    if (status != REDISMODULE_OK) {
        SRIO_ReplyError(ctx, "ERR %s", err);
        RedisModule_Free(err);
        return REDISMODULE_OK;
    }
    return RedisModule_ReplyWithSimpleString(ctx, "OK");
}

static void reply_values(RedisModuleCtx *ctx, const SRIO_Tensor *t) {
    uint64_t n = t->h.nbytes / (uint64_t)SRIO_DtypeItemsize(t->h.code);
    const char *d = t->data;
    RedisModule_ReplyWithArray(ctx, (long)n);
    for (uint64_t i = 0; i < n; i++) {
        switch (t->h.code) {
        case SRIO_DOUBLE: { double v; memcpy(&v, d + 8 * i, 8); RedisModule_ReplyWithDouble(ctx, v); break; }
        case SRIO_FLOAT: { float v; memcpy(&v, d + 4 * i, 4); RedisModule_ReplyWithDouble(ctx, v); break; }
        case SRIO_FLOAT16: { uint16_t v; memcpy(&v, d + 2 * i, 2); RedisModule_ReplyWithDouble(ctx, half_to_double(v)); break; }
        case SRIO_BFLOAT16: { uint16_t v; memcpy(&v, d + 2 * i, 2); RedisModule_ReplyWithDouble(ctx, bfloat16_to_double(v)); break; }
        case SRIO_INT8: RedisModule_ReplyWithLongLong(ctx, ((const int8_t *)d)[i]); break;
        case SRIO_INT16: { int16_t v; memcpy(&v, d + 2 * i, 2); RedisModule_ReplyWithLongLong(ctx, v); break; }
        case SRIO_INT32: { int32_t v; memcpy(&v, d + 4 * i, 4); RedisModule_ReplyWithLongLong(ctx, v); break; }
        case SRIO_INT64: { int64_t v; memcpy(&v, d + 8 * i, 8); RedisModule_ReplyWithLongLong(ctx, v); break; }
        case SRIO_UINT16: { uint16_t v; memcpy(&v, d + 2 * i, 2); RedisModule_ReplyWithLongLong(ctx, v); break; }
        default: RedisModule_ReplyWithLongLong(ctx, ((const uint8_t *)d)[i]); break; /* UINT8, BOOL */
        }
    }
}

/* The largest VALUES reply: one element takes up to this many bytes of a reply (a double as text),
 * and a reply is held no larger than the largest tensor this server stores. */
#define VALUE_REPLY_BYTES 24

/* AI.TENSORGET key [META] [BLOB | VALUES] */
static int TensorGet(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc < 2 || argc > 4) return RedisModule_WrongArity(ctx);
    int fmt = argc == 2 ? TENSOR_META | TENSOR_BLOB : 0;
    for (int i = 2; i < argc; i++) {
        if (SRIO_Is(argv[i], "BLOB")) fmt |= TENSOR_BLOB;
        else if (SRIO_Is(argv[i], "VALUES")) fmt |= TENSOR_VALUES;
        else if (SRIO_Is(argv[i], "META")) fmt |= TENSOR_META;
        else fmt = -1;
        if (fmt == -1) return SRIO_ReplyError(ctx, "ERR unsupported data format");
        if ((fmt & (TENSOR_BLOB | TENSOR_VALUES)) == (TENSOR_BLOB | TENSOR_VALUES)) {
            return SRIO_ReplyError(ctx, "ERR both BLOB and VALUES specified");
        }
    }
    SRIO_Tensor t;
    char *err;
    int status = SRIO_TensorOpen(ctx, argv[1], &t, &err);
    if (status != SRIO_OK) return SRIO_ReplyReadError(ctx, status, "tensor", err);
    uint64_t nelem = t.h.nbytes / (uint64_t)SRIO_DtypeItemsize(t.h.code);
    if ((fmt & TENSOR_VALUES) && nelem > SRIO_MaxTensorBytes() / VALUE_REPLY_BYTES) {
        SRIO_TensorClose(&t);
        return SRIO_ReplyError(ctx, "ERR tensor '%s' has %llu elements, too many for a VALUES reply (at most %llu); "
                                    "ask for BLOB", SRIO_Name(argv[1]), (unsigned long long)nelem,
                               (unsigned long long)(SRIO_MaxTensorBytes() / VALUE_REPLY_BYTES));
    }
    if (fmt & TENSOR_META) {
        RedisModule_ReplyWithArray(ctx, fmt & (TENSOR_BLOB | TENSOR_VALUES) ? 6 : 4);
        RedisModule_ReplyWithCString(ctx, "dtype");
        RedisModule_ReplyWithCString(ctx, SRIO_DtypeName(t.h.code));
        RedisModule_ReplyWithCString(ctx, "shape");
        RedisModule_ReplyWithArray(ctx, t.h.ndim);
        for (int i = 0; i < t.h.ndim; i++) RedisModule_ReplyWithLongLong(ctx, (long long)t.h.shape[i]);
        if (fmt & TENSOR_BLOB) RedisModule_ReplyWithCString(ctx, "blob");
        if (fmt & TENSOR_VALUES) RedisModule_ReplyWithCString(ctx, "values");
    }
    if (fmt & TENSOR_BLOB) RedisModule_ReplyWithStringBuffer(ctx, t.data, t.h.nbytes);
    if (fmt & TENSOR_VALUES) reply_values(ctx, &t);
    SRIO_TensorClose(&t);
    return REDISMODULE_OK;
}

int SRIO_RegisterTensorCommands(RedisModuleCtx *ctx) {
    if (SRIO_CreateKeyCommand(ctx, "ai.tensorset", TensorSet, "write deny-oom", -4,
                              REDISMODULE_CMD_KEY_OW | REDISMODULE_CMD_KEY_UPDATE) == REDISMODULE_ERR ||
        SRIO_CreateKeyCommand(ctx, "ai.tensorget", TensorGet, "readonly", -2,
                              REDISMODULE_CMD_KEY_RO | REDISMODULE_CMD_KEY_ACCESS) == REDISMODULE_ERR) {
        return REDISMODULE_ERR;
    }
    return REDISMODULE_OK;
}
