/* The execution workers the module starts itself, so that `redis-server --loadmodule` is all a
 * database needs to run models (module arguments in config.c).
 *
 * Once the server serves (a timer: after the data is loaded) and while it is a primary, the module
 * starts
 *
 *     <python> -m smartredis_io.worker --address ADDR --workers N --device DEV [--user U]
 *              [--threads T] [--interop-threads T2] --secret-stdin
 *
 * by a double fork, so that the process is not redis-server's child (redis-server reaps its own
 * children, and this one must outlive none of them), in a session of its own, with every
 * descriptor of the server closed. Its standard input is a pipe: the module writes the worker secret
 * and a newline, then holds the pipe's other end for its whole life (no child of redis-server
 * inherits it), so the supervisor sees end-of-file when the server is gone, even by SIGKILL, and
 * stops its workers. The module checks every second that the pipe still has its reader; when the
 * supervisor is gone it starts a new one, after pauses that grow while supervisors die young.
 *
 * ADDR is the server's unix socket (unix://path), else its first bind address (127.0.0.1 for a
 * wildcard) and port; TCP when workers started as root become another user, who may not be
 * allowed to open the socket. Workers connect as the default user, or with SR_USERNAME /
 * SR_PASSWORD from the server's environment. No worker is started (and the log says why) by a
 * server running as root with no WORKER_USER, or whose default user needs a password it does not
 * have; requests then get the "no execution worker" error at once.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <pwd.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "exec.h"

#define CHECK_INTERVAL_MS 1000
#define BACKOFF_MIN_MS 1000
#define BACKOFF_MAX_MS 30000
#define HEALTHY_AFTER_MS 60000 /* a supervisor that lived this long starts again at once */
#define MAX_ARGS 24

extern char **environ;

static int lifeline = -1;           /* write end of the supervisor's standard input */
static long long supervisor_pid;
static long long spawned_at, next_spawn_at, backoff_ms;
static char refusal[ERROR_MAX];     /* why the module starts no worker; "" when it does */
static char module_file[PATH_MAX];  /* this shared object, as loaded */

const char *SRIO_SpawnRefusal(void) { return refusal; }

long long SRIO_SupervisorPid(void) { return lifeline >= 0 ? supervisor_pid : 0; }

/* A child of redis-server (its background saves) must not hold the lifeline, or a server killed
 * while one runs would look alive to the supervisor. */
static void close_lifeline_in_child(void) {
    if (lifeline >= 0) close(lifeline);
}

static int is_file(const char *path, int mode) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode) && access(path, mode) == 0;
}

/* The interpreter to run: WORKER_PYTHON, else the virtual environment this module sits in, else
 * python3 from PATH; into out, or 0. */
static int find_python(char *out, size_t size) {
    if (SRIO_Config.worker_python) {
        snprintf(out, size, "%s", SRIO_Config.worker_python);
        if (strchr(out, '/')) return is_file(out, X_OK);
    } else {
        char dir[PATH_MAX];
        snprintf(dir, sizeof dir, "%s", module_file);
        for (char *slash = strrchr(dir, '/'); slash && slash != dir; slash = strrchr(dir, '/')) {
            *slash = '\0';
            char cfg[PATH_MAX + 16];
            snprintf(cfg, sizeof cfg, "%s/pyvenv.cfg", dir);
            if (is_file(cfg, R_OK) && snprintf(out, size, "%s/bin/python3", dir) < (int)size && is_file(out, X_OK)) {
                return 1;
            }
        }
        snprintf(out, size, "python3");
    }
    const char *path = getenv("PATH");
    if (path == NULL) path = "/usr/local/bin:/usr/bin:/bin";
    char name[PATH_MAX];
    snprintf(name, sizeof name, "%s", out);
    for (const char *dir = path; *dir;) {
        size_t len = strcspn(dir, ":");
        if (len && snprintf(out, size, "%.*s/%s", (int)len, dir, name) < (int)size && is_file(out, X_OK)) return 1;
        dir += len + (dir[len] == ':');
    }
    return 0;
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
    struct passwd *self = getpwuid(geteuid());
    if (geteuid() != 0 && user && (!self || strcmp(self->pw_name, user))) {
        snprintf(refusal, sizeof refusal, "only a server started as root can run its workers as %s", user);
        return;
    }
    if (!default_user_open(ctx) && !getenv("SR_PASSWORD")) {
        snprintf(refusal, sizeof refusal, "the default user needs a password, and the workers would connect as it: "
                 "start redis-server with SR_USERNAME and SR_PASSWORD in its environment, or start workers yourself "
                 "(python -m smartredis_io.worker with those variables)");
    }
}

/* The environment of the supervisor: the server's, with PYTHONPATH led by the directory that holds
 * the smartredis_io package this module belongs to (when it is there), without the secret and
 * LD_PRELOAD. */
static char **worker_environment(void) {
    size_t n = 0;
    while (environ[n]) n++;
    char **env = RedisModule_Calloc(n + 2, sizeof *env);
    char root[PATH_MAX], init[PATH_MAX + 64];
    snprintf(root, sizeof root, "%s", module_file);
    for (int up = 0; up < 2; up++) {
        char *slash = strrchr(root, '/');
        if (slash) *slash = '\0';
    }
    snprintf(init, sizeof init, "%s/smartredis_io/__init__.py", root);
    const char *old = getenv("PYTHONPATH");
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        /* LD_PRELOAD is meant for redis-server (an allocator, the sanitizers), not for Python */
        if (!strncmp(environ[i], "PYTHONPATH=", 11) || !strncmp(environ[i], "SRIO_WORKER_SECRET=", 19) ||
            !strncmp(environ[i], "LD_PRELOAD=", 11))
            continue;
        env[k++] = RedisModule_Strdup(environ[i]);
    }
    if (is_file(init, R_OK)) {
        env[k++] = SRIO_Format("PYTHONPATH=%s%s%s", root, old && *old ? ":" : "", old ? old : "");
    } else if (old) {
        env[k++] = SRIO_Format("PYTHONPATH=%s", old);
    }
    env[k] = NULL;
    return env;
}

static void free_strings(char **strings) {
    for (char **s = strings; *s; s++) RedisModule_Free(*s);
    RedisModule_Free(strings);
}

/* In the grandchild: become the supervisor. Only async-signal-safe calls until execve. */
static void exec_supervisor(int stdin_fd, int log_fd, int status_fd, char **argv, char **envp) {
    setsid();
    dup2(stdin_fd, 0);
    if (log_fd >= 0) {
        dup2(log_fd, 1);
        dup2(log_fd, 2);
    }
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
    execve(argv[0], argv, envp);
    int error = errno;
    if (write(status_fd, &error, sizeof error) < 0) _exit(126);
    _exit(127);
}

static void spawn(RedisModuleCtx *ctx) {
    int as_other_user = geteuid() == 0 && SRIO_Config.worker_user != NULL;
    char python[PATH_MAX], address[PATH_MAX + 16], logfile[PATH_MAX];
    if (!find_python(python, sizeof python)) {
        RedisModule_Log(ctx, "warning", "no Python interpreter found for the execution workers (set WORKER_PYTHON or "
                        "SRIO_WORKER_PYTHON); trying again later");
        return;
    }
    if (!worker_address(ctx, as_other_user, address, sizeof address)) {
        RedisModule_Log(ctx, "warning", "starting no execution worker: %s", refusal);
        return;
    }
    char workers[16], threads[16], interop[16];
    snprintf(workers, sizeof workers, "%d", SRIO_Config.workers);
    snprintf(threads, sizeof threads, "%d", SRIO_Config.threads);
    snprintf(interop, sizeof interop, "%d", SRIO_Config.interop_threads);
    char *argv[MAX_ARGS] = {python, "-m", "smartredis_io.worker", "--address", address, "--workers", workers,
                            "--device", SRIO_Config.worker_device};
    int argc = 9;
    if (as_other_user) {
        argv[argc++] = "--user";
        argv[argc++] = SRIO_Config.worker_user;
    }
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
    server_setting(ctx, "logfile", logfile, sizeof logfile);
    int log_fd = logfile[0] ? open(logfile, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644) : -1;
    char **envp = worker_environment();
    int in[2] = {-1, -1}, status[2] = {-1, -1};
    pid_t middle = -1;
    if (pipe2(in, O_CLOEXEC) == 0 && pipe2(status, O_CLOEXEC) == 0) middle = fork();
    if (middle == 0) {
        pid_t pid = fork();
        if (pid == 0) exec_supervisor(in[0], log_fd, status[1], argv, envp);
        _exit(write(status[1], &pid, sizeof pid) == sizeof pid ? 0 : 1);
    }
    free_strings(envp);
    if (log_fd >= 0) close(log_fd);
    if (in[0] >= 0) close(in[0]);
    if (status[1] >= 0) close(status[1]);
    pid_t pid = -1;
    int error = 0;
    if (middle > 0) {
        while (waitpid(middle, NULL, 0) < 0 && errno == EINTR) {}
        if (read(status[0], &pid, sizeof pid) != sizeof pid) pid = -1;
        if (pid > 0 && read(status[0], &error, sizeof error) != sizeof error) error = 0; /* closed by execve */
    }
    if (status[0] >= 0) close(status[0]);
    if (middle < 0 || pid <= 0 || error) {
        if (in[1] >= 0) close(in[1]);
        RedisModule_Log(ctx, "warning", "could not start the execution workers (%s %s): %s", python, argv[2],
                        strerror(error ? error : errno));
        return;
    }
    char line[SRIO_SECRET_MAX + 1];
    memcpy(line, SRIO_Config.secret, SRIO_Config.secret_len);
    line[SRIO_Config.secret_len] = '\n';
    if (write(in[1], line, SRIO_Config.secret_len + 1) != (ssize_t)SRIO_Config.secret_len + 1) {
        RedisModule_Log(ctx, "warning", "could not hand the worker secret to the execution workers: %s", strerror(errno));
    }
    lifeline = in[1];
    supervisor_pid = pid;
    spawned_at = SRIO_Now();
    SRIO_WorkersStartingNow();
    RedisModule_Log(ctx, "notice", "started %d execution worker(s) for %s (supervisor pid %lld: %s -m %s)",
                    SRIO_Config.workers, address, supervisor_pid, python, argv[2]);
}

/* Whether the supervisor has gone: nothing reads its standard input any more. */
static int supervisor_gone(void) {
    struct pollfd p = {.fd = lifeline, .events = 0};
    return poll(&p, 1, 0) > 0 && (p.revents & (POLLERR | POLLHUP | POLLNVAL));
}

static void monitor(RedisModuleCtx *ctx, void *data) {
    (void)data;
    long long now = SRIO_Now();
    if (lifeline >= 0 && supervisor_gone()) {
        close(lifeline);
        lifeline = -1;
        long long lived = now - spawned_at;
        backoff_ms = lived >= HEALTHY_AFTER_MS ? 0 : backoff_ms ? 2 * backoff_ms : BACKOFF_MIN_MS;
        if (backoff_ms > BACKOFF_MAX_MS) backoff_ms = BACKOFF_MAX_MS;
        next_spawn_at = now + backoff_ms;
        RedisModule_Log(ctx, "warning", "the execution workers' supervisor (pid %lld) exited after %lld s; starting "
                        "it again in %lld s", supervisor_pid, lived / 1000, backoff_ms / 1000);
    }
    int replica = RedisModule_GetContextFlags(ctx) & REDISMODULE_CTX_FLAGS_SLAVE;
    if (lifeline < 0 && !replica && now >= next_spawn_at) {
        if (!refusal[0]) check_refusal(ctx);
        if (refusal[0]) {
            RedisModule_Log(ctx, "warning", "starting no execution worker: %s", refusal);
            return; /* for good: the settings do not change */
        }
        spawn(ctx);
        if (lifeline < 0) next_spawn_at = now + BACKOFF_MAX_MS;
    }
    RedisModule_CreateTimer(ctx, CHECK_INTERVAL_MS, monitor, NULL);
}

int SRIO_SpawnRegister(RedisModuleCtx *ctx) {
    if (SRIO_Config.workers == 0) return REDISMODULE_OK;
    Dl_info where;
    if (!dladdr((void *)SRIO_SpawnRegister, &where) || !where.dli_fname || !realpath(where.dli_fname, module_file)) {
        snprintf(module_file, sizeof module_file, "%s", where.dli_fname ? where.dli_fname : "");
    }
    if (pthread_atfork(NULL, NULL, close_lifeline_in_child) != 0) return REDISMODULE_ERR;
    RedisModule_CreateTimer(ctx, 0, monitor, NULL);
    return REDISMODULE_OK;
}
