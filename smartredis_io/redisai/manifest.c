/* The manifests of models and scripts: the JSON smartredis_io._client.protocol.Manifest is stored as. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "srio.h"

/* ---- writing: json.dumps(dataclasses.asdict(manifest)) -------------------------------------- */

typedef struct {
    char *buf;
    size_t len, cap;
} Out;

static void put(Out *o, const char *s, size_t n) {
    if (o->len + n + 1 > o->cap) {
        o->cap = (o->len + n + 1) * 2;
        o->buf = RedisModule_Realloc(o->buf, o->cap);
    }
    memcpy(o->buf + o->len, s, n);
    o->len += n;
    o->buf[o->len] = '\0';
}

static void puts_(Out *o, const char *s) {
    put(o, s, strlen(s));
}

/* The next code point of UTF-8 text, or -1 when it is not valid UTF-8. */
static long next_codepoint(const unsigned char *s, size_t len, size_t *i) {
    unsigned c = s[*i];
    int extra = c < 0x80 ? 0 : (c >> 5) == 6 ? 1 : (c >> 4) == 14 ? 2 : (c >> 3) == 30 ? 3 : -1;
    if (extra < 0 || *i + (size_t)extra >= len + (extra ? 0 : 1)) return -1;
    long cp = extra == 0 ? (long)c : (long)(c & (0x3f >> extra));
    for (int k = 1; k <= extra; k++) {
        unsigned d = s[*i + (size_t)k];
        if ((d >> 6) != 2) return -1;
        cp = (cp << 6) | (d & 0x3f);
    }
    static const long MIN[] = {0, 0x80, 0x800, 0x10000};
    if (cp < MIN[extra] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return -1;
    *i += (size_t)extra + 1;
    return cp;
}

int SRIO_IsUtf8(const char *s, size_t len) {
    for (size_t i = 0; i < len;) {
        if (next_codepoint((const unsigned char *)s, len, &i) < 0) return 0;
    }
    return 1;
}

/* A JSON string as Python's json.dumps writes it (ensure_ascii); 0 when s is not UTF-8 text. */
static int put_string(Out *o, const char *s, size_t len) {
    char esc[32];
    put(o, "\"", 1);
    for (size_t i = 0; i < len;) {
        long cp = next_codepoint((const unsigned char *)s, len, &i);
        if (cp < 0) return 0;
        switch (cp) {
        case '"': puts_(o, "\\\""); continue;
        case '\\': puts_(o, "\\\\"); continue;
        case '\n': puts_(o, "\\n"); continue;
        case '\r': puts_(o, "\\r"); continue;
        case '\t': puts_(o, "\\t"); continue;
        case '\b': puts_(o, "\\b"); continue;
        case '\f': puts_(o, "\\f"); continue;
        }
        if (cp >= 0x20 && cp < 0x7f) {
            char c = (char)cp;
            put(o, &c, 1);
        } else if (cp < 0x10000) {
            snprintf(esc, sizeof(esc), "\\u%04x", (unsigned)cp);
            puts_(o, esc);
        } else {
            long v = cp - 0x10000;
            snprintf(esc, sizeof(esc), "\\u%04x\\u%04x", (unsigned)(0xd800 + (v >> 10)), (unsigned)(0xdc00 + (v & 0x3ff)));
            puts_(o, esc);
        }
    }
    put(o, "\"", 1);
    return 1;
}

static int put_field(Out *o, const char *name, const char *value, size_t len) {
    puts_(o, ", \"");
    puts_(o, name);
    puts_(o, "\": ");
    return put_string(o, value ? value : "", value ? len : 0);
}

static void put_int(Out *o, const char *name, long long v) {
    char num[64];
    snprintf(num, sizeof(num), ", \"%s\": %lld", name, v);
    puts_(o, num);
}

static int put_list(Out *o, const char *name, char **items, size_t n) {
    puts_(o, ", \"");
    puts_(o, name);
    puts_(o, "\": [");
    for (size_t i = 0; i < n; i++) {
        if (i) puts_(o, ", ");
        if (!put_string(o, items[i], strlen(items[i]))) return 0;
    }
    puts_(o, "]");
    return 1;
}

char *SRIO_ManifestJson(const SRIO_Manifest *m, size_t *len) {
    Out o = {0};
    puts_(&o, "{\"kind\": ");
    int ok = put_string(&o, m->kind, strlen(m->kind)) && put_field(&o, "version", m->version, strlen(m->version)) &&
             put_field(&o, "backend", m->backend, strlen(m->backend)) &&
             put_field(&o, "device", m->device, strlen(m->device));
    if (ok) {
        put_int(&o, "batch_size", m->batch_size);
        put_int(&o, "min_batch_size", m->min_batch_size);
        put_int(&o, "min_batch_timeout", m->min_batch_timeout);
        ok = put_field(&o, "tag", m->tag, m->tag_len) && put_list(&o, "inputs", m->inputs, m->ninputs) &&
             put_list(&o, "outputs", m->outputs, m->noutputs) && put_field(&o, "blob", m->blob, m->blob_len);
    }
    if (!ok) {
        RedisModule_Free(o.buf);
        return NULL;
    }
    puts_(&o, "}");
    *len = o.len;
    return o.buf;
}

/* ---- reading ---------------------------------------------------------------------------------- */

typedef struct {
    const char *s;
    size_t len, i;
} In;

static void ws(In *in) {
    while (in->i < in->len && (in->s[in->i] == ' ' || in->s[in->i] == '\t' || in->s[in->i] == '\n' || in->s[in->i] == '\r')) in->i++;
}

static int eat(In *in, char c) {
    ws(in);
    if (in->i < in->len && in->s[in->i] == c) {
        in->i++;
        return 1;
    }
    return 0;
}

static void put_utf8(Out *o, long cp) {
    char b[4];
    size_t n;
    if (cp < 0x80) { b[0] = (char)cp; n = 1; }
    else if (cp < 0x800) { b[0] = (char)(0xc0 | (cp >> 6)); b[1] = (char)(0x80 | (cp & 0x3f)); n = 2; }
    else if (cp < 0x10000) { b[0] = (char)(0xe0 | (cp >> 12)); b[1] = (char)(0x80 | ((cp >> 6) & 0x3f)); b[2] = (char)(0x80 | (cp & 0x3f)); n = 3; }
    else { b[0] = (char)(0xf0 | (cp >> 18)); b[1] = (char)(0x80 | ((cp >> 12) & 0x3f)); b[2] = (char)(0x80 | ((cp >> 6) & 0x3f)); b[3] = (char)(0x80 | (cp & 0x3f)); n = 4; }
    put(o, b, n);
}

static long hex4(In *in) {
    if (in->i + 4 > in->len) return -1;
    long v = 0;
    for (int k = 0; k < 4; k++) {
        char c = in->s[in->i++];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= c - '0';
        else if (c >= 'a' && c <= 'f') v |= c - 'a' + 10;
        else if (c >= 'A' && c <= 'F') v |= c - 'A' + 10;
        else return -1;
    }
    return v;
}

/* A JSON string, decoded into a new NUL-terminated buffer (its length in *n); NULL if malformed. */
static char *string(In *in, size_t *n) {
    if (!eat(in, '"')) return NULL;
    Out o = {0};
    put(&o, "", 0);
    while (in->i < in->len) {
        char c = in->s[in->i++];
        if (c == '"') {
            if (n) *n = o.len;
            return o.buf;
        }
        if (c != '\\') {
            put(&o, &c, 1);
            continue;
        }
        if (in->i >= in->len) break;
        c = in->s[in->i++];
        const char *simple = strchr("\"\\/bfnrt", c);
        if (simple && c) {
            static const char MAP[] = "\"\\/\b\f\n\r\t";
            put(&o, &MAP[simple - "\"\\/bfnrt"], 1);
            continue;
        }
        if (c != 'u') break;
        long cp = hex4(in);
        if (cp < 0) break;
        if (cp >= 0xd800 && cp < 0xdc00 && in->i + 6 <= in->len && in->s[in->i] == '\\' && in->s[in->i + 1] == 'u') {
            size_t at = in->i;
            in->i += 2;
            long lo = hex4(in);
            if (lo >= 0xdc00 && lo < 0xe000) cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
            else in->i = at;
        }
        put_utf8(&o, cp);
    }
    RedisModule_Free(o.buf);
    return NULL;
}

static int integer(In *in, long long *v) {
    ws(in);
    char *end;
    if (in->i >= in->len) return 0;
    char buf[32];
    size_t n = 0;
    while (in->i + n < in->len && n < sizeof(buf) - 1 && strchr("-+0123456789.eE", in->s[in->i + n]) && in->s[in->i + n]) n++;
    memcpy(buf, in->s + in->i, n);
    buf[n] = '\0';
    *v = strtoll(buf, &end, 10);
    if (n == 0 || *end) return 0;
    in->i += n;
    return 1;
}

static char **string_list(In *in, size_t *count) {
    if (!eat(in, '[')) return NULL;
    char **items = RedisModule_Calloc(1, sizeof(char *));
    size_t n = 0;
    if (!eat(in, ']')) {
        do {
            char *item = string(in, NULL);
            if (!item) goto fail;
            items = RedisModule_Realloc(items, (n + 2) * sizeof(char *));
            items[n++] = item;
        } while (eat(in, ','));
        if (!eat(in, ']')) goto fail;
    }
    *count = n;
    return items;
fail:
    for (size_t k = 0; k < n; k++) RedisModule_Free(items[k]);
    RedisModule_Free(items);
    return NULL;
}

/* Skip a value of a field this module does not know (a newer writer's), nested at most
 * SRIO_MANIFEST_MAX_DEPTH deep: the parser's stack is bounded whatever the key holds. */
static int skip(In *in, int depth) {
    ws(in);
    if (in->i >= in->len || depth > SRIO_MANIFEST_MAX_DEPTH) return 0;
    char c = in->s[in->i];
    if (c == '"') {
        char *s = string(in, NULL);
        if (!s) return 0;
        RedisModule_Free(s);
        return 1;
    }
    if (c == '[' || c == '{') {
        char close = c == '[' ? ']' : '}';
        in->i++;
        if (eat(in, close)) return 1;
        do {
            if (c == '{') {
                char *k = string(in, NULL);
                if (!k) return 0;
                RedisModule_Free(k);
                if (!eat(in, ':')) return 0;
            }
            if (!skip(in, depth + 1)) return 0;
        } while (eat(in, ','));
        return eat(in, close);
    }
    size_t start = in->i;
    while (in->i < in->len && !strchr(",]} \t\r\n", in->s[in->i])) in->i++;
    return in->i > start;
}

void SRIO_ManifestFree(SRIO_Manifest *m) {
    char **strings[] = {&m->kind, &m->version, &m->backend, &m->device, &m->tag, &m->blob};
    for (size_t i = 0; i < sizeof(strings) / sizeof(strings[0]); i++) {
        if (*strings[i]) RedisModule_Free(*strings[i]);
        *strings[i] = NULL;
    }
    for (size_t i = 0; i < m->ninputs; i++) RedisModule_Free(m->inputs[i]);
    for (size_t i = 0; i < m->noutputs; i++) RedisModule_Free(m->outputs[i]);
    if (m->inputs) RedisModule_Free(m->inputs);
    if (m->outputs) RedisModule_Free(m->outputs);
    memset(m, 0, sizeof(*m));
}

static char *dup_cstr(const char *s) {
    size_t n = strlen(s);
    char *out = RedisModule_Alloc(n + 1);
    memcpy(out, s, n + 1);
    return out;
}

int SRIO_ManifestParse(const char *json, size_t len, SRIO_Manifest *m) {
    memset(m, 0, sizeof(*m));
    size_t plen = strlen(SRIO_MANIFEST_PREFIX);
    if (len < plen || len > SRIO_MANIFEST_MAX_BYTES || memcmp(json, SRIO_MANIFEST_PREFIX, plen) != 0) return SRIO_WRONGTYPE;
    In in = {json, len, 0};
    if (!eat(&in, '{')) return SRIO_WRONGTYPE;
    if (!eat(&in, '}')) {
        do {
            char *name = string(&in, NULL);
            if (!name || !eat(&in, ':')) {
                if (name) RedisModule_Free(name);
                goto fail;
            }
            int ok = 1;
            char **target = !strcmp(name, "kind") ? &m->kind : !strcmp(name, "version") ? &m->version
                          : !strcmp(name, "backend") ? &m->backend : !strcmp(name, "device") ? &m->device
                          : !strcmp(name, "tag") ? &m->tag : !strcmp(name, "blob") ? &m->blob : NULL;
            size_t *target_len = target == &m->tag ? &m->tag_len : target == &m->blob ? &m->blob_len : NULL;
            if (target) {
                if (*target) RedisModule_Free(*target);
                *target = string(&in, target_len);
                ok = *target != NULL;
            } else if (!strcmp(name, "batch_size")) {
                ok = integer(&in, &m->batch_size);
            } else if (!strcmp(name, "min_batch_size")) {
                ok = integer(&in, &m->min_batch_size);
            } else if (!strcmp(name, "min_batch_timeout")) {
                ok = integer(&in, &m->min_batch_timeout);
            } else if (!strcmp(name, "inputs") && !m->inputs) {
                ok = (m->inputs = string_list(&in, &m->ninputs)) != NULL;
            } else if (!strcmp(name, "outputs") && !m->outputs) {
                ok = (m->outputs = string_list(&in, &m->noutputs)) != NULL;
            } else {
                ok = skip(&in, 1);
            }
            RedisModule_Free(name);
            if (!ok) goto fail;
        } while (eat(&in, ','));
        if (!eat(&in, '}')) goto fail;
    }
    if (!m->kind || !m->version || (strcmp(m->kind, "model") && strcmp(m->kind, "script"))) goto fail;
    if (!m->backend) m->backend = dup_cstr("TORCH");
    if (!m->device) m->device = dup_cstr("CPU");
    if (!m->tag) m->tag = dup_cstr("");
    if (!m->blob) m->blob = dup_cstr("");
    if (!m->inputs) m->inputs = RedisModule_Calloc(1, sizeof(char *));
    if (!m->outputs) m->outputs = RedisModule_Calloc(1, sizeof(char *));
    return SRIO_OK;
fail:
    SRIO_ManifestFree(m);
    return SRIO_WRONGTYPE;
}

int SRIO_ManifestRead(RedisModuleCtx *ctx, RedisModuleString *keyname, SRIO_Manifest *m) {
    memset(m, 0, sizeof(*m));
    RedisModuleKey *key = RedisModule_OpenKey(ctx, keyname, REDISMODULE_READ);
    int type = RedisModule_KeyType(key), status = SRIO_WRONGTYPE;
    if (type == REDISMODULE_KEYTYPE_EMPTY) {
        status = SRIO_EMPTY;
    } else if (type == REDISMODULE_KEYTYPE_STRING) {
        size_t len;
        const char *p = RedisModule_StringDMA(key, &len, REDISMODULE_READ);
        status = SRIO_ManifestParse(p, len, m);
    }
    RedisModule_CloseKey(key);
    return status;
}

RedisModuleString *SRIO_ManifestBlobKey(RedisModuleCtx *ctx, RedisModuleString *keyname, const SRIO_Manifest *m) {
    if (m->blob && m->blob_len) return RedisModule_CreateString(ctx, m->blob, m->blob_len);
    char suffix[SRIO_VERSION_HEX + 64];
    int n = snprintf(suffix, sizeof(suffix), ".blob.");
    size_t vlen = strlen(m->version);
    RedisModuleString *partial = SRIO_TaggedKey(ctx, keyname, suffix, (size_t)n);
    RedisModule_StringAppendBuffer(ctx, partial, m->version, vlen);
    return partial;
}

void SRIO_NewVersion(char out[SRIO_VERSION_HEX + 1]) {
    /* uuid4().hex's shape: 32 lowercase hex characters */
    RedisModule_GetRandomHexChars(out, SRIO_VERSION_HEX);
    for (int i = 0; i < SRIO_VERSION_HEX; i++) {
        if (out[i] >= 'A' && out[i] <= 'F') out[i] = (char)(out[i] - 'A' + 'a');
    }
    out[SRIO_VERSION_HEX] = '\0';
}
