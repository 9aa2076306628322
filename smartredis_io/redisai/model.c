/* Storing, reading and deleting models and scripts, as RedisAI 1.2.7 documents the commands, on
 * smartredis_io's manifests (smartredis_io/_client/protocol.py): a model stored here is the same object as
 * one stored by smartredis_io's set_model, and the execution workers run either.
 *
 * AI.MODELSTORE key backend device [TAG tag] [BATCHSIZE n [MINBATCHSIZE m [MINBATCHTIMEOUT t]]]
 *               [INPUTS n name... OUTPUTS n name...] BLOB blob...
 * AI.MODELSET   key backend device [TAG tag] [BATCHSIZE n [MINBATCHSIZE m [MINBATCHTIMEOUT t]]]
 *               [INPUTS name... OUTPUTS name...] BLOB blob...            (deprecated by RedisAI)
 * AI.MODELGET   key [META] [BLOB]
 * AI.MODELDEL   key
 * AI.SCRIPTSET  key device [TAG tag] SOURCE source                       (deprecated by RedisAI)
 * AI.SCRIPTSTORE key device [TAG tag] ENTRY_POINTS n name... SOURCE source
 * AI.SCRIPTGET  key [META] [SOURCE]
 * AI.SCRIPTDEL  key
 *
 * Backend TORCH only (TorchScript and torch.export archives, run by the workers); TF, TFLITE and
 * ONNX are refused. What a model or script may do is checked by the worker that loads it.
 */
#include <ctype.h>
#include <string.h>
#include <strings.h>

#include "srio.h"

/* RedisAI's device rule: CPU, GPU, CPU:<n> or GPU:<n>; upper-cased copy in out, or 0. */
static int parse_device(RedisModuleString *arg, char out[16]) {
    size_t len;
    const char *d = RedisModule_StringPtrLen(arg, &len);
    if (len < 3 || len >= 10 || (strncasecmp(d, "CPU", 3) && strncasecmp(d, "GPU", 3))) return 0;
    if (len > 3) {
        if (d[3] != ':' || len == 4) return 0;
        for (size_t i = 4; i < len; i++) {
            if (!isdigit((unsigned char)d[i])) return 0;
        }
    }
    for (size_t i = 0; i < len; i++) out[i] = (char)toupper((unsigned char)d[i]);
    out[len] = '\0';
    return 1;
}

static int parse_count(RedisModuleString *arg, long long *v) {
    return RedisModule_StringToLongLong(arg, v) == REDISMODULE_OK && *v >= 0;
}

/* Whether the key is empty or holds a manifest of `kind`; otherwise replies WRONGTYPE. */
static int check_replaceable(RedisModuleCtx *ctx, RedisModuleString *keyname, const char *kind) {
    SRIO_Manifest m;
    int status = SRIO_ManifestRead(ctx, keyname, &m);
    int ok = status == SRIO_EMPTY || (status == SRIO_OK && !strcmp(m.kind, kind));
    if (status == SRIO_OK) SRIO_ManifestFree(&m);
    if (!ok) RedisModule_ReplyWithError(ctx, REDISMODULE_ERRORMSG_WRONGTYPE);
    return ok;
}

/* Store the blob and then the manifest at keyname, and drop the blob the manifest replaced. */
static int store(RedisModuleCtx *ctx, RedisModuleString *keyname, SRIO_Manifest *m, const SRIO_Part *parts,
                 size_t nparts) {
    char version[SRIO_VERSION_HEX + 1];
    SRIO_NewVersion(version);
    m->version = version;
    m->blob = "";
    m->blob_len = 0;
    size_t json_len;
    char *json = SRIO_ManifestJson(m, &json_len);
    if (!json) return SRIO_ReplyError(ctx, "ERR TAG, INPUTS and OUTPUTS must be UTF-8 text");

    SRIO_Manifest old;
    int replaced = SRIO_ManifestRead(ctx, keyname, &old) == SRIO_OK;
    uint64_t nbytes = 0;
    for (size_t i = 0; i < nparts; i++) nbytes += parts[i].len;
    RedisModuleString *blob = SRIO_ManifestBlobKey(ctx, keyname, m);
    char *err;
    int status = SRIO_TensorWrite(ctx, blob, SRIO_UINT8, 1, &nbytes, parts, nparts, nbytes, &err);
    RedisModule_FreeString(ctx, blob);
    if (status == REDISMODULE_OK && SRIO_SetString(ctx, keyname, json, json_len) != REDISMODULE_OK) {
        err = SRIO_Format("the server could not store the manifest at key '%s'", SRIO_Name(keyname));
        status = REDISMODULE_ERR;
    }
    RedisModule_Free(json);
    if (replaced) {
        if (status == REDISMODULE_OK && !old.blob_len) {
            RedisModuleString *old_blob = SRIO_ManifestBlobKey(ctx, keyname, &old);
            SRIO_TensorDelete(ctx, old_blob);
            RedisModule_FreeString(ctx, old_blob);
        }
        SRIO_ManifestFree(&old);
    }
    if (status != REDISMODULE_OK) {
        SRIO_ReplyError(ctx, "ERR %s", err);
        RedisModule_Free(err);
        return REDISMODULE_OK;
    }
    SRIO_ExecResetStats(keyname);
    return RedisModule_ReplyWithSimpleString(ctx, "OK");
}

/* AI.MODELSTORE and the deprecated AI.MODELSET, which names no counts for INPUTS and OUTPUTS */
static int model_store(RedisModuleCtx *ctx, RedisModuleString **argv, int argc, int deprecated) {
    if (argc < (deprecated ? 4 : 6)) return RedisModule_WrongArity(ctx);
    if (!SRIO_CheckBackend(ctx, argv[2])) return REDISMODULE_OK;
    char device[16];
    if (!parse_device(argv[3], device)) return SRIO_ReplyError(ctx, "ERR Invalid DEVICE");
    SRIO_Manifest m = {.kind = "model", .backend = "TORCH", .device = device, .tag = "", .tag_len = 0};
    int i = 4;
    if (i + 1 < argc && SRIO_Is(argv[i], "TAG")) {
        m.tag = (char *)RedisModule_StringPtrLen(argv[i + 1], &m.tag_len);
        i += 2;
    }
    if (i < argc && SRIO_Is(argv[i], "BATCHSIZE")) {
        if (i + 1 >= argc || !parse_count(argv[i + 1], &m.batch_size)) {
            return SRIO_ReplyError(ctx, "ERR Invalid argument for BATCHSIZE");
        }
        i += 2;
    }
    if (i < argc && SRIO_Is(argv[i], "MINBATCHSIZE")) {
        if (i + 1 >= argc || !parse_count(argv[i + 1], &m.min_batch_size)) {
            return SRIO_ReplyError(ctx, "ERR Invalid argument for MINBATCHSIZE");
        }
        if (m.batch_size == 0 && m.min_batch_size > 0) {
            return SRIO_ReplyError(ctx, "ERR MINBATCHSIZE specified without BATCHSIZE");
        }
        i += 2;
    }
    if (i < argc && SRIO_Is(argv[i], "MINBATCHTIMEOUT")) {
        if (i + 1 >= argc || !parse_count(argv[i + 1], &m.min_batch_timeout)) {
            return SRIO_ReplyError(ctx, "ERR Invalid argument for MINBATCHTIMEOUT");
        }
        if (m.min_batch_size == 0 && m.min_batch_timeout > 0) {
            return SRIO_ReplyError(ctx, "ERR MINBATCHTIMEOUT specified without MINBATCHSIZE");
        }
        i += 2;
    }
    if (i >= argc) return SRIO_ReplyError(ctx, "ERR Insufficient arguments, missing model BLOB");
    if (deprecated) {
        while (i < argc && !SRIO_Is(argv[i], "BLOB")) i++; /* INPUTS/OUTPUTS name only TF's tensors */
    } else if (SRIO_Is(argv[i], "INPUTS")) {
        return SRIO_ReplyError(ctx, "ERR INPUTS argument should not be specified for this backend");
    } else if (!SRIO_Is(argv[i], "BLOB")) {
        return SRIO_ReplyError(ctx, "ERR Invalid argument, expected BLOB");
    }
    if (i + 1 >= argc) return SRIO_ReplyError(ctx, "ERR Insufficient arguments, missing model BLOB");
    i++;
    size_t nparts = (size_t)(argc - i);
    SRIO_Part *parts = RedisModule_Alloc(nparts * sizeof(SRIO_Part));
    char magic[4];
    size_t have = 0;
    for (size_t k = 0; k < nparts; k++) {
        parts[k].ptr = RedisModule_StringPtrLen(argv[i + (int)k], &parts[k].len);
        parts[k].str = argv[i + (int)k];
        for (size_t b = 0; b < parts[k].len && have < 4; b++) magic[have++] = parts[k].ptr[b];
    }
    int ret;
    if (have < 4 || memcmp(magic, "PK\x03\x04", 4) != 0) {
        ret = SRIO_ReplyError(
            ctx, "ERR the model is neither a TorchScript archive (torch.jit.save) nor a torch.export archive "
                 "(torch.export.save)");
    } else if (check_replaceable(ctx, argv[1], "model")) {
        ret = store(ctx, argv[1], &m, parts, nparts);
    } else {
        ret = REDISMODULE_OK;
    }
    RedisModule_Free(parts);
    return ret;
}

static int ModelStore(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    return model_store(ctx, argv, argc, 0);
}

static int ModelSet(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    return model_store(ctx, argv, argc, 1);
}

/* The manifest of `kind` at argv[1]; replies with the error and returns 0 when there is none. */
static int read_kind(RedisModuleCtx *ctx, RedisModuleString *keyname, const char *kind, SRIO_Manifest *m) {
    int status = SRIO_ManifestRead(ctx, keyname, m);
    if (status == SRIO_OK && strcmp(m->kind, kind)) {
        SRIO_ManifestFree(m);
        status = SRIO_WRONGTYPE;
    }
    if (status != SRIO_OK) {
        SRIO_ReplyReadError(ctx, status, kind, NULL);
        return 0;
    }
    return 1;
}

/* Open the blob of a manifest read from keyname; replies with the error and returns 0 on failure. */
static int open_blob(RedisModuleCtx *ctx, RedisModuleString *keyname, const SRIO_Manifest *m, SRIO_Tensor *t) {
    RedisModuleString *blob = SRIO_ManifestBlobKey(ctx, keyname, m);
    /* an alias names another model's blob: the caller must be allowed to read that key too */
    if (m->blob_len && !SRIO_UserMayAccess(ctx, blob, REDISMODULE_CMD_KEY_ACCESS)) {
        RedisModule_FreeString(ctx, blob);
        SRIO_ReplyError(ctx, "NOPERM this user has no permissions to access the model an alias points to");
        return 0;
    }
    char *err;
    int status = SRIO_TensorOpen(ctx, blob, t, &err);
    if (status != SRIO_OK) {
        SRIO_ReplyError(ctx, "ERR the %s at key '%s' is corrupt: its bytes (key '%s') %s", m->kind, SRIO_Name(keyname),
                        SRIO_Name(blob), status == SRIO_EMPTY ? "do not exist" : err ? err : "are not a tensor");
        if (err) RedisModule_Free(err);
    }
    RedisModule_FreeString(ctx, blob);
    return status == SRIO_OK;
}

static void reply_chunks(RedisModuleCtx *ctx, const char *data, uint64_t len) {
    uint64_t size = (uint64_t)SRIO_Config.model_chunk_size, n = len ? (len + size - 1) / size : 1;
    if (n > 1) {
        RedisModule_ReplyWithArray(ctx, (long)n);
        for (uint64_t i = 0; i < n; i++) RedisModule_ReplyWithStringBuffer(ctx, data + i * size, i + 1 < n ? size : len - i * size);
    } else {
        RedisModule_ReplyWithStringBuffer(ctx, data, len);
    }
}

static void reply_list(RedisModuleCtx *ctx, char **items, size_t n) {
    RedisModule_ReplyWithArray(ctx, (long)n);
    for (size_t i = 0; i < n; i++) RedisModule_ReplyWithCString(ctx, items[i]);
}

/* AI.MODELGET key [META] [BLOB] */
static int ModelGet(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc < 2 || argc > 4) return RedisModule_WrongArity(ctx);
    SRIO_Manifest m;
    if (!read_kind(ctx, argv[1], "model", &m)) return REDISMODULE_OK;
    int meta = 0, blob = 0;
    for (int i = 2; i < argc; i++) {
        if (SRIO_Is(argv[i], "META")) meta = 1;
        else if (SRIO_Is(argv[i], "BLOB")) blob = 1;
    }
    SRIO_Tensor t = {0};
    if ((!meta || blob) && !open_blob(ctx, argv[1], &m, &t)) {
        SRIO_ManifestFree(&m);
        return REDISMODULE_OK;
    }
    if (!meta && blob) {
        reply_chunks(ctx, t.data, t.h.nbytes);
    } else {
        RedisModule_ReplyWithArray(ctx, meta && !blob ? 16 : 18);
        RedisModule_ReplyWithCString(ctx, "backend");
        RedisModule_ReplyWithCString(ctx, m.backend);
        RedisModule_ReplyWithCString(ctx, "device");
        RedisModule_ReplyWithCString(ctx, m.device);
        RedisModule_ReplyWithCString(ctx, "tag");
        RedisModule_ReplyWithStringBuffer(ctx, m.tag, m.tag_len);
        RedisModule_ReplyWithCString(ctx, "batchsize");
        RedisModule_ReplyWithLongLong(ctx, m.batch_size);
        RedisModule_ReplyWithCString(ctx, "minbatchsize");
        RedisModule_ReplyWithLongLong(ctx, m.min_batch_size);
        RedisModule_ReplyWithCString(ctx, "inputs");
        reply_list(ctx, m.inputs, m.ninputs);
        RedisModule_ReplyWithCString(ctx, "outputs");
        reply_list(ctx, m.outputs, m.noutputs);
        RedisModule_ReplyWithCString(ctx, "minbatchtimeout");
        RedisModule_ReplyWithLongLong(ctx, m.min_batch_timeout);
        if (!meta || blob) {
            RedisModule_ReplyWithCString(ctx, "blob");
            reply_chunks(ctx, t.data, t.h.nbytes);
        }
    }
    SRIO_TensorClose(&t);
    SRIO_ManifestFree(&m);
    return REDISMODULE_OK;
}

/* Delete the manifest of `kind` at argv[1] and the blob it owns */
static int delete_kind(RedisModuleCtx *ctx, RedisModuleString **argv, int argc, const char *kind) {
    if (argc != 2) return RedisModule_WrongArity(ctx);
    SRIO_Manifest m;
    if (!read_kind(ctx, argv[1], kind, &m)) return REDISMODULE_OK;
    SRIO_DeleteKey(ctx, argv[1]);
    RedisModule_NotifyKeyspaceEvent(ctx, REDISMODULE_NOTIFY_GENERIC, "del", argv[1]);
    if (!m.blob_len) {
        RedisModuleString *blob = SRIO_ManifestBlobKey(ctx, argv[1], &m);
        SRIO_TensorDelete(ctx, blob);
        RedisModule_FreeString(ctx, blob);
    }
    SRIO_ManifestFree(&m);
    SRIO_ExecResetStats(argv[1]);
    return RedisModule_ReplyWithSimpleString(ctx, "OK");
}

static int ModelDel(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    return delete_kind(ctx, argv, argc, "model");
}

static int ScriptDel(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    return delete_kind(ctx, argv, argc, "script");
}

/* The names of the functions a script defines at its top level (`def name(`), in order. */
static size_t entry_points(const char *src, size_t len, const char **names, size_t *lens, size_t max) {
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        if ((i == 0 || src[i - 1] == '\n') && i + 4 < len && !memcmp(src + i, "def", 3) &&
            (src[i + 3] == ' ' || src[i + 3] == '\t')) {
            size_t j = i + 3;
            while (j < len && (src[j] == ' ' || src[j] == '\t')) j++;
            size_t start = j;
            while (j < len && (isalnum((unsigned char)src[j]) || src[j] == '_' || (unsigned char)src[j] >= 0x80)) j++;
            size_t end = j;
            while (j < len && (src[j] == ' ' || src[j] == '\t')) j++;
            if (end > start && j < len && src[j] == '(') {
                if (names && n < max) {
                    names[n] = src + start;
                    lens[n] = end - start;
                }
                n++;
            }
        }
    }
    return n;
}

static int defines(const char *src, size_t len, const char *name, size_t name_len) {
    size_t n = entry_points(src, len, NULL, NULL, 0);
    const char **names = RedisModule_Alloc((n + 1) * sizeof(char *));
    size_t *lens = RedisModule_Alloc((n + 1) * sizeof(size_t));
    entry_points(src, len, names, lens, n);
    int found = 0;
    for (size_t i = 0; i < n && !found; i++) found = lens[i] == name_len && !memcmp(names[i], name, name_len);
    RedisModule_Free(names);
    RedisModule_Free(lens);
    return found;
}

/* AI.SCRIPTSET (deprecated) and AI.SCRIPTSTORE, which names the script's entry points */
static int script_store(RedisModuleCtx *ctx, RedisModuleString **argv, int argc, int with_entry_points) {
    if (with_entry_points ? argc < 8 : argc != 5 && argc != 7) return RedisModule_WrongArity(ctx);
    char device[16];
    if (!parse_device(argv[2], device)) return SRIO_ReplyError(ctx, "ERR Invalid DEVICE");
    SRIO_Manifest m = {.kind = "script", .backend = "TORCH", .device = device, .tag = "", .tag_len = 0};
    int i = 3;
    if (i + 1 < argc && SRIO_Is(argv[i], "TAG")) {
        m.tag = (char *)RedisModule_StringPtrLen(argv[i + 1], &m.tag_len);
        i += 2;
    }
    int first_entry = 0;
    long long nentries = 0;
    if (with_entry_points) {
        if (i >= argc || !SRIO_Is(argv[i], "ENTRY_POINTS")) {
            return SRIO_ReplyError(ctx, "ERR Insufficient arguments, missing script entry points");
        }
        if (i + 1 >= argc || RedisModule_StringToLongLong(argv[i + 1], &nentries) != REDISMODULE_OK || nentries < 0) {
            return SRIO_ReplyError(ctx, "ERR Non numeric entry points number provided to AI.SCRIPTSTORE command");
        }
        if (nentries > argc - i - 2) {
            return SRIO_ReplyError(ctx, "ERR Insufficient arguments, missing script entry points");
        }
        first_entry = i + 2;
        i = first_entry + (int)nentries;
    }
    if (i + 1 >= argc || !SRIO_Is(argv[i], "SOURCE")) {
        return SRIO_ReplyError(ctx, "ERR Insufficient arguments, missing script SOURCE");
    }
    SRIO_Part source = {.str = argv[i + 1]};
    source.ptr = RedisModule_StringPtrLen(argv[i + 1], &source.len);
    if (!SRIO_IsUtf8(source.ptr, source.len)) {
        return SRIO_ReplyError(ctx, "ERR the script SOURCE is not UTF-8 text");
    }
    for (long long k = 0; k < nentries; k++) {
        size_t len;
        const char *name = RedisModule_StringPtrLen(argv[first_entry + k], &len);
        if (!defines(source.ptr, source.len, name, len)) {
            return SRIO_ReplyError(ctx, "ERR entry point '%s' is not a function the script defines",
                                   SRIO_Name(argv[first_entry + k]));
        }
    }
    if (!check_replaceable(ctx, argv[1], "script")) return REDISMODULE_OK;
    return store(ctx, argv[1], &m, &source, 1);
}

static int ScriptSet(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    return script_store(ctx, argv, argc, 0);
}

static int ScriptStore(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    return script_store(ctx, argv, argc, 1);
}

/* AI.SCRIPTGET key [META] [SOURCE] */
static int ScriptGet(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc < 2 || argc > 4) return RedisModule_WrongArity(ctx);
    SRIO_Manifest m;
    if (!read_kind(ctx, argv[1], "script", &m)) return REDISMODULE_OK;
    int meta = 0, source = 0;
    for (int i = 2; i < argc; i++) {
        if (SRIO_Is(argv[i], "META")) meta = 1;
        else if (SRIO_Is(argv[i], "SOURCE")) source = 1;
    }
    SRIO_Tensor t;
    if (!open_blob(ctx, argv[1], &m, &t)) {
        SRIO_ManifestFree(&m);
        return REDISMODULE_OK;
    }
    if (!meta && source) {
        RedisModule_ReplyWithStringBuffer(ctx, t.data, t.h.nbytes);
    } else {
        RedisModule_ReplyWithArray(ctx, source || !meta ? 8 : 6);
        RedisModule_ReplyWithCString(ctx, "device");
        RedisModule_ReplyWithCString(ctx, m.device);
        RedisModule_ReplyWithCString(ctx, "tag");
        RedisModule_ReplyWithStringBuffer(ctx, m.tag, m.tag_len);
        RedisModule_ReplyWithCString(ctx, "Entry Points");
        size_t n = entry_points(t.data, t.h.nbytes, NULL, NULL, 0);
        const char **names = RedisModule_Alloc((n + 1) * sizeof(char *));
        size_t *lens = RedisModule_Alloc((n + 1) * sizeof(size_t));
        entry_points(t.data, t.h.nbytes, names, lens, n);
        RedisModule_ReplyWithArray(ctx, (long)n);
        for (size_t i = 0; i < n; i++) RedisModule_ReplyWithStringBuffer(ctx, names[i], lens[i]);
        RedisModule_Free(names);
        RedisModule_Free(lens);
        if (source || !meta) {
            RedisModule_ReplyWithCString(ctx, "source");
            RedisModule_ReplyWithStringBuffer(ctx, t.data, t.h.nbytes);
        }
    }
    SRIO_TensorClose(&t);
    SRIO_ManifestFree(&m);
    return REDISMODULE_OK;
}

int SRIO_RegisterModelCommands(RedisModuleCtx *ctx) {
    const uint64_t store = REDISMODULE_CMD_KEY_OW | REDISMODULE_CMD_KEY_UPDATE;
    const uint64_t read = REDISMODULE_CMD_KEY_RO | REDISMODULE_CMD_KEY_ACCESS;
    const uint64_t del = REDISMODULE_CMD_KEY_RW | REDISMODULE_CMD_KEY_DELETE;
    if (SRIO_CreateKeyCommand(ctx, "ai.modelstore", ModelStore, "write deny-oom", -6, store) == REDISMODULE_ERR ||
        SRIO_CreateKeyCommand(ctx, "ai.modelset", ModelSet, "write deny-oom", -4, store) == REDISMODULE_ERR ||
        SRIO_CreateKeyCommand(ctx, "ai.modelget", ModelGet, "readonly", -2, read) == REDISMODULE_ERR ||
        SRIO_CreateKeyCommand(ctx, "ai.modeldel", ModelDel, "write", 2, del) == REDISMODULE_ERR ||
        SRIO_CreateKeyCommand(ctx, "ai.scriptset", ScriptSet, "write deny-oom", -5, store) == REDISMODULE_ERR ||
        SRIO_CreateKeyCommand(ctx, "ai.scriptstore", ScriptStore, "write deny-oom", -8, store) == REDISMODULE_ERR ||
        SRIO_CreateKeyCommand(ctx, "ai.scriptget", ScriptGet, "readonly", -2, read) == REDISMODULE_ERR ||
        SRIO_CreateKeyCommand(ctx, "ai.scriptdel", ScriptDel, "write", 2, del) == REDISMODULE_ERR) {
        return REDISMODULE_ERR;
    }
    return REDISMODULE_OK;
}
