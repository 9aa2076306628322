/* The module's load-time arguments (NAME value pairs, keywords case-insensitive), and the worker
 * secret.
 *
 * Storage: MODEL_CHUNK_SIZE <bytes> (AI.MODELGET's pieces), BULK_LIMIT_BYTES <bytes> (values larger
 * than this are chunked; smartredis_io's own), MAX_TENSOR_BYTES <bytes> (the largest tensor a client
 * may store; default: Redis' proto-max-bulk-len), BACKENDSPATH <path>.
 *
 * Execution workers the module starts (spawn.c): WORKERS <n> (0: none, external workers only;
 * RedisAI's THREADS_PER_QUEUE sets it when WORKERS is not given), WORKER_PYTHON <path>, WORKER_DEVICE
 * cpu|cuda|cuda:N, WORKER_USER <name> (or $SRIO_WORKER_USER for a server running as root; an existing
 * user other than root, checked here: the module refuses to load otherwise), INTRA_OP_PARALLELISM <n>
 * and INTER_OP_PARALLELISM <n> (their torch threads), WORKER_STARTUP_MS <ms> (how long requests wait
 * for the replacement of a worker that died). Requests: MODEL_EXECUTION_TIMEOUT <ms> caps a run's
 * deadline, QUEUE_TIMEOUT <ms> fails a request no worker takes that long (0: only its own deadline).
 *
 * The worker secret that SRIO.HELLO must say: the first line of WORKER_SECRET_FILE <path> (or
 * $SRIO_WORKER_SECRET_FILE), a file only its owner may read or write, holding 16 to 256 bytes of
 * printable ASCII without spaces; else 32 random bytes from the kernel (getrandom, or /dev/urandom),
 * in hex, which only the workers the module starts receive. The module refuses to load when the
 * file breaks a rule or no random bytes can be had.
 *
 * RedisAI's TORCH, TF, TFLITE, ONNX and BACKEND_MEMORY_LIMIT are accepted and logged as not
 * applicable (models of TF, TFLITE and ONNX are refused when stored).
 */
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "srio.h"

#define DEFAULT_WORKERS 1
#define DEFAULT_QUEUE_TIMEOUT_MS 30000
#define DEFAULT_STARTUP_MS 20000
#define MAX_TIMEOUT_MS (7LL * 24 * 3600 * 1000)
#define SECRET_RANDOM_BYTES 32
#define SECRET_FILE_MAX_BYTES 4096

SRIO_Settings SRIO_Config = {
    .bulk_limit = SRIO_DEFAULT_BULK_LIMIT,
    .model_chunk_size = 511LL * 1024 * 1024, /* RedisAI's default */
    .workers = DEFAULT_WORKERS,
    .queue_timeout_ms = DEFAULT_QUEUE_TIMEOUT_MS,
    .startup_ms = DEFAULT_STARTUP_MS,
    .worker_uid = -1,
    .worker_gid = -1,
};

static uint64_t proto_max_bulk_len = SRIO_DEFAULT_BULK_LIMIT;

uint64_t SRIO_MaxTensorBytes(void) {
    return SRIO_Config.max_tensor_bytes ? SRIO_Config.max_tensor_bytes : proto_max_bulk_len;
}

void SRIO_RefreshServerLimits(RedisModuleCtx *ctx) {
    RedisModuleCallReply *reply = RedisModule_Call(ctx, "CONFIG", "cc", "GET", "proto-max-bulk-len");
    if (reply == NULL) return;
    if (RedisModule_CallReplyType(reply) == REDISMODULE_REPLY_ARRAY && RedisModule_CallReplyLength(reply) == 2) {
        long long value;
        RedisModuleString *text = RedisModule_CreateStringFromCallReply(RedisModule_CallReplyArrayElement(reply, 1));
        if (text && RedisModule_StringToLongLong(text, &value) == REDISMODULE_OK && value > 0) {
            proto_max_bulk_len = (uint64_t)value;
        }
        if (text) RedisModule_FreeString(NULL, text);
    }
    RedisModule_FreeCallReply(reply);
}

static int to_count(RedisModuleString *arg, long long min, long long max, long long *out) {
    return RedisModule_StringToLongLong(arg, out) == REDISMODULE_OK && *out >= min && *out <= max;
}

static char *dup_string(RedisModuleString *arg) {
    size_t n;
    const char *p = RedisModule_StringPtrLen(arg, &n);
    char *out = RedisModule_Alloc(n + 1);
    memcpy(out, p, n);
    out[n] = '\0';
    return out;
}

static char *dup_cstr(const char *s) {
    size_t n = strlen(s);
    char *out = RedisModule_Alloc(n + 1);
    memcpy(out, s, n + 1);
    return out;
}

/* cpu, cuda or cuda:N, as `python -m smartredis_io.worker --device` takes them */
static int is_device(const char *d) {
    if (!strcmp(d, "cpu") || !strcmp(d, "cuda")) return 1;
    if (strncmp(d, "cuda:", 5) || !d[5] || strlen(d) > 9) return 0;
    for (const char *c = d + 5; *c; c++) {
        if (!isdigit((unsigned char)*c)) return 0;
    }
    return 1;
}

/* A name with no space, quote or control character, as a user name or a path is passed on. */
static int is_plain(const char *s) {
    if (!*s) return 0;
    for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
        if (*c < 0x20 || *c == 0x7f) return 0;
    }
    return 1;
}

int SRIO_SecretValid(const unsigned char *s, size_t len) {
    if (len < SRIO_SECRET_MIN || len > SRIO_SECRET_MAX) return 0;
    for (size_t i = 0; i < len; i++) {
        if (s[i] < 0x21 || s[i] > 0x7e) return 0;
    }
    return 1;
}

static void set_secret(const unsigned char *bytes, size_t len) {
    memcpy(SRIO_Config.secret, bytes, len);
    SRIO_Config.secret_len = len;
}

/* The whitespace stripped around a secret's line, as smartredis_io.worker.worker_protocol.SECRET_STRIP. */
static int is_strip(unsigned char c) { return c == ' ' || c == '\t' || c == '\v' || c == '\f' || c == '\r'; }

/* The first line of `path`, stripped, as the secret; REDISMODULE_ERR after logging why not. The
 * file must be a regular file only its owner may read or write: the secret lets a connection take
 * every user's requests and write their outputs. */
static int read_secret_file(RedisModuleCtx *ctx, const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    if (fd < 0) {
        RedisModule_Log(ctx, "warning", "worker secret file %s: %s", path, strerror(errno));
        return REDISMODULE_ERR;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        RedisModule_Log(ctx, "warning", "worker secret file %s is not a regular file", path);
        close(fd);
        return REDISMODULE_ERR;
    }
    if (st.st_mode & (S_IRWXG | S_IRWXO)) {
        RedisModule_Log(ctx, "warning", "worker secret file %s may be used by its group or other users (mode %04o): "
                        "refused; make it its owner's only (chmod 600)", path, (unsigned)(st.st_mode & 07777));
        close(fd);
        return REDISMODULE_ERR;
    }
    unsigned char buf[SECRET_FILE_MAX_BYTES];
    size_t n = 0;
    for (ssize_t got; n < sizeof buf && (got = read(fd, buf + n, sizeof buf - n)) != 0; n += (size_t)got) {
        if (got < 0 && errno == EINTR) got = 0;
        else if (got < 0) {
            RedisModule_Log(ctx, "warning", "worker secret file %s: %s", path, strerror(errno));
            close(fd);
            return REDISMODULE_ERR;
        }
    }
    close(fd);
    size_t end = 0, start = 0;
    while (end < n && buf[end] != '\n') end++;
    while (start < end && is_strip(buf[start])) start++;
    while (end > start && is_strip(buf[end - 1])) end--;
    if (!SRIO_SecretValid(buf + start, end - start)) {
        RedisModule_Log(ctx, "warning", "worker secret file %s: its first line must hold a secret of %d to %d bytes of "
                        "printable ASCII without spaces (it holds %zu bytes%s); e.g. `openssl rand -hex 32`", path,
                        SRIO_SECRET_MIN, SRIO_SECRET_MAX, end - start,
                        end - start >= SRIO_SECRET_MIN && end - start <= SRIO_SECRET_MAX ? ", not all of them such" : "");
        return REDISMODULE_ERR;
    }
    set_secret(buf + start, end - start);
    return REDISMODULE_OK;
}

/* `n` random bytes from the kernel: getrandom(2), else /dev/urandom; 0 if neither gives them. */
static int kernel_random(RedisModuleCtx *ctx, unsigned char *out, size_t n) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = getrandom(out + got, n - got, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        got += (size_t)r;
    }
    if (got == n) return 1;
    int first = errno;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC | O_NOCTTY);
    got = 0;
    while (fd >= 0 && got < n) {
        ssize_t r = read(fd, out + got, n - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        got += (size_t)r;
    }
    if (fd >= 0) close(fd);
    if (got == n) return 1;
    RedisModule_Log(ctx, "warning", "cannot make a worker secret: getrandom: %s; /dev/urandom: %s; give one with the "
                    "module argument WORKER_SECRET_FILE", strerror(first), fd < 0 ? strerror(errno) : "short read");
    return 0;
}

static int random_secret(RedisModuleCtx *ctx) {
    static const char HEX[] = "0123456789abcdef";
    unsigned char bytes[SECRET_RANDOM_BYTES], text[2 * SECRET_RANDOM_BYTES];
    if (!kernel_random(ctx, bytes, sizeof bytes)) return REDISMODULE_ERR;
    for (size_t i = 0; i < sizeof bytes; i++) {
        text[2 * i] = (unsigned char)HEX[bytes[i] >> 4];
        text[2 * i + 1] = (unsigned char)HEX[bytes[i] & 15];
    }
    set_secret(text, sizeof text);
    memset(bytes, 0, sizeof bytes);
    return REDISMODULE_OK;
}

/* Check WORKER_USER: an existing user other than root, its ids kept for spawn.c; REDISMODULE_ERR
 * after logging why not. */
static int check_worker_user(RedisModuleCtx *ctx) {
    const char *user = SRIO_Config.worker_user;
    if (!user) return REDISMODULE_OK;
    errno = 0;
    struct passwd *entry = getpwnam(user);
    if (!entry) {
        RedisModule_Log(ctx, "warning", "WORKER_USER %s: %s; name an existing unprivileged user (e.g. nobody)", user,
                        errno ? strerror(errno) : "no such user");
        return REDISMODULE_ERR;
    }
    if (entry->pw_uid == 0) {
        RedisModule_Log(ctx, "warning", "WORKER_USER %s is root (uid 0): refused, the workers run the models clients "
                        "store; name an unprivileged user (e.g. nobody)", user);
        return REDISMODULE_ERR;
    }
    SRIO_Config.worker_uid = entry->pw_uid;
    SRIO_Config.worker_gid = entry->pw_gid;
    return REDISMODULE_OK;
}

/* RedisAI's arguments that do not apply here */
static const char *const NOT_APPLICABLE[] = {"TORCH", "BACKEND_MEMORY_LIMIT", NULL};
static const char *const NOT_SERVED[] = {"TF", "TFLITE", "ONNX", NULL};

static int is_one_of(RedisModuleString *arg, const char *const *words) {
    for (; *words; words++) {
        if (SRIO_Is(arg, *words)) return 1;
    }
    return 0;
}

int SRIO_Configure(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc % 2) {
        RedisModule_Log(ctx, "warning", "smartredis_io module arguments come in pairs (NAME value), got %d", argc);
        return REDISMODULE_ERR;
    }
    int workers_given = 0;
    long long threads_per_queue = 0;
    const char *secret_file = NULL;
    for (int i = 0; i < argc; i += 2) {
        RedisModuleString *name = argv[i], *arg = argv[i + 1];
        const char *value = RedisModule_StringPtrLen(arg, NULL);
        long long n;
        if (SRIO_Is(name, "MODEL_CHUNK_SIZE")) {
            if (!to_count(arg, 1, LLONG_MAX, &SRIO_Config.model_chunk_size)) goto bad;
        } else if (SRIO_Is(name, "BULK_LIMIT_BYTES")) {
            /* a value is written in one piece of at most 512 MiB (RedisModule_StringTruncate's limit) */
            if (!to_count(arg, SRIO_HEADER_MAX_BYTES + 1, (long long)SRIO_DEFAULT_BULK_LIMIT, &n)) goto bad;
            SRIO_Config.bulk_limit = (uint64_t)n;
        } else if (SRIO_Is(name, "MAX_TENSOR_BYTES")) {
            if (!to_count(arg, 1, LLONG_MAX, &n)) goto bad;
            SRIO_Config.max_tensor_bytes = (uint64_t)n;
        } else if (SRIO_Is(name, "BACKENDSPATH")) {
            SRIO_Config.backends_path = dup_string(arg);
        } else if (SRIO_Is(name, "WORKERS")) {
            if (!to_count(arg, 0, SRIO_MAX_WORKERS, &n)) goto bad;
            SRIO_Config.workers = (int)n;
            workers_given = 1;
        } else if (SRIO_Is(name, "THREADS_PER_QUEUE")) {
            if (!to_count(arg, 1, LLONG_MAX, &threads_per_queue)) goto bad;
        } else if (SRIO_Is(name, "WORKER_PYTHON")) {
            if (!is_plain(value)) goto bad;
            SRIO_Config.worker_python = dup_string(arg);
        } else if (SRIO_Is(name, "WORKER_DEVICE")) {
            if (!is_device(value)) goto bad;
            SRIO_Config.worker_device = dup_string(arg);
        } else if (SRIO_Is(name, "WORKER_USER")) {
            if (!is_plain(value)) goto bad;
            SRIO_Config.worker_user = dup_string(arg);
        } else if (SRIO_Is(name, "INTRA_OP_PARALLELISM")) {
            if (!to_count(arg, 0, 1024, &n)) goto bad;
            SRIO_Config.threads = (int)n;
        } else if (SRIO_Is(name, "INTER_OP_PARALLELISM")) {
            if (!to_count(arg, 0, 1024, &n)) goto bad;
            SRIO_Config.interop_threads = (int)n;
        } else if (SRIO_Is(name, "MODEL_EXECUTION_TIMEOUT")) {
            if (!to_count(arg, 1, MAX_TIMEOUT_MS, &SRIO_Config.execution_timeout_ms)) goto bad;
        } else if (SRIO_Is(name, "QUEUE_TIMEOUT")) {
            if (!to_count(arg, 0, MAX_TIMEOUT_MS, &SRIO_Config.queue_timeout_ms)) goto bad;
        } else if (SRIO_Is(name, "WORKER_STARTUP_MS")) {
            if (!to_count(arg, 0, MAX_TIMEOUT_MS, &SRIO_Config.startup_ms)) goto bad;
        } else if (SRIO_Is(name, "WORKER_SECRET_FILE")) {
            secret_file = value;
        } else if (is_one_of(name, NOT_APPLICABLE)) {
            RedisModule_Log(ctx, "notice", "%s: accepted, not applicable (the execution workers bring torch)",
                            RedisModule_StringPtrLen(name, NULL));
        } else if (is_one_of(name, NOT_SERVED)) {
            RedisModule_Log(ctx, "warning", "backend %s is not served: models of this backend are refused",
                            RedisModule_StringPtrLen(name, NULL));
        } else {
            RedisModule_Log(ctx, "warning", "unknown smartredis_io module argument %s", RedisModule_StringPtrLen(name, NULL));
            return REDISMODULE_ERR;
        }
        continue;
    bad:
        RedisModule_Log(ctx, "warning", "invalid value for smartredis_io module argument %s: %s",
                        RedisModule_StringPtrLen(name, NULL), value);
        return REDISMODULE_ERR;
    }
    if (threads_per_queue && !workers_given) {
        SRIO_Config.workers = threads_per_queue > SRIO_MAX_WORKERS ? SRIO_MAX_WORKERS : (int)threads_per_queue;
        RedisModule_Log(ctx, "notice", "THREADS_PER_QUEUE %lld: %d execution workers", threads_per_queue,
                        SRIO_Config.workers);
    }
    /* the variable is for a server started as root (SmartSim's, through smartsim_setup's script);
     * a server of another user runs its workers as itself */
    if (!SRIO_Config.worker_user && geteuid() == 0 && getenv("SRIO_WORKER_USER") && is_plain(getenv("SRIO_WORKER_USER"))) {
        SRIO_Config.worker_user = dup_cstr(getenv("SRIO_WORKER_USER"));
    }
    if (check_worker_user(ctx) != REDISMODULE_OK) return REDISMODULE_ERR;
    if (!SRIO_Config.worker_python && getenv("SRIO_WORKER_PYTHON") && is_plain(getenv("SRIO_WORKER_PYTHON"))) {
        SRIO_Config.worker_python = dup_cstr(getenv("SRIO_WORKER_PYTHON"));
    }
    if (!SRIO_Config.worker_device) SRIO_Config.worker_device = dup_cstr("cpu");
    if (!secret_file && getenv("SRIO_WORKER_SECRET_FILE") && *getenv("SRIO_WORKER_SECRET_FILE")) {
        secret_file = getenv("SRIO_WORKER_SECRET_FILE");
    }
    if (secret_file) return read_secret_file(ctx, secret_file);
    return random_secret(ctx);
}
