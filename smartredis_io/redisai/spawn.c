/* The execution workers the module starts itself, so that `redis-server --loadmodule` is all a
 * database needs to run models (module arguments in config.c). The module supervises them as a
 * service manager would: started once the server serves (a timer: after the data is loaded) and
 * while it is a primary, stopped when it becomes a replica, started again, after pauses that grow
 * while they die young, when they exit; why they cannot start shows in INFO srio and in the error
 * runs get.
 *
 *     <python> -m smartredis_io.worker --address ADDR --workers N --device DEV [--threads T]
 *              [--interop-threads T2] --secret-stdin
 *
 * The interpreter is the Python environment that installed the module: WORKER_PYTHON (or
 * $SRIO_WORKER_PYTHON); else, for a module inside a site-packages or dist-packages directory (a wheel
 * in a virtual environment, conda, a system or user install), that installation's python3.X; else
 * the interpreter an in-place build recorded (build.py --python: a source checkout's environment);
 * else python3 on PATH.
 *
 * The supervisor is started by a double fork, so that it is not redis-server's child (redis-server
 * reaps its own children, and this one must outlive none of them). Where redis-server is PID 1 (a
 * container without an init), the kernel makes it the parent of such orphans, which redis-server's
 * own wait for its background saves would reap and log as "child with unmatched pid": the module
 * reaps an ending supervisor as it ends (see reap_supervisor), and other orphans while the server has
 * no background save. The supervisor runs in a session of its own, in `/`, with descriptors 0 to 2
 * only:
 *
 * - standard input is the module's control socket (a socket pair of datagrams in order): the module
 *   sends the worker secret and a newline, and `stop` when it stops the workers; the supervisor may
 *   send `error <text>` when a worker cannot start, and `ending` once its workers (and every process
 *   it started) have ended, then waits for the module to close the socket before it exits. Each side
 *   sees the other's end: the module holds its end for its whole life (no child of redis-server keeps
 *   it), so the supervisor sees end-of-file when the server is gone, even by SIGKILL, and stops its
 *   workers; the module sees end-of-file when a supervisor that said nothing has exited;
 * - standard output and error are a pipe the module reads: each line goes on to the server's log
 *   file (its standard output when it has none), and the last one names why a supervisor that exits
 *   before any worker registered could not start (an import error's last line). Once its own code
 *   runs, the supervisor writes to the log itself: the module sends it the log's descriptor on the
 *   control socket, after the secret, so that what it and its workers write outlives the server.
 *
 * A server running as root starts its workers as WORKER_USER (checked at load: an existing user,
 * not root), dropping privileges before the interpreter starts: supplementary groups, group, then
 * user (real, effective and saved), no capability left, no new privileges by exec; the supervisor
 * and every process it starts run as that user from their first instruction, with its HOME, USER
 * and LOGNAME.
 *
 * ADDR is the server's unix socket (unix://path), else its first bind address (127.0.0.1 for a
 * wildcard) and port; TCP when workers run as another user and the server has a port, else the
 * socket, which an ACL entry opens to that user where its mode does not. Workers connect as the default user, or with SR_USERNAME / SR_PASSWORD from the server's
 * environment. No worker is started (INFO srio and the runs' error say why) by a server running as
 * root with no WORKER_USER, by a server of another user than WORKER_USER, or where the default user
 * needs a password the environment does not give.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <linux/capability.h>
#include <pthread.h>
#include <pwd.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>

#include "exec.h"

#define CHECK_INTERVAL_MS 1000 /* starts due, orphans to reap */
#define BACKOFF_MIN_MS 1000
#define BACKOFF_MAX_MS 30000
#define HEALTHY_AFTER_MS 60000 /* a supervisor that lived this long starts again at once */
#define MAX_ARGS 24
#define MAX_GROUPS 1024
#define OUTPUT_CHUNK 16384
#define CONTROL_MAX 1024 /* bytes of one message from the supervisor */
#define REAP_WAIT_MS 1000 /* how long the module waits for an ending supervisor to exit, to reap it */
#define STOP "stop"       /* the module's word to a supervisor: stop the workers, then end */
#define ENDING "ending"   /* a supervisor's last word: its processes have ended, it exits once answered */

#ifndef SRIO_BUILD_PYTHON
#define SRIO_BUILD_PYTHON "" /* build.py --python: the interpreter of an in-place build's environment */
#endif

extern char **environ;

/* What failed in the child before its program ran, as the child reports it on the status pipe. */
enum { STEP_GROUPS = 1, STEP_GID, STEP_UID, STEP_ROOT_KEPT, STEP_CAPS_KEPT, STEP_NO_NEW_PRIVS, STEP_CHDIR, STEP_EXEC };
static const char *const STEP_NAMES[] = {"", "setgroups", "setresgid", "setresuid", "root could be regained",
                                         "capabilities were left", "PR_SET_NO_NEW_PRIVS", "chdir /", "execve"};

typedef struct Failure {
    int step;
    int error;
} Failure;

/* A supervisor the module stopped, until its control socket ends. */
typedef struct Stopping {
    int control;
    pid_t pid;
    struct Stopping *next;
} Stopping;

static pid_t supervisor;            /* 0: none */
static Stopping *stopping;          /* the supervisors stopped, not ended yet */
static int control = -1;            /* the module's end of the supervisor's standard input */
static int output = -1;             /* read end of the supervisor's standard output and error */
static int output_log = -1;         /* where its lines go on (-1: the server's standard output) */
static int replica;                 /* the server is a replica: no worker runs */
static int serving;                 /* one of this supervisor's workers registered */
static int error_sent;              /* this supervisor sent why a worker could not start */
static int start_failed;            /* the last start failed, and none of the module's workers registered since */
static long long spawned_at, next_spawn_at, backoff_ms;
static char refusal[ERROR_MAX];     /* why the module starts no worker, for good; "" when it does */
static char start_error[ERROR_MAX]; /* why the last start failed */
static char last_line[ERROR_MAX];   /* the supervisor's last line of output */
static char partial[ERROR_MAX];     /* the line being read */
static size_t partial_len;
static char python[PATH_MAX];       /* the interpreter of the last start */
static char module_file[PATH_MAX];  /* this shared object, symbolic links resolved */
static RedisModuleCtx *events_ctx;  /* for the callbacks of the server's event loop, which get none */

/* A child of redis-server (its background saves) must not hold the control sockets, or a server
 * killed while one runs would look alive to the supervisors. */
static void close_control_in_child(void) {
    if (control >= 0) close(control);
    for (Stopping *s = stopping; s; s = s->next) close(s->control);
}

static int is_file(const char *path, int mode) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode) && access(path, mode) == 0;
}

/* `name` found on PATH (the server's), into out; 0 if not there. */
static int on_path(const char *name, char *out, size_t size) {
    const char *path = getenv("PATH");
    if (path == NULL) path = "/usr/local/bin:/usr/bin:/bin";
    for (const char *dir = path; *dir;) {
        size_t len = strcspn(dir, ":");
        if (len && snprintf(out, size, "%.*s/%s", (int)len, dir, name) < (int)size && is_file(out, X_OK)) return 1;
        dir += len + (dir[len] == ':');
    }
    return 0;
}

/* The interpreter of the installation whose site-packages or dist-packages directory holds this
 * module: PREFIX/lib/python3.X/site-packages gives PREFIX/bin/python3.X (a virtual environment,
 * conda, a Python built from source), Debian's /usr/lib/python3/dist-packages /usr/bin/python3 and
 * /usr/local/lib/python3.X/dist-packages /usr/bin/python3.X; a user install (~/.local) gives
 * python3.X on PATH. Into out, or 0. */
static int installation_python(char *out, size_t size) {
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s", module_file);
    char *packages = NULL;
    for (char *p = dir; (p = strstr(p, "-packages/")); p++) {
        char *start = p;
        while (start > dir && start[-1] != '/') start--;
        if (!strncmp(start, "site-packages/", 14) || !strncmp(start, "dist-packages/", 14)) packages = start;
    }
    if (!packages || packages == dir) return 0;
    int debian = !strncmp(packages, "dist-packages/", 14);
    packages[-1] = '\0'; /* dir: PREFIX/lib/python3.X */
    char *version = strrchr(dir, '/');
    if (!version || strncmp(version + 1, "python3", 7)) return 0;
    *version++ = '\0'; /* version: python3.X; dir: PREFIX/lib */
    char *lib = strrchr(dir, '/');
    if (!lib || (strcmp(lib + 1, "lib") && strcmp(lib + 1, "lib64"))) return 0;
    *lib = '\0'; /* dir: PREFIX ("" for /) */
    if (snprintf(out, size, "%s/bin/%s", dir, version) < (int)size && is_file(out, X_OK)) return 1;
    if (debian && !strcmp(dir, "/usr/local") && snprintf(out, size, "/usr/bin/%s", version) < (int)size &&
        is_file(out, X_OK))
        return 1;
    return on_path(version, out, size);
}

/* The interpreter to run, into `python`, and where it came from; NULL (with start_error) if none. */
static const char *find_python(void) {
    const char *chosen = SRIO_Config.worker_python;
    if (chosen) {
        if (strchr(chosen, '/')) {
            snprintf(python, sizeof python, "%s", chosen);
            if (is_file(python, X_OK)) return "WORKER_PYTHON";
        } else if (on_path(chosen, python, sizeof python)) {
            return "WORKER_PYTHON, on PATH";
        }
        snprintf(start_error, sizeof start_error, "WORKER_PYTHON %s is not an executable file", chosen);
        return NULL;
    }
    if (installation_python(python, sizeof python)) return "the installation that holds the module";
    if (SRIO_BUILD_PYTHON[0] && snprintf(python, sizeof python, "%s", SRIO_BUILD_PYTHON) < (int)sizeof python &&
        is_file(python, X_OK))
        return "the environment the module was built in";
    if (on_path("python3", python, sizeof python)) return "python3 on PATH";
    snprintf(start_error, sizeof start_error, "no Python interpreter for the execution workers: the module sits in no "
             "Python installation and python3 is not on PATH; name one with WORKER_PYTHON (python -m "
             "smartredis_io.redis_module --args prints it)");
    return NULL;
}

/* The value of a server setting (CONFIG GET), into out ("" when unknown). */
static void server_setting(RedisModuleCtx *ctx, const char *name, char *out, size_t size) {
    out[0] = '\0';
    RedisModuleCallReply *reply = RedisModule_Call(ctx, "CONFIG", "cc", "GET", name);
    if (reply && RedisModule_CallReplyType(reply) == REDISMODULE_REPLY_ARRAY && RedisModule_CallReplyLength(reply) == 2) {
        size_t len;
        const char *value = RedisModule_CallReplyStringPtr(RedisModule_CallReplyArrayElement(reply, 1), &len);
        if (value) snprintf(out, size, "%.*s", (int)len, value);
    }
    if (reply) RedisModule_FreeCallReply(reply);
}

/* Whether the default user can connect without a password (the workers connect as it). */
static int default_user_open(RedisModuleCtx *ctx) {
    RedisModuleCallReply *reply = RedisModule_Call(ctx, "ACL", "cc", "GETUSER", "default");
    int on = 0, nopass = 0;
    size_t n = reply && RedisModule_CallReplyType(reply) == REDISMODULE_REPLY_ARRAY ? RedisModule_CallReplyLength(reply) : 0;
    for (size_t i = 0; i + 1 < n; i += 2) {
        size_t len;
        const char *field = RedisModule_CallReplyStringPtr(RedisModule_CallReplyArrayElement(reply, i), &len);
        if (!field || len != 5 || memcmp(field, "flags", 5)) continue;
        RedisModuleCallReply *flags = RedisModule_CallReplyArrayElement(reply, i + 1);
        for (size_t k = 0; k < RedisModule_CallReplyLength(flags); k++) {
            const char *flag = RedisModule_CallReplyStringPtr(RedisModule_CallReplyArrayElement(flags, k), &len);
            if (flag && len == 2 && !memcmp(flag, "on", 2)) on = 1;
            if (flag && len == 6 && !memcmp(flag, "nopass", 6)) nopass = 1;
        }
    }
    if (reply) RedisModule_FreeCallReply(reply);
    return on && nopass;
}

/* Where the workers connect: into out, or 0 (the reason in `refusal`). */
static int worker_address(RedisModuleCtx *ctx, int as_other_user, char *out, size_t size) {
    char unixsocket[PATH_MAX], port[32], bind[512];
    server_setting(ctx, "unixsocket", unixsocket, sizeof unixsocket);
    server_setting(ctx, "port", port, sizeof port);
    if (!atoi(port)) server_setting(ctx, "tls-port", port, sizeof port);
    if (unixsocket[0] && !(as_other_user && atoi(port))) {
        char cwd[PATH_MAX] = "";
        if (unixsocket[0] != '/' && !getcwd(cwd, sizeof cwd)) cwd[0] = '\0';
        if (snprintf(out, size, "unix://%s%s%s", cwd, cwd[0] ? "/" : "", unixsocket) < (int)size) return 1;
    }
    if (!atoi(port)) {
        snprintf(refusal, sizeof refusal, "the server listens on no TCP port and no unix socket");
        return 0;
    }
    server_setting(ctx, "bind", bind, sizeof bind);
    char *host = bind + strspn(bind, " -");
    host[strcspn(host, " ")] = '\0';
    if (!*host || !strcmp(host, "*") || !strcmp(host, "0.0.0.0") || !strcmp(host, "::") || !strcmp(host, "::*")) {
        host = "127.0.0.1";
    }
    snprintf(out, size, strchr(host, ':') ? "[%s]:%s" : "%s:%s", host, port);
    return 1;
}

/* Why no worker may be started; "" when they may. */
static void check_refusal(RedisModuleCtx *ctx) {
    const char *user = SRIO_Config.worker_user;
    if (geteuid() == 0 && !user) {
        snprintf(refusal, sizeof refusal, "the server runs as root and no user is named for the workers, which run "
                 "the models clients store; name an unprivileged one with the module argument WORKER_USER (e.g. "
                 "WORKER_USER nobody) or the environment variable SRIO_WORKER_USER");
        return;
    }
    if (geteuid() != 0 && user && (long long)geteuid() != SRIO_Config.worker_uid) {
        snprintf(refusal, sizeof refusal, "only a server started as root can run its workers as %s", user);
        return;
    }
    if (!default_user_open(ctx) && !getenv("SR_PASSWORD")) {
        snprintf(refusal, sizeof refusal, "the default user needs a password, and the workers would connect as it: "
                 "start redis-server with SR_USERNAME and SR_PASSWORD in its environment, or start workers yourself "
                 "(python -m smartredis_io.worker with those variables)");
    }
}

/* The environment of the supervisor: the server's, without the secret and LD_PRELOAD (meant for
 * redis-server: an allocator, the sanitizers); with the worker user's HOME, USER and LOGNAME when
 * the workers run as that user. */
static char **worker_environment(const struct passwd *user) {
    size_t n = 0;
    while (environ[n]) n++;
    char **env = RedisModule_Calloc(n + 4, sizeof *env);
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (!strncmp(environ[i], "SRIO_WORKER_SECRET=", 19) || !strncmp(environ[i], "LD_PRELOAD=", 11)) continue;
        if (user && (!strncmp(environ[i], "HOME=", 5) || !strncmp(environ[i], "USER=", 5) ||
                     !strncmp(environ[i], "LOGNAME=", 8)))
            continue;
        env[k++] = RedisModule_Strdup(environ[i]);
    }
    if (user) {
        env[k++] = SRIO_Format("HOME=%s", user->pw_dir);
        env[k++] = SRIO_Format("USER=%s", user->pw_name);
        env[k++] = SRIO_Format("LOGNAME=%s", user->pw_name);
    }
    env[k] = NULL;
    return env;
}

static void free_strings(char **strings) {
    for (char **s = strings; *s; s++) RedisModule_Free(*s);
    RedisModule_Free(strings);
}

/* Who the workers run as: the ids and groups of WORKER_USER when the server runs as root. */
typedef struct Identity {
    int drop;
    uid_t uid;
    gid_t gid;
    gid_t groups[MAX_GROUPS];
    int ngroups;
} Identity;

/* Whether the user of `who` may search (X_OK), read (R_OK) or write (W_OK) what `st` describes. */
static int allowed_for(const struct stat *st, const Identity *who, int mode) {
    mode_t bits = mode == X_OK ? S_IXOTH : mode == W_OK ? S_IWOTH : S_IROTH;
    if (st->st_uid == who->uid) return (st->st_mode & (bits << 6)) != 0;
    int member = st->st_gid == who->gid;
    for (int i = 0; i < who->ngroups && !member; i++) member = st->st_gid == who->groups[i];
    return (st->st_mode & (member ? bits << 3 : bits)) != 0;
}

/* The first directory on `path` (as given; all of them with `last`, the path itself too) that the
 * user of `who` may not search: into out as " (USER may not search DIR: mode, owner)", 1; else 0. */
static int blocked_on(const char *path, const Identity *who, int last_too, char *out, size_t size) {
    char walk[PATH_MAX];
    snprintf(walk, sizeof walk, "%s", path);
    for (char *slash = strchr(walk + 1, '/'); walk[0] == '/'; slash = strchr(slash + 1, '/')) {
        if (!slash && !last_too) return 0;
        if (slash) *slash = '\0';
        struct stat st;
        if (stat(walk, &st) == 0 && !allowed_for(&st, who, X_OK)) {
            struct passwd *owner = getpwuid(st.st_uid);
            snprintf(out, size, " (%.64s may not %s %.256s: mode %04o, owner %.64s)", SRIO_Config.worker_user,
                     slash ? "search" : "run", walk, (unsigned)(st.st_mode & 07777), owner ? owner->pw_name : "?");
            return 1;
        }
        if (!slash) return 0;
        *slash = '/';
    }
    return 0;
}

/* Why the user of `who` may not run `path`: the first directory on it, or behind its symbolic
 * links, that user may not search; into out, or "" when none is found. */
static void unreachable_for(const char *path, const Identity *who, char *out, size_t size) {
    char real[PATH_MAX];
    out[0] = '\0';
    if (!blocked_on(path, who, 1, out, size) && realpath(path, real)) blocked_on(real, who, 1, out, size);
}

#define ACL_XATTR "system.posix_acl_access"
#define ACL_VERSION 2
enum { ACL_USER_OBJ = 0x01, ACL_USER = 0x02, ACL_GROUP_OBJ = 0x04, ACL_MASK = 0x10, ACL_OTHER = 0x20 };

typedef struct AclEntry {
    uint16_t tag, perm;
    uint32_t id;
} AclEntry;

/* Let the user of `who` connect to the server's unix socket `path` (its workers connect there when
 * the server has no TCP port): it must search every directory on the way, and write the socket, which
 * a POSIX ACL entry for that user alone grants when its mode does not (unixsocketperm 700 or 755 lets
 * root alone). 0, with the reason in `why`, when it cannot be let. */
static int let_connect(RedisModuleCtx *ctx, const char *path, const Identity *who, char *why, size_t size) {
    struct stat st;
    if (blocked_on(path, who, 0, why, size)) return 0;
    if (stat(path, &st) != 0) {
        snprintf(why, size, " (%s)", strerror(errno));
        return 0;
    }
    if (allowed_for(&st, who, W_OK)) return 1;
    if (getxattr(path, ACL_XATTR, NULL, 0) > 0) {
        snprintf(why, size, " (mode %04o, with an ACL of its own, which the module leaves alone)",
                 (unsigned)(st.st_mode & 07777));
        return 0;
    }
    unsigned mode = (unsigned)st.st_mode;
    struct {
        uint32_t version;
        AclEntry entries[5];
    } __attribute__((packed)) acl = {
        ACL_VERSION,
        {{ACL_USER_OBJ, (mode >> 6) & 7, (uint32_t)-1},
         {ACL_USER, 6, (uint32_t)who->uid},
         {ACL_GROUP_OBJ, (mode >> 3) & 7, (uint32_t)-1},
         {ACL_MASK, ((mode >> 3) & 7) | 6, (uint32_t)-1},
         {ACL_OTHER, mode & 7, (uint32_t)-1}},
    };
    if (setxattr(path, ACL_XATTR, &acl, sizeof acl, 0) != 0) {
        snprintf(why, size, " (mode %04o; an ACL entry for %.64s could not be added: %s)", mode & 07777,
                 SRIO_Config.worker_user, strerror(errno));
        return 0;
    }
    RedisModule_Log(ctx, "notice", "%s may now connect to %s (an ACL entry for that user alone: the socket's mode "
                    "%04o lets only its owner)", SRIO_Config.worker_user, path, mode & 07777);
    return 1;
}

static void fail_child(int status_fd, int step) {
    Failure failure = {step, errno};
    if (write(status_fd, &failure, sizeof failure) < 0) _exit(126);
    _exit(127);
}

/* In the grandchild: become the supervisor. Only async-signal-safe calls until execve. */
static void exec_supervisor(int stdin_fd, int output_fd, int status_fd, const Identity *who, char **argv, char **envp) {
    setsid();
    dup2(stdin_fd, 0);
    dup2(output_fd, 1);
    dup2(output_fd, 2);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigaction(SIGHUP, &dfl, NULL); /* ignored by redis-server; ignored dispositions survive execve */
    sigaction(SIGPIPE, &dfl, NULL);
    struct rlimit files;
    int top = getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < 1 << 20 ? (int)files.rlim_cur : 1 << 16;
    for (int fd = 3; fd < top; fd++) {
        if (fd != status_fd) close(fd); /* the server's sockets, files and pipes; status_fd closes at execve */
    }
    if (who->drop) {
        if (setgroups((size_t)who->ngroups, who->groups) != 0) fail_child(status_fd, STEP_GROUPS);
        if (setresgid(who->gid, who->gid, who->gid) != 0) fail_child(status_fd, STEP_GID);
        if (setresuid(who->uid, who->uid, who->uid) != 0) fail_child(status_fd, STEP_UID);
        if (setresuid(0, 0, 0) == 0) {
            errno = EPERM;
            fail_child(status_fd, STEP_ROOT_KEPT);
        }
        struct __user_cap_header_struct header = {.version = _LINUX_CAPABILITY_VERSION_3, .pid = 0};
        struct __user_cap_data_struct caps[_LINUX_CAPABILITY_U32S_3];
        memset(caps, 0, sizeof caps);
        if (syscall(SYS_capget, &header, caps) != 0) fail_child(status_fd, STEP_CAPS_KEPT);
        for (int i = 0; i < _LINUX_CAPABILITY_U32S_3; i++) {
            if (caps[i].effective || caps[i].permitted || caps[i].inheritable) {
                errno = EPERM;
                fail_child(status_fd, STEP_CAPS_KEPT);
            }
        }
        if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0 && errno != EINVAL)
            fail_child(status_fd, STEP_CAPS_KEPT);
    }
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) fail_child(status_fd, STEP_NO_NEW_PRIVS);
    /* python -m puts the working directory first on sys.path: the server's (its data directory)
     * may hold files others wrote */
    if (chdir("/") != 0) fail_child(status_fd, STEP_CHDIR);
    execve(argv[0], argv, envp);
    fail_child(status_fd, STEP_EXEC);
}

static void set_start_error(RedisModuleCtx *ctx, const char *format, ...) __attribute__((format(printf, 2, 3)));

/* Record why the module's workers could not start: INFO srio shows it, runs fail with it while no
 * worker is registered. */
static void set_start_error(RedisModuleCtx *ctx, const char *format, ...) {
    char error[ERROR_MAX];
    va_list ap;
    va_start(ap, format);
    vsnprintf(error, sizeof error, format, ap);
    va_end(ap);
    if (!start_failed || strcmp(error, start_error)) {
        RedisModule_Log(ctx, "warning", "the execution workers could not start: %s", error);
    }
    memcpy(start_error, error, sizeof error);
    start_failed = 1;
}

/* ---- the supervisor's output -------------------------------------------------------------- */

static void write_all(int fd, const char *buf, size_t len) {
    while (len) {
        ssize_t n = write(fd, buf, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return; /* a log that cannot be written loses the line, as redis-server's own */
        buf += n;
        len -= (size_t)n;
    }
}

static void take_lines(const char *buf, size_t len) {
    for (size_t i = 0; i < len; i++) {
        if (buf[i] != '\n') {
            if (partial_len + 1 < sizeof partial) partial[partial_len++] = buf[i] == '\r' || buf[i] == '\t' ? ' ' : buf[i];
            continue;
        }
        partial[partial_len] = '\0';
        size_t start = strspn(partial, " ");
        if (partial[start]) snprintf(last_line, sizeof last_line, "%s", partial + start);
        partial_len = 0;
    }
}

static void close_output(void) {
    if (output >= 0) {
        RedisModule_EventLoopDel(output, REDISMODULE_EVENTLOOP_READABLE);
        close(output);
        output = -1;
    }
    if (output_log >= 0) {
        close(output_log);
        output_log = -1;
    }
}

/* Read what the supervisor and its workers wrote, pass it on to the log; 0 at end-of-file. */
static int drain_output(void) {
    char buf[OUTPUT_CHUNK];
    for (int rounds = 0; output >= 0 && rounds < 64; rounds++) {
        ssize_t n = read(output, buf, sizeof buf);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return 1; /* EAGAIN: all read */
        if (n == 0) {
            if (partial_len) take_lines("\n", 1);
            close_output();
            return 0;
        }
        write_all(output_log >= 0 ? output_log : STDOUT_FILENO, buf, (size_t)n);
        take_lines(buf, (size_t)n);
    }
    return 1;
}

static void on_output(int fd, void *data, int mask) {
    (void)fd;
    (void)data;
    (void)mask;
    drain_output();
}

/* ---- the control socket ------------------------------------------------------------------- */

static void supervisor_exited(RedisModuleCtx *ctx);

/* Where redis-server is PID 1, a supervisor (the double fork's orphan) is its child: reap it as it
 * ends, once it said `ending` and its control socket is closed, or once the socket ended. The main
 * thread waits the milliseconds an exit takes (REAP_WAIT_MS at most, then it is left to
 * reap_orphans), so that redis-server's wait for its background saves, on the same thread, cannot
 * find it first. */
static void reap_supervisor(pid_t pid) {
    if (getpid() != 1 || pid <= 0) return;
    long long until = SRIO_Now() + REAP_WAIT_MS;
    for (;;) {
        pid_t done = waitpid(pid, NULL, WNOHANG);
        if (done < 0 && errno == EINTR) continue;
        if (done != 0 || SRIO_Now() >= until) return;
        struct timespec pause = {0, 1000000};
        nanosleep(&pause, NULL);
    }
}

static int is_word(const char *message, ssize_t n, const char *word) {
    return n == (ssize_t)strlen(word) && !memcmp(message, word, (size_t)n);
}

static void on_control(int fd, void *data, int mask) {
    (void)data;
    (void)mask;
    char message[CONTROL_MAX + 1];
    ssize_t n = recv(fd, message, CONTROL_MAX, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
    RedisModuleCtx *ctx = events_ctx;
    if (n <= 0 || is_word(message, n, ENDING)) {
        pid_t pid = supervisor;
        supervisor_exited(ctx); /* closes the socket: the supervisor exits */
        reap_supervisor(pid);
    } else if (n > 6 && !memcmp(message, "error ", 6)) {
        message[n] = '\0';
        for (char *c = message; *c; c++) {
            if ((unsigned char)*c < 0x20 || *c == 0x7f) *c = ' ';
        }
        error_sent = 1;
        set_start_error(ctx, "%s", message + 6);
    }
}

/* ---- starting and stopping ---------------------------------------------------------------- */

/* Hand the supervisor the server's log (a descriptor: the file may be one its user cannot open), for
 * its output once its own code runs: what it and its workers write then outlives the server (their
 * last words when it is gone). */
static void send_log(int socket_fd, int log_fd) {
    char word[] = "log";
    struct iovec iov = {.iov_base = word, .iov_len = sizeof word - 1};
    union {
        struct cmsghdr header;
        char space[CMSG_SPACE(sizeof(int))];
    } control_data;
    memset(&control_data, 0, sizeof control_data);
    struct msghdr message = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control_data.space,
                             .msg_controllen = sizeof control_data.space};
    struct cmsghdr *header = CMSG_FIRSTHDR(&message);
    header->cmsg_level = SOL_SOCKET;
    header->cmsg_type = SCM_RIGHTS;
    header->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(header), &log_fd, sizeof(int));
    if (sendmsg(socket_fd, &message, MSG_NOSIGNAL) < 0) {
        RedisModule_Log(events_ctx, "warning", "could not hand the server's log to the execution workers: %s",
                        strerror(errno));
    }
}

static int resolve_identity(Identity *who, struct passwd **user) {
    memset(who, 0, sizeof *who);
    *user = NULL;
    if (geteuid() != 0 || SRIO_Config.worker_uid < 0) return 1;
    *user = getpwnam(SRIO_Config.worker_user);
    if (!*user) return 0;
    who->drop = 1;
    who->uid = (*user)->pw_uid;
    who->gid = (*user)->pw_gid;
    who->ngroups = MAX_GROUPS;
    if (getgrouplist((*user)->pw_name, who->gid, who->groups, &who->ngroups) < 0) {
        who->ngroups = MAX_GROUPS; /* the first ones: a user in more than 1024 groups keeps those */
    }
    return 1;
}

static void spawn(RedisModuleCtx *ctx) {
    int as_other_user = geteuid() == 0 && SRIO_Config.worker_user != NULL;
    char address[PATH_MAX + 16], logfile[PATH_MAX];
    const char *origin = find_python();
    if (!origin) {
        set_start_error(ctx, "%s", start_error);
        return;
    }
    if (!worker_address(ctx, as_other_user, address, sizeof address)) {
        RedisModule_Log(ctx, "warning", "starting no execution worker: %s", refusal);
        return; /* for good: the settings do not change */
    }
    Identity who;
    struct passwd *user;
    if (!resolve_identity(&who, &user)) {
        set_start_error(ctx, "WORKER_USER %s: no such user any more", SRIO_Config.worker_user);
        return;
    }
    char why[ERROR_MAX];
    if (who.drop && !strncmp(address, "unix://", 7) && !let_connect(ctx, address + 7, &who, why, sizeof why)) {
        set_start_error(ctx, "%s may not connect to the server's unix socket %s%s: give the server a TCP port on "
                        "loopback (the workers then use it), or a socket that user may reach", SRIO_Config.worker_user,
                        address + 7, why);
        return;
    }
    char workers[16], threads[16], interop[16];
    snprintf(workers, sizeof workers, "%d", SRIO_Config.workers);
    snprintf(threads, sizeof threads, "%d", SRIO_Config.threads);
    snprintf(interop, sizeof interop, "%d", SRIO_Config.interop_threads);
    char *argv[MAX_ARGS] = {python, "-m", "smartredis_io.worker", "--address", address, "--workers", workers,
                            "--device", SRIO_Config.worker_device};
    int argc = 9;
    if (SRIO_Config.threads) {
        argv[argc++] = "--threads";
        argv[argc++] = threads;
    }
    if (SRIO_Config.interop_threads) {
        argv[argc++] = "--interop-threads";
        argv[argc++] = interop;
    }
    argv[argc++] = "--secret-stdin";
    argv[argc] = NULL;
    char **envp = worker_environment(user);
    /* the middle child's report (the supervisor's pid) and the supervisor's own (why execve was not
     * reached) travel on pipes of their own: on one pipe a supervisor that fails at once can write
     * before the middle child does, and its failure would be read as the pid */
    int sockets[2] = {-1, -1}, out[2] = {-1, -1}, status[2] = {-1, -1}, started[2] = {-1, -1};
    pid_t middle = -1, pid = -1;
    int error = 0;
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sockets) == 0 && pipe2(out, O_CLOEXEC) == 0 &&
        pipe2(status, O_CLOEXEC) == 0 && pipe2(started, O_CLOEXEC) == 0)
        middle = fork();
    if (middle == 0) {
        pid = fork();
        if (pid == 0) exec_supervisor(sockets[1], out[1], status[1], &who, argv, envp);
        _exit(write(started[1], &pid, sizeof pid) == sizeof pid ? 0 : 1);
    }
    if (middle < 0) error = errno;
    free_strings(envp);
    if (sockets[1] >= 0) close(sockets[1]);
    if (out[1] >= 0) close(out[1]);
    if (status[1] >= 0) close(status[1]);
    if (started[1] >= 0) close(started[1]);
    Failure failure = {0, 0};
    if (middle > 0) {
        while (waitpid(middle, NULL, 0) < 0 && errno == EINTR) {}
        if (read(started[0], &pid, sizeof pid) != sizeof pid || pid <= 0) {
            pid = -1;
            error = EAGAIN;
        } else {
            ssize_t n;
            while ((n = read(status[0], &failure, sizeof failure)) < 0 && errno == EINTR) {}
            if (n != sizeof failure) failure.step = 0; /* closed by execve: the program runs */
            else if (failure.step <= 0 || failure.step >= (int)(sizeof STEP_NAMES / sizeof *STEP_NAMES))
                failure = (Failure){STEP_EXEC, EPROTO}; /* not a report of ours: never index past the names */
        }
    }
    if (status[0] >= 0) close(status[0]);
    if (started[0] >= 0) close(started[0]);
    if (pid <= 0 || failure.step) {
        if (sockets[0] >= 0) close(sockets[0]);
        if (out[0] >= 0) close(out[0]);
        if (failure.step == STEP_EXEC && failure.error == EACCES && who.drop) {
            char where[ERROR_MAX];
            unreachable_for(python, &who, where, sizeof where);
            set_start_error(ctx, "could not start %s as %s: %s%s; the interpreter and its Python installation "
                            "must be readable by the workers' user", python, SRIO_Config.worker_user,
                            strerror(failure.error), where);
        } else {
            set_start_error(ctx, "could not start %s (%s%s%s): %s", python, pid <= 0 ? "fork" : STEP_NAMES[failure.step],
                            who.drop ? " as " : "", who.drop ? SRIO_Config.worker_user : "",
                            strerror(pid <= 0 ? error : failure.error));
        }
        return;
    }
    char line[SRIO_SECRET_MAX + 1];
    memcpy(line, SRIO_Config.secret, SRIO_Config.secret_len);
    line[SRIO_Config.secret_len] = '\n';
    if (send(sockets[0], line, SRIO_Config.secret_len + 1, MSG_NOSIGNAL) != (ssize_t)SRIO_Config.secret_len + 1) {
        RedisModule_Log(ctx, "warning", "could not hand the worker secret to the execution workers: %s", strerror(errno));
    }
    memset(line, 0, sizeof line);
    close_output(); /* what an earlier supervisor's workers still wrote is theirs: a new pipe for this one */
    server_setting(ctx, "logfile", logfile, sizeof logfile);
    output_log = logfile[0] ? open(logfile, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644) : -1;
    send_log(sockets[0], output_log >= 0 ? output_log : STDOUT_FILENO);
    output = out[0];
    fcntl(output, F_SETFL, O_NONBLOCK);
    RedisModule_EventLoopAdd(output, REDISMODULE_EVENTLOOP_READABLE, on_output, NULL);
    control = sockets[0];
    RedisModule_EventLoopAdd(control, REDISMODULE_EVENTLOOP_READABLE, on_control, NULL);
    supervisor = pid;
    spawned_at = SRIO_Now();
    serving = error_sent = 0;
    last_line[0] = '\0';
    partial_len = 0;
    RedisModule_Log(ctx, "notice", "started %d execution worker(s) for %s (supervisor pid %d%s%s: %s -m %s; the "
                    "interpreter of %s)", SRIO_Config.workers, address, (int)supervisor, who.drop ? ", as " : "",
                    who.drop ? SRIO_Config.worker_user : "", python, argv[2], origin);
}

/* The control socket of a stopped supervisor: its `ending` (or the socket's end) closes and reaps it. */
static void on_stopping(int fd, void *data, int mask) {
    (void)mask;
    Stopping *s = data;
    char message[CONTROL_MAX];
    ssize_t n = recv(fd, message, sizeof message, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
    if (n > 0 && !is_word(message, n, ENDING)) return; /* why a worker could not start: it is stopping anyway */
    RedisModule_EventLoopDel(fd, REDISMODULE_EVENTLOOP_READABLE);
    close(fd);
    for (Stopping **link = &stopping; *link; link = &(*link)->next) {
        if (*link == s) {
            *link = s->next;
            break;
        }
    }
    reap_supervisor(s->pid);
    RedisModule_Free(s);
}

/* Stop the supervisor: it stops its workers, says it ends, and exits (as it does when the socket ends). */
static void stop(RedisModuleCtx *ctx, const char *why) {
    if (control < 0) return;
    RedisModule_Log(ctx, "notice", "stopping the execution workers (supervisor pid %d): %s", (int)supervisor, why);
    RedisModule_EventLoopDel(control, REDISMODULE_EVENTLOOP_READABLE);
    if (send(control, STOP, strlen(STOP), MSG_NOSIGNAL) == (ssize_t)strlen(STOP)) {
        Stopping *s = RedisModule_Alloc(sizeof *s);
        *s = (Stopping){.control = control, .pid = supervisor, .next = stopping};
        stopping = s;
        RedisModule_EventLoopAdd(control, REDISMODULE_EVENTLOOP_READABLE, on_stopping, s);
    } else { /* it has ended */
        close(control);
        reap_supervisor(supervisor);
    }
    control = -1;
    supervisor = 0;
    serving = 0;
}

/* The supervisor's end of the control socket closed: it has exited. Another starts after a pause. */
static void supervisor_exited(RedisModuleCtx *ctx) {
    long long now = SRIO_Now(), lived = now - spawned_at;
    drain_output(); /* its last words are in the pipe by now */
    RedisModule_EventLoopDel(control, REDISMODULE_EVENTLOOP_READABLE);
    close(control);
    control = -1;
    backoff_ms = lived >= HEALTHY_AFTER_MS ? 0 : backoff_ms ? 2 * backoff_ms : BACKOFF_MIN_MS;
    if (backoff_ms > BACKOFF_MAX_MS) backoff_ms = BACKOFF_MAX_MS;
    next_spawn_at = now + backoff_ms;
    /* an error it sent names the cause better than its last line */
    if (!serving && !error_sent) {
        set_start_error(ctx, "%s -m smartredis_io.worker ended before any worker registered%s%s", python,
                        last_line[0] ? ": " : "", last_line);
    }
    RedisModule_Log(ctx, "warning", "the execution workers' supervisor (pid %d) ended after %.1f s; starting it again "
                    "in %lld s", (int)supervisor, lived / 1000.0, backoff_ms / 1000);
    supervisor = 0;
    serving = 0;
}

/* Where redis-server is PID 1 (a container without an init), the kernel makes it the parent of
 * every orphan: the supervisors, and what a supervisor that was killed leaves (its workers,
 * multiprocessing's resource tracker; one that ends by itself waits for them). redis-server reaps
 * children only while it has a background save or rewrite of its own (logging the others as
 * "unmatched"): the module reaps them while it has none, when no child of the server can be among
 * them. */
static void reap_orphans(RedisModuleCtx *ctx) {
    if (getpid() != 1 || (RedisModule_GetContextFlags(ctx) & REDISMODULE_CTX_FLAGS_ACTIVE_CHILD)) return;
    while (waitpid(-1, NULL, WNOHANG) > 0) {}
}

static void monitor(RedisModuleCtx *ctx, void *data) {
    (void)data;
    long long now = SRIO_Now();
    reap_orphans(ctx);
    replica = (RedisModule_GetContextFlags(ctx) & REDISMODULE_CTX_FLAGS_SLAVE) != 0;
    if (supervisor == 0 && !replica && now >= next_spawn_at && !refusal[0]) {
        check_refusal(ctx);
        if (refusal[0]) {
            RedisModule_Log(ctx, "warning", "starting no execution worker: %s", refusal);
        } else {
            spawn(ctx);
            if (supervisor == 0) {
                backoff_ms = backoff_ms ? 2 * backoff_ms : BACKOFF_MIN_MS;
                if (backoff_ms > BACKOFF_MAX_MS) backoff_ms = BACKOFF_MAX_MS;
                next_spawn_at = now + backoff_ms;
            }
        }
    }
    RedisModule_CreateTimer(ctx, CHECK_INTERVAL_MS, monitor, NULL);
}

/* A primary demoted by REPLICAOF stops its workers (they would fail writing as a replica); one
 * promoted starts them. */
static void role_changed(RedisModuleCtx *ctx, RedisModuleEvent event, uint64_t subevent, void *data) {
    (void)event;
    (void)data;
    if (subevent == REDISMODULE_EVENT_REPLROLECHANGED_NOW_REPLICA) {
        replica = 1;
        stop(ctx, "this server is now a replica");
    } else if (subevent == REDISMODULE_EVENT_REPLROLECHANGED_NOW_MASTER) {
        replica = 0;
        next_spawn_at = 0;
        backoff_ms = 0;
    }
}

/* ---- what the rest of the module asks --------------------------------------------------- */

/* Whether the process `pid` is a child of the current supervisor (one of the module's workers). */
static int is_own_worker(long long pid) {
    char path[64], stat[512];
    snprintf(path, sizeof path, "/proc/%lld/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, stat, sizeof stat - 1);
    close(fd);
    if (n <= 0) return 0;
    stat[n] = '\0';
    const char *paren = strrchr(stat, ')'); /* the command name, in parentheses, may hold anything */
    char state;
    int parent;
    return paren && sscanf(paren + 1, " %c %d", &state, &parent) == 2 && parent == (int)supervisor;
}

void SRIO_SpawnWorkerSeen(long long pid) {
    if (supervisor <= 0 || (serving && !start_failed) || pid <= 0 || !is_own_worker(pid)) return;
    serving = 1;
    backoff_ms = 0;
    if (start_failed) {
        start_failed = 0;
        RedisModule_Log(events_ctx, "notice", "an execution worker registered: the workers start again");
    }
}

int SRIO_SpawnStarting(void) {
    return SRIO_Config.workers > 0 && !refusal[0] && !start_failed && !serving && !replica;
}

int SRIO_SpawnFailed(void) { return start_failed; }

const char *SRIO_SpawnError(void) {
    if (refusal[0]) return refusal;
    return start_failed ? start_error : "";
}

const char *SRIO_SpawnState(void) {
    if (SRIO_Config.workers == 0) return "off";
    if (refusal[0]) return "refused";
    if (start_failed) return "failed";
    if (replica) return "replica";
    return serving ? "ok" : "starting";
}

const char *SRIO_SpawnPython(void) { return python; }

long long SRIO_SupervisorPid(void) { return supervisor; }

int SRIO_SpawnRegister(RedisModuleCtx *ctx) {
    if (SRIO_Config.workers == 0) return REDISMODULE_OK;
    Dl_info where;
    if (!dladdr((void *)SRIO_SpawnRegister, &where) || !where.dli_fname || !realpath(where.dli_fname, module_file)) {
        snprintf(module_file, sizeof module_file, "%s", where.dli_fname ? where.dli_fname : "");
    }
    if (pthread_atfork(NULL, NULL, close_control_in_child) != 0) return REDISMODULE_ERR;
    events_ctx = RedisModule_GetDetachedThreadSafeContext(ctx);
    if (RedisModule_SubscribeToServerEvent(ctx, RedisModuleEvent_ReplicationRoleChanged, role_changed) != REDISMODULE_OK)
        return REDISMODULE_ERR;
    RedisModule_CreateTimer(ctx, 0, monitor, NULL);
    return REDISMODULE_OK;
}
