/*
 * overtake_prio: CPU priority by attained service inside PHP workers (PHP-FPM, mod_php).
 *
 * Behind PHP-FPM the CPU of a page runs in the pool's worker processes, where Apache's
 * mod_overtake_prio cannot reach it. This extension gives each request the same CPU priority: at
 * request start it arms a timer on the worker's own CPU clock; when the request has used
 * `overtake_prio.threshold_ms` of CPU the timer's signal lowers the worker's priority (a nice
 * level, or SCHED_IDLE); at request end the worker returns to its normal priority. Short requests
 * never notice it; long ones yield the CPU to them (age priority: Nuyens and van der Weij,
 * "Monotonicity in the limited processor sharing queue"; Scully, Harchol-Balter and
 * Scheller-Wolf, "SOAP").
 *
 * Guards against priority inversion (a demoted request holding a lock others wait for):
 *   - requests whose method is in `overtake_prio.exempt_methods` are never demoted (on SQLite,
 *     MediaWiki runs every non-GET request in an IMMEDIATE transaction holding the write lock),
 *     nor those the sidecar marks `X-Overtake-Exempt: 1` (a stage's `cpu_exempt`);
 *   - `overtake_prio.max_demoted_ms` bounds the wall time a request stays demoted. The restorer
 *     keeps that bound, not the worker: a worker at SCHED_IDLE beside busy normal-priority work
 *     may not run for a second, so a timer signal it must handle itself would come too late.
 *
 * Lowering a worker's priority needs no privilege; raising it back does (CAP_SYS_NICE, or an
 * RLIMIT_NICE that a root without CAP_SYS_RESOURCE cannot grant). So module start-up, which runs
 * as root in PHP-FPM's master (or Apache's parent under mod_php) before the workers fork and
 * drop privileges, also forks a small restorer: a process that keeps root's CAP_SYS_NICE and,
 * asked over an abstract Unix datagram socket, returns the asking worker (identified by the
 * kernel's SCM_CREDENTIALS, so a worker can restore only itself, and only up to the master's own
 * priority) to its normal priority. A worker that can restore neither way never demotes.
 *
 * Size classes: with `overtake_prio.class_header` on, a request the sidecar marks
 * `X-Overtake-Class: 1` (its `--cpu-priority class`: the request is predicted large) starts at the
 * low level instead of reaching it by attained CPU, as mod_overtake_prio's class header does in
 * Apache's threads; the exemptions above still come first.
 *
 * Counters live in a small file mapped shared by the master and every worker
 * (`overtake_prio.stats_file`), which the controller reads and exports.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include "php.h"
#include "php_ini.h"
#include "SAPI.h"
#include "ext/standard/info.h"

#include "op_restorer.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define OP_VERSION "0.1.0"
/* a real-time signal: PHP's own timeouts use SIGPROF/SIGALRM */
#define OP_SIGNAL (SIGRTMIN + 7)
#define OP_DEMOTE 1
#define OP_PROMOTE 2

/* The stats file's layout (little-endian uint64 words), read by overtake's controller:
 * magic, version, the totals in this order, the number of stage rows, then the rows: the same
 * counters per stage (the FastCGI parameter OVERTAKE_STAGE, which mod_overtake_prio's
 * OvertakeStage sets), the row named "none" for requests without one. */
#define OP_STATS_MAGIC 0x6f76657274616b65ULL /* "overtake" */
#define OP_STATS_VERSION 3
#define OP_STAGE_ROWS 17      /* "none" and mod_overtake_prio's 16 stages */
#define OP_STAGE_NAME 32      /* a stage name: 1..31 letters, digits, '_', '.', '-' (NUL-padded) */
#define OP_ROW_FREE 0
#define OP_ROW_CLAIMED 1      /* a worker is writing its name */
#define OP_ROW_READY 2
typedef struct {
    uint64_t requests;       /* requests the timer was armed for or exempted */
    uint64_t demoted;        /* requests demoted at the threshold */
    uint64_t exempt;         /* requests never demoted: their method is exempt */
    uint64_t promoted;       /* demoted requests promoted back after max_demoted_ms */
    uint64_t restore_errors; /* a worker failed to restore its priority (it then stops demoting) */
    uint64_t unreachable;    /* requests not armed: the worker could not restore (RLIMIT_NICE) */
    uint64_t class_low;      /* requests started at the low level: the sidecar's class header said 1 */
} op_counts;
typedef struct {
    uint64_t state;          /* OP_ROW_*: rows are claimed once and never freed */
    char name[OP_STAGE_NAME];
    op_counts c;
} op_stage_row;
typedef struct {
    uint64_t magic;
    uint64_t version;
    op_counts total;
    uint64_t rows;           /* OP_STAGE_ROWS */
    op_stage_row row[OP_STAGE_ROWS];
} op_stats;

ZEND_BEGIN_MODULE_GLOBALS(overtake_prio)
    zend_long threshold_ms;
    zend_long nice;
    bool idle;
    zend_long max_demoted_ms;
    char *exempt_methods;
    char *stats_file;
    bool class_header;
ZEND_END_MODULE_GLOBALS(overtake_prio)

ZEND_DECLARE_MODULE_GLOBALS(overtake_prio)
#define OPG(v) ZEND_MODULE_GLOBALS_ACCESSOR(overtake_prio, v)

/* Per-process state: PHP-FPM and prefork workers serve one request at a time. */
static op_stats *stats;
static pid_t timers_pid;
static timer_t cpu_timer, wall_timer;
static volatile sig_atomic_t demoted;
static int base_nice;
static bool armed, disabled, own_rlimit;

/* Per-process state for the request in progress: the stage row it counts in (set at request
 * start, read by the timer's signal handler: a pointer load and atomic adds are signal-safe). */
static op_counts *stage_counts;

#define COUNT(field)                                                                                   \
    do {                                                                                               \
        if (stats != NULL) {                                                                           \
            __atomic_fetch_add(&stats->total.field, 1, __ATOMIC_RELAXED);                              \
            if (stage_counts != NULL) {                                                                \
                __atomic_fetch_add(&stage_counts->field, 1, __ATOMIC_RELAXED);                         \
            }                                                                                          \
        }                                                                                              \
    } while (0)

static int lower(void)
{
    if (OPG(idle)) {
        struct sched_param p = {0};
        return sched_setscheduler(0, SCHED_IDLE, &p);
    }
    return setpriority(PRIO_PROCESS, 0, (int)OPG(nice));
}

static volatile sig_atomic_t deadline_sent; /* the restorer holds a deadline for this request */

static int restore(void)
{
    if ((geteuid() == 0 || own_rlimit) && !deadline_sent) {
        return op_restore_pid(0, base_nice, OPG(idle));
    }
    deadline_sent = 0;
    return op_ask_restorer(base_nice, OPG(idle)) ? 0 : -1;
}

static void arm(timer_t t, zend_long ms)
{
    struct itimerspec its = {0};
    its.it_value.tv_sec = ms / 1000;
    its.it_value.tv_nsec = (ms % 1000) * 1000000L;
    timer_settime(t, 0, &its, NULL);
}

static void disarm(timer_t t)
{
    struct itimerspec its = {0};
    timer_settime(t, 0, &its, NULL);
}

/* Lower this worker, first handing the bound on its time there to the restorer (sent while the
 * worker still runs at its normal priority); the worker's own wall timer stays as a fallback. */
static int demote(void)
{
    if (OPG(max_demoted_ms) > 0) {
        deadline_sent = op_tell_restorer(OP_RESTORE_AFTER, (int)OPG(max_demoted_ms), base_nice, OPG(idle));
    }
    if (lower() != 0) {
        return -1;
    }
    if (OPG(max_demoted_ms) > 0) {
        arm(wall_timer, OPG(max_demoted_ms));
    }
    return 0;
}

/* Whether this worker still runs at the low level (the restorer may have ended it). */
static bool still_low(void)
{
    if (OPG(idle)) {
        return sched_getscheduler(0) == SCHED_IDLE;
    }
    return getpriority(PRIO_PROCESS, 0) > base_nice;
}

/* Signal handler: only syscalls and atomics (async-signal-safe). */
static void on_timer(int sig, siginfo_t *si, void *uc)
{
    int saved = errno;
    (void)sig;
    (void)uc;
    if (si->si_value.sival_int == OP_DEMOTE && !demoted) {
        if (demote() == 0) {
            demoted = 1;
            COUNT(demoted);
        }
    } else if (si->si_value.sival_int == OP_PROMOTE && demoted) {
        if (restore() == 0) {
            demoted = 0;
            COUNT(promoted);
        }
    }
    errno = saved;
}

static int make_timer(clockid_t clock, int what, timer_t *out)
{
    struct sigevent ev;
    memset(&ev, 0, sizeof ev);
    ev.sigev_notify = SIGEV_THREAD_ID;
    ev.sigev_signo = OP_SIGNAL;
    ev.sigev_value.sival_int = what;
#ifdef sigev_notify_thread_id
    ev.sigev_notify_thread_id = (pid_t)syscall(SYS_gettid);
#else
    ev._sigev_un._tid = (pid_t)syscall(SYS_gettid);
#endif
    return timer_create(clock, &ev, out);
}

/* Timers belong to the process that made them: a forked worker makes its own. */
static bool timers_ready(void)
{
    pid_t pid = getpid();
    if (timers_pid == pid) {
        return true;
    }
    if (make_timer(CLOCK_THREAD_CPUTIME_ID, OP_DEMOTE, &cpu_timer) != 0) {
        return false;
    }
    if (make_timer(CLOCK_MONOTONIC, OP_PROMOTE, &wall_timer) != 0) {
        timer_delete(cpu_timer);
        return false;
    }
    timers_pid = pid;
    base_nice = getpriority(PRIO_PROCESS, 0);
    return true;
}

/* Can this worker come back from the low level? Root can, and so can a worker whose RLIMIT_NICE
 * reaches base_nice (20 - rlim_cur is the lowest nice it may set); others ask the restorer. */
static bool can_restore(void)
{
    struct rlimit rl;
    own_rlimit = getrlimit(RLIMIT_NICE, &rl) == 0 && (rl.rlim_cur == RLIM_INFINITY || (long)rl.rlim_cur >= 20 - base_nice);
    return geteuid() == 0 || own_rlimit || op_restorer_known();
}

static bool method_exempt(const char *method)
{
    const char *list = OPG(exempt_methods);
    size_t n;
    if (method == NULL || list == NULL) {
        return false;
    }
    n = strlen(method);
    while (*list != '\0') {
        const char *end;
        while (*list == ' ' || *list == ',') {
            list++;
        }
        end = list;
        while (*end != '\0' && *end != ' ' && *end != ',') {
            end++;
        }
        if ((size_t)(end - list) == n && strncasecmp(list, method, n) == 0) {
            return true;
        }
        list = end;
    }
    return false;
}

/* A whole number within [lo, hi], or a warning naming the setting, the range and its meaning
 * (PHP then keeps the default): never a silent clamp, never "abc" read as 0. */
static zend_result in_range(zend_ini_entry *entry, zend_string *value, zend_long lo, zend_long hi, const char *what)
{
    char *end = NULL;
    const char *text = ZSTR_VAL(value);
    long long v;
    errno = 0;
    v = strtoll(text, &end, 10);
    if (*text == '\0' || end == NULL || *end != '\0' || errno != 0 || v < lo || v > hi) {
        php_error_docref(NULL, E_WARNING, "%s must be a whole number within %ld..%ld (%s), got \"%s\"",
                         ZSTR_VAL(entry->name), (long)lo, (long)hi, what, text);
        return FAILURE;
    }
    return SUCCESS;
}

/* The sidecar marks the requests of a stage with cpu_exempt (X-Overtake-Exempt: 1), as it does
 * for mod_overtake_prio; FastCGI hands request headers over as HTTP_* variables. */
static bool header_exempt(void)
{
    char *v = sapi_getenv("HTTP_X_OVERTAKE_EXEMPT", sizeof("HTTP_X_OVERTAKE_EXEMPT") - 1);
    bool yes = v != NULL && strcmp(v, "1") == 0;
    if (v != NULL) {
        efree(v);
    }
    return yes;
}

/* The sidecar's size class (X-Overtake-Class: 1): the request starts at the low level. */
static bool header_class_low(void)
{
    char *v = sapi_getenv("HTTP_X_OVERTAKE_CLASS", sizeof("HTTP_X_OVERTAKE_CLASS") - 1);
    bool yes = v != NULL && strcmp(v, "1") == 0;
    if (v != NULL) {
        efree(v);
    }
    return yes;
}

static bool enabled(void)
{
    return OPG(threshold_ms) > 0 || OPG(class_header);
}

/* A stage name as mod_overtake_prio's OvertakeStage accepts one. */
static bool stage_name_ok(const char *v, size_t n)
{
    size_t i;
    if (n == 0 || n >= OP_STAGE_NAME) {
        return false;
    }
    for (i = 0; i < n; i++) {
        char ch = v[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_'
              || ch == '.' || ch == '-')) {
            return false;
        }
    }
    return true;
}

/* The row the request counts in: its stage's (FastCGI parameter OVERTAKE_STAGE, set by
 * mod_overtake_prio for the requests of an OvertakeStage location; a client's header would arrive
 * as HTTP_OVERTAKE_STAGE, so clients cannot choose it), claimed on the stage's first request;
 * "none" without a stage, with a name OvertakeStage would refuse, or once every row is taken.
 * Two workers may claim rows for the same new stage at once: the reader sums rows by name. */
static op_counts *stage_row(void)
{
    op_counts *out;
    char *v;
    size_t n;
    int i;
    if (stats == NULL) {
        return NULL;
    }
    out = &stats->row[0].c;
    v = sapi_getenv("OVERTAKE_STAGE", sizeof("OVERTAKE_STAGE") - 1);
    if (v == NULL) {
        return out;
    }
    n = strlen(v);
    for (i = 1; stage_name_ok(v, n) && i < OP_STAGE_ROWS; i++) {
        op_stage_row *r = &stats->row[i];
        uint64_t st = __atomic_load_n(&r->state, __ATOMIC_ACQUIRE);
        if (st == OP_ROW_FREE) {
            if (__atomic_compare_exchange_n(&r->state, &st, OP_ROW_CLAIMED, false, __ATOMIC_ACQ_REL,
                                            __ATOMIC_ACQUIRE)) {
                memset(r->name, 0, sizeof r->name);
                memcpy(r->name, v, n);
                __atomic_store_n(&r->state, OP_ROW_READY, __ATOMIC_RELEASE);
                out = &r->c;
                break;
            }
        }
        if (st == OP_ROW_READY && strncmp(r->name, v, OP_STAGE_NAME) == 0) {
            out = &r->c;
            break;
        }
    }
    efree(v);
    return out;
}

static ZEND_INI_MH(on_threshold)
{
    if (in_range(entry, new_value, 0, 3600000, "CPU milliseconds before demotion; 0 = off") != SUCCESS) {
        return FAILURE;
    }
    return OnUpdateLong(entry, new_value, mh_arg1, mh_arg2, mh_arg3, stage);
}

static ZEND_INI_MH(on_nice)
{
    if (in_range(entry, new_value, 1, 19, "the demoted nice level") != SUCCESS) {
        return FAILURE;
    }
    return OnUpdateLong(entry, new_value, mh_arg1, mh_arg2, mh_arg3, stage);
}

static ZEND_INI_MH(on_max_demoted)
{
    if (in_range(entry, new_value, 0, 3600000, "wall milliseconds at the low level; 0 = no bound") != SUCCESS) {
        return FAILURE;
    }
    return OnUpdateLong(entry, new_value, mh_arg1, mh_arg2, mh_arg3, stage);
}

PHP_INI_BEGIN()
    STD_PHP_INI_ENTRY("overtake_prio.threshold_ms", "0", PHP_INI_SYSTEM, on_threshold, threshold_ms,
                      zend_overtake_prio_globals, overtake_prio_globals)
    STD_PHP_INI_ENTRY("overtake_prio.nice", "10", PHP_INI_SYSTEM, on_nice, nice,
                      zend_overtake_prio_globals, overtake_prio_globals)
    STD_PHP_INI_BOOLEAN("overtake_prio.idle", "0", PHP_INI_SYSTEM, OnUpdateBool, idle,
                        zend_overtake_prio_globals, overtake_prio_globals)
    STD_PHP_INI_ENTRY("overtake_prio.max_demoted_ms", "0", PHP_INI_SYSTEM, on_max_demoted, max_demoted_ms,
                      zend_overtake_prio_globals, overtake_prio_globals)
    STD_PHP_INI_ENTRY("overtake_prio.exempt_methods", "POST,PUT,PATCH,DELETE", PHP_INI_SYSTEM, OnUpdateString,
                      exempt_methods, zend_overtake_prio_globals, overtake_prio_globals)
    STD_PHP_INI_ENTRY("overtake_prio.stats_file", "", PHP_INI_SYSTEM, OnUpdateString, stats_file,
                      zend_overtake_prio_globals, overtake_prio_globals)
    STD_PHP_INI_BOOLEAN("overtake_prio.class_header", "0", PHP_INI_SYSTEM, OnUpdateBool, class_header,
                        zend_overtake_prio_globals, overtake_prio_globals)
PHP_INI_END()

static void map_stats(void)
{
    const char *path = OPG(stats_file);
    int fd;
    void *m;
    if (path == NULL || *path == '\0') {
        return;
    }
    fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0 || ftruncate(fd, sizeof(op_stats)) != 0) {
        php_error_docref(NULL, E_WARNING, "overtake_prio.stats_file %s: %s; counters are not kept", path,
                         strerror(errno));
        if (fd >= 0) {
            close(fd);
        }
        return;
    }
    m = mmap(NULL, sizeof(op_stats), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) {
        php_error_docref(NULL, E_WARNING, "overtake_prio.stats_file %s: mmap: %s", path, strerror(errno));
        return;
    }
    stats = m;
    stats->magic = OP_STATS_MAGIC;
    stats->version = OP_STATS_VERSION;
    stats->rows = OP_STAGE_ROWS;
    memcpy(stats->row[0].name, "none", sizeof "none");
    __atomic_store_n(&stats->row[0].state, OP_ROW_READY, __ATOMIC_RELEASE);
}

static PHP_GINIT_FUNCTION(overtake_prio)
{
#if defined(COMPILE_DL_OVERTAKE_PRIO) && defined(ZTS)
    ZEND_TSRMLS_CACHE_UPDATE();
#endif
    memset(overtake_prio_globals, 0, sizeof(*overtake_prio_globals));
}

PHP_MINIT_FUNCTION(overtake_prio)
{
    struct sigaction sa;
    REGISTER_INI_ENTRIES();
    if (!enabled()) {
        return SUCCESS;
    }
    map_stats();
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_timer;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    sigaction(OP_SIGNAL, &sa, NULL);
    op_start_restorer();
    return SUCCESS;
}

PHP_MSHUTDOWN_FUNCTION(overtake_prio)
{
    UNREGISTER_INI_ENTRIES();
    op_stop_restorer();
    return SUCCESS;
}

PHP_RINIT_FUNCTION(overtake_prio)
{
#if defined(COMPILE_DL_OVERTAKE_PRIO) && defined(ZTS)
    ZEND_TSRMLS_CACHE_UPDATE();
#endif
    armed = false;
    demoted = 0;
    deadline_sent = 0;
    stage_counts = NULL;
    if (!enabled() || disabled) {
        return SUCCESS;
    }
    stage_counts = stage_row();
    if (method_exempt(SG(request_info).request_method) || header_exempt()) {
        COUNT(exempt);
        COUNT(requests);
        return SUCCESS;
    }
    if (!timers_ready() || !can_restore()) {
        COUNT(unreachable);
        return SUCCESS;
    }
    COUNT(requests);
    armed = true;
    if (OPG(class_header) && header_class_low() && demote() == 0) {
        demoted = 1;
        COUNT(class_low);
    }
    if (OPG(threshold_ms) > 0) {
        arm(cpu_timer, OPG(threshold_ms));
    }
    return SUCCESS;
}

PHP_RSHUTDOWN_FUNCTION(overtake_prio)
{
    if (!armed) {
        return SUCCESS;
    }
    disarm(cpu_timer);
    disarm(wall_timer);
    armed = false;
    if (demoted && !still_low()) {
        COUNT(promoted); /* the restorer kept the bound (and forgot the deadline) */
        demoted = 0;
        deadline_sent = 0;
    }
    if (demoted || deadline_sent) {
        if (restore() != 0) {
            /* stuck low would slow every later request of this worker: stop demoting */
            COUNT(restore_errors);
            disabled = true;
        }
        demoted = 0;
    }
    return SUCCESS;
}

PHP_MINFO_FUNCTION(overtake_prio)
{
    php_info_print_table_start();
    php_info_print_table_header(2, "overtake_prio", "enabled");
    php_info_print_table_row(2, "version", OP_VERSION);
    php_info_print_table_end();
    DISPLAY_INI_ENTRIES();
}

/* overtake_prio_demoted(): whether the current request runs at the low level (for tests and logs). */
ZEND_BEGIN_ARG_WITH_RETURN_TYPE_INFO_EX(arginfo_overtake_prio_demoted, 0, 0, _IS_BOOL, 0)
ZEND_END_ARG_INFO()

PHP_FUNCTION(overtake_prio_demoted)
{
    ZEND_PARSE_PARAMETERS_NONE();
    RETURN_BOOL(demoted != 0 && still_low());
}

static const zend_function_entry overtake_prio_functions[] = {
    PHP_FE(overtake_prio_demoted, arginfo_overtake_prio_demoted)
    PHP_FE_END
};

zend_module_entry overtake_prio_module_entry = {
    STANDARD_MODULE_HEADER,
    "overtake_prio",
    overtake_prio_functions,
    PHP_MINIT(overtake_prio),
    PHP_MSHUTDOWN(overtake_prio),
    PHP_RINIT(overtake_prio),
    PHP_RSHUTDOWN(overtake_prio),
    PHP_MINFO(overtake_prio),
    OP_VERSION,
    PHP_MODULE_GLOBALS(overtake_prio),
    PHP_GINIT(overtake_prio),
    NULL,
    NULL,
    STANDARD_MODULE_PROPERTIES_EX
};

#ifdef COMPILE_DL_OVERTAKE_PRIO
#ifdef ZTS
ZEND_TSRMLS_CACHE_DEFINE()
#endif
ZEND_GET_MODULE(overtake_prio)
#endif
