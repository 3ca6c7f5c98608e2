/*
 * mod_overtake_prio -- per-request CPU priority for Apache worker threads.
 *
 * Processor sharing (Linux EEVDF among equal-weight threads) is what an unmodified Apache
 * gives concurrent requests. For service times with a decreasing hazard rate,
 * least-attained-service scheduling beats it without knowing the sizes (Aalto, Ayesta and
 * Righter, "On the Gittins index in the M/G/1 queue", Queueing Systems 2009); a few
 * priority levels by attained service approximate it (multilevel processor sharing). This
 * module is that lever inside Apache:
 *
 *   - request start (post_read_request, first): note the worker thread's id, its thread CPU
 *     clock and the wall time; an optional header (OvertakePrioClassHeader, set by the
 *     sidecar) starts the request at a given level (known-phase short-first, route class);
 *   - a monitor thread per child process wakes when a threshold can have been crossed (at
 *     most every OvertakePrioInterval seconds) and, for each request in flight whose attained
 *     thread CPU has crossed the next threshold of OvertakePrioLevels, lowers its thread's
 *     priority: setpriority() to the thread's own nice value plus the level's increment (at
 *     most 19), or sched_setscheduler(SCHED_IDLE) (OvertakePrioNice ... idle);
 *   - request end: restore the thread's original nice value and policy as soon as the
 *     response's end (EOS) leaves the handler's filters, so that writing it out and logging
 *     do not wait at the demoted priority; the cleanup of the request pool (errors, client
 *     aborts, anything that never sends EOS) and child exit restore what is left;
 *   - counters per level at the handler "overtake-prio-status" (Prometheus text format);
 *   - an admission gate (OvertakeGate FILE): a request carrying the sidecar's gate header
 *     ("SLOT GENERATION MAC", signed with the key in FILE.key: a forged one is refused) waits,
 *     before anything else runs for it, on a futex word of a file the sidecar maps too, until
 *     the sidecar opens it (admission) or cancels it (503). The sidecar then sends a request
 *     to Apache as soon as it arrives, and its admission is a store and a futex wake
 *     instead of a request written to Apache and parsed there: the
 *     hand-over that leaves Apache's CPU idle between a completion and the next admission
 *     (0.28 ms measured through the sidecar, bench/handover.py) shrinks to the sidecar's
 *     reaction to the completion. A request whose gate never opens is let through after
 *     OvertakeGateTimeout, or ended when the sidecar closes its connection. A slot set to IDLE
 *     starts its request at the lowest level (SCHED_IDLE) before its admission: it runs only
 *     while Apache's core would otherwise idle (the hand-over, a client's round trip between
 *     two stages); a promoter thread gives it its priority back when the sidecar opens it.
 *
 * Raising a thread's priority back needs RLIMIT_NICE >= 20 - nice, or CAP_SYS_NICE, which
 * the workers lose when Apache switches user. post_config raises RLIMIT_NICE in the root
 * parent (OvertakePrioRlimitNice, default 20; needs CAP_SYS_RESOURCE for the hard limit).
 * Where that is not enough (a root without CAP_SYS_RESOURCE, as in some containers and VMs),
 * OvertakePrioCapSysNice auto keeps CAP_SYS_NICE -- and only that capability -- across the
 * switch to the worker user. Every child checks, on a throw-away thread, that a demotion
 * can be undone before it enables itself.
 *
 * Build: apxs -c mod_overtake_prio.c   (Debian: apt-get install apache2-dev)
 * See README.md next to this file for the directives and for use in an existing Apache.
 */

#ifndef _GNU_SOURCE
#define _GNU_SOURCE  /* apxs passes it too */
#endif
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <linux/futex.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "httpd.h"
#include "http_config.h"
#include "http_core.h"
#include "http_log.h"
#include "http_protocol.h"
#include "http_request.h"
#include "ap_mpm.h"
#include "mpm_common.h"
#include "unixd.h"
#include "apr_strings.h"
#include "apr_general.h"

#include "og_fault.h"
#include "og_hmac.h"

#define OP_MAX_LEVELS 8         /* demoted levels 1..OP_MAX_LEVELS; level 0 = original */
#define OP_NICE_IDLE 100        /* marker in nice[]: SCHED_IDLE */
#define OP_UNSET (-1)
#define OP_HANDLER "overtake-prio-status"
#define OP_RETAINED_KEY "mod_overtake_prio_retained_v4"  /* v4: gate_forged, gate_faults */

module AP_MODULE_DECLARE_DATA overtake_prio_module;

/* ------------------------------------------------------------------------ configuration */

typedef struct {
    int enabled;                        /* OvertakePrio On|Off */
    int nlevels;                        /* number of demoted levels, 0 = unset */
    double threshold[OP_MAX_LEVELS];    /* thread CPU seconds at which level k+1 starts */
    int nnice;                          /* 0 = unset: defaults from hot.nlevels */
    int nice[OP_MAX_LEVELS];            /* nice increment of level k+1, or OP_NICE_IDLE */
    double interval;                    /* monitor period, seconds */
    double resolution;                  /* CPU clock re-read period, seconds (0: every request) */
    int age;                            /* demote by attained CPU (else class header only) */
    const char *class_header;           /* NULL = "none" */
    int class_header_set;
    int rlimit_nice;                    /* RLIMIT_NICE set in the parent */
    int cap_sys_nice;                   /* OP_CAP_*: keep CAP_SYS_NICE across the user switch */
    const char *gate_file;              /* OvertakeGate: the sidecar's slot file, NULL = no gate */
    const char *gate_header;            /* OvertakeGateHeader */
    double gate_timeout;                /* OvertakeGateTimeout, seconds */
} op_conf;

enum { OP_CAP_AUTO = 0, OP_CAP_ON = 1, OP_CAP_OFF = 2 };

static void *op_create_server_conf(apr_pool_t *p, server_rec *s)
{
    op_conf *c = apr_pcalloc(p, sizeof *c);
    (void)s;
    c->enabled = OP_UNSET;
    c->interval = OP_UNSET;
    c->resolution = OP_UNSET;
    c->age = OP_UNSET;
    c->rlimit_nice = OP_UNSET;
    c->gate_timeout = OP_UNSET;
    return c;
}

/* Effective values (the directives are global: only the main server's config is used). */
static int conf_enabled(const op_conf *c) { return c->enabled == 1; }
static double conf_interval(const op_conf *c) { return c->interval > 0 ? c->interval : 0.001; }
static double conf_resolution(const op_conf *c) { return c->resolution >= 0 ? c->resolution : 0.001; }
static int conf_age(const op_conf *c) { return c->age != 0; }
static int conf_rlimit(const op_conf *c) { return c->rlimit_nice >= 0 ? c->rlimit_nice : 20; }
static const char *conf_header(const op_conf *c)
{
    return c->class_header_set ? c->class_header : "X-Overtake-Class";
}

static const char *conf_gate_header(const op_conf *c)
{
    return c->gate_header ? c->gate_header : "X-Overtake-Gate";
}
static double conf_gate_timeout(const op_conf *c) { return c->gate_timeout > 0 ? c->gate_timeout : 60.0; }

static const double op_default_thresholds[] = {0.005, 0.05};

static int conf_nlevels(const op_conf *c) { return c->nlevels ? c->nlevels : 2; }
static double conf_threshold(const op_conf *c, int k)
{
    return c->nlevels ? c->threshold[k] : op_default_thresholds[k];
}
/* Default priorities: nice +10 for every level but the last, SCHED_IDLE for the last. */
static int conf_nice(const op_conf *c, int k)
{
    if (c->nnice) {
        return c->nice[k];
    }
    return k == conf_nlevels(c) - 1 ? OP_NICE_IDLE : 10;
}

/* Every directive is server-wide. take_word and take_flag check that once, then hand the main
 * server's config to the setter the directive names in its cmd_data (an op_directive). */
typedef const char *(*op_setter)(cmd_parms *cmd, op_conf *c, const char *arg);
typedef struct {
    op_setter set;
    size_t field;               /* set_flag: offset of the int it sets in op_conf */
} op_directive;

static const char *take_word(cmd_parms *cmd, void *d, const char *arg)
{
    const char *err = ap_check_cmd_context(cmd, GLOBAL_ONLY);
    const op_directive *dir = cmd->info;
    (void)d;
    if (err) {
        return err;
    }
    return dir->set(cmd, ap_get_module_config(cmd->server->module_config, &overtake_prio_module),
                    arg);
}

static const char *take_flag(cmd_parms *cmd, void *d, int on)
{
    return take_word(cmd, d, on ? "On" : "Off");
}

static const char *set_flag(cmd_parms *cmd, op_conf *c, const char *arg)
{
    const op_directive *dir = cmd->info;
    *(int *)((char *)c + dir->field) = !strcmp(arg, "On");
    return NULL;
}

static const char *parse_seconds(apr_pool_t *p, const char *name, const char *w,
                                 double lo, double hi, double *out)
{
    char *end;
    double v;
    errno = 0;
    v = strtod(w, &end);
    if (errno || end == w || *end || !(v >= lo && v <= hi)) {
        return apr_psprintf(p, "%s: '%s' must be seconds in [%g, %g], e.g. 0.005", name, w,
                            lo, hi);
    }
    *out = v;
    return NULL;
}

/* The words of a per-level directive: 1..OP_MAX_LEVELS of them, else usage. */
static const char *split_levels(cmd_parms *cmd, const char *args, const char *usage,
                                char **words, int *n)
{
    *n = 0;
    while (*args) {
        char *w = ap_getword_conf(cmd->temp_pool, &args);
        if (!*w) {
            break;
        }
        if (*n == OP_MAX_LEVELS) {
            return apr_psprintf(cmd->pool, "%s: at most %d levels", cmd->cmd->name,
                                OP_MAX_LEVELS);
        }
        words[(*n)++] = w;
    }
    return *n ? NULL : usage;
}

static const char *set_levels(cmd_parms *cmd, op_conf *c, const char *args)
{
    char *w[OP_MAX_LEVELS];
    int n, k;
    const char *err = split_levels(cmd, args, "OvertakePrioLevels: give one or more thread-CPU "
                                   "thresholds in seconds, e.g. OvertakePrioLevels 0.005 0.05",
                                   w, &n);
    for (k = 0; !err && k < n; k++) {
        err = parse_seconds(cmd->pool, "OvertakePrioLevels", w[k], 0.0, 3600.0, &c->threshold[k]);
        if (!err && (c->threshold[k] <= 0.0 || (k > 0 && c->threshold[k] <= c->threshold[k - 1]))) {
            err = apr_psprintf(cmd->pool, "OvertakePrioLevels: thresholds must be > 0 and "
                               "strictly increasing, got %s after %g", w[k],
                               k ? c->threshold[k - 1] : 0.0);
        }
    }
    c->nlevels = err ? 0 : n;
    return err;
}

static const char *set_nice(cmd_parms *cmd, op_conf *c, const char *args)
{
    char *w[OP_MAX_LEVELS];
    int n, k;
    const char *err = split_levels(cmd, args, "OvertakePrioNice: give one nice increment (1..19) "
                                   "or 'idle' per level, e.g. OvertakePrioNice 10 idle", w, &n);
    for (k = 0; !err && k < n; k++) {
        char *end;
        long v;
        if (k > 0 && c->nice[k - 1] == OP_NICE_IDLE) {
            return "OvertakePrioNice: 'idle' (SCHED_IDLE) can only be the last level";
        }
        if (!strcasecmp(w[k], "idle")) {
            c->nice[k] = OP_NICE_IDLE;
            continue;
        }
        errno = 0;
        v = strtol(w[k], &end, 10);
        if (errno || end == w[k] || *end || v < 1 || v > 19) {
            return apr_psprintf(cmd->pool, "OvertakePrioNice: '%s' must be a nice increment "
                                "in 1..19 or 'idle', e.g. OvertakePrioNice 10 idle", w[k]);
        }
        if (k > 0 && v < c->nice[k - 1]) {
            return apr_psprintf(cmd->pool, "OvertakePrioNice: levels must not rise in "
                                "priority, got nice %ld after %d", v, c->nice[k - 1]);
        }
        c->nice[k] = (int)v;
    }
    c->nnice = err ? 0 : n;
    return err;
}

static const char *set_interval(cmd_parms *cmd, op_conf *c, const char *w)
{
    return parse_seconds(cmd->pool, "OvertakePrioInterval", w, 0.0001, 1.0, &c->interval);
}

static const char *set_resolution(cmd_parms *cmd, op_conf *c, const char *w)
{
    return parse_seconds(cmd->pool, "OvertakePrioCpuResolution", w, 0.0, 0.1, &c->resolution);
}

static const char *set_header(cmd_parms *cmd, op_conf *c, const char *w)
{
    c->class_header = strcasecmp(w, "none") ? apr_pstrdup(cmd->pool, w) : NULL;
    c->class_header_set = 1;
    return NULL;
}

static const char *set_cap(cmd_parms *cmd, op_conf *c, const char *w)
{
    static const char *const names[] = {"auto", "on", "off"};  /* indexed by OP_CAP_* */
    int k;
    for (k = 0; k < 3; k++) {
        if (!strcasecmp(w, names[k])) {
            c->cap_sys_nice = k;
            return NULL;
        }
    }
    return apr_psprintf(cmd->pool, "OvertakePrioCapSysNice: '%s' must be auto, on or off", w);
}

static const char *set_rlimit(cmd_parms *cmd, op_conf *c, const char *w)
{
    char *end;
    long v;
    errno = 0;
    v = strtol(w, &end, 10);
    if (errno || end == w || *end || v < 0 || v > 40) {
        return apr_psprintf(cmd->pool, "OvertakePrioRlimitNice: '%s' must be in 0..40 "
                            "(20 lets a thread return to nice 0)", w);
    }
    c->rlimit_nice = (int)v;
    return NULL;
}

static const char *set_gate_file(cmd_parms *cmd, op_conf *c, const char *w)
{
    if (w[0] != '/') {
        return apr_psprintf(cmd->pool, "OvertakeGate: '%s' must be an absolute path, the file "
                            "the sidecar's --gate option names (e.g. /dev/shm/overtake-gate)", w);
    }
    c->gate_file = apr_pstrdup(cmd->pool, w);
    return NULL;
}

static const char *set_gate_header(cmd_parms *cmd, op_conf *c, const char *w)
{
    c->gate_header = apr_pstrdup(cmd->pool, w);
    return NULL;
}

static const char *set_gate_timeout(cmd_parms *cmd, op_conf *c, const char *w)
{
    return parse_seconds(cmd->pool, "OvertakeGateTimeout", w, 0.001, 3600.0, &c->gate_timeout);
}

static op_directive dir_enabled = {set_flag, APR_OFFSETOF(op_conf, enabled)};
static op_directive dir_age = {set_flag, APR_OFFSETOF(op_conf, age)};
static op_directive dir_levels = {set_levels, 0};
static op_directive dir_nice = {set_nice, 0};
static op_directive dir_interval = {set_interval, 0};
static op_directive dir_header = {set_header, 0};
static op_directive dir_resolution = {set_resolution, 0};
static op_directive dir_rlimit = {set_rlimit, 0};
static op_directive dir_cap = {set_cap, 0};
static op_directive dir_gate_file = {set_gate_file, 0};
static op_directive dir_gate_header = {set_gate_header, 0};
static op_directive dir_gate_timeout = {set_gate_timeout, 0};

static const command_rec op_cmds[] = {
    AP_INIT_FLAG("OvertakePrio", take_flag, &dir_enabled, RSRC_CONF, "On: lower worker-thread CPU priority per request (default Off)"),
    AP_INIT_RAW_ARGS("OvertakePrioLevels", take_word, &dir_levels, RSRC_CONF, "thread-CPU seconds at which a request enters level 1, 2, ... (default 0.005 0.05)"),
    AP_INIT_RAW_ARGS("OvertakePrioNice", take_word, &dir_nice, RSRC_CONF, "priority of level 1, 2, ...: nice increment 1..19 over the thread's own nice, or 'idle' (SCHED_IDLE) last (default 10 ... idle)"),
    AP_INIT_TAKE1("OvertakePrioInterval", take_word, &dir_interval, RSRC_CONF, "monitor period in seconds (default 0.001)"),
    AP_INIT_TAKE1("OvertakePrioCpuResolution", take_word, &dir_resolution, RSRC_CONF, "a worker reads its thread CPU clock at most once per this many seconds; attained CPU is overcounted by less (default 0.001; 0: at every request)"),
    AP_INIT_FLAG("OvertakePrioAge", take_flag, &dir_age, RSRC_CONF, "On: demote by attained thread CPU (default); Off: class header only"),
    AP_INIT_TAKE1("OvertakePrioClassHeader", take_word, &dir_header, RSRC_CONF, "request header giving the starting level (default X-Overtake-Class; 'none' to ignore)"),
    AP_INIT_TAKE1("OvertakePrioRlimitNice", take_word, &dir_rlimit, RSRC_CONF, "RLIMIT_NICE set before Apache switches user (default 20: back to nice 0)"),
    AP_INIT_TAKE1("OvertakePrioCapSysNice", take_word, &dir_cap, RSRC_CONF, "keep CAP_SYS_NICE (only) across the switch to the worker user: auto (when RLIMIT_NICE cannot allow the restore; default), on, off"),
    AP_INIT_TAKE1("OvertakeGate", take_word, &dir_gate_file, RSRC_CONF, "file of the sidecar's admission gate (its --gate): requests with the gate header wait there until the sidecar admits them (default: no gate)"),
    AP_INIT_TAKE1("OvertakeGateHeader", take_word, &dir_gate_header, RSRC_CONF, "request header with a gated request's slot and generation (default X-Overtake-Gate)"),
    AP_INIT_TAKE1("OvertakeGateTimeout", take_word, &dir_gate_timeout, RSRC_CONF, "seconds a request waits at a gate that never opens before it is let through (default 60; keep above the sidecar's queue timeout)"),
    {NULL}
};

/* ------------------------------------------------------------------------ shared counters */

/* Cumulative counters for all children, in anonymous shared memory mapped by the parent
 * (children inherit it) and retained across graceful restarts. */
typedef struct {
    apr_uint64_t requests[OP_MAX_LEVELS + 1];        /* ended, by deepest level reached */
    apr_uint64_t demoted_age[OP_MAX_LEVELS + 1];     /* entries into a level by attained CPU */
    apr_uint64_t demoted_class[OP_MAX_LEVELS + 1];   /* entries into a level by the header */
    apr_uint64_t restores;                           /* demoted threads restored */
    apr_uint64_t restore_errors;
    apr_uint64_t demote_errors;
    apr_uint64_t untracked;                          /* no slot for the thread */
    apr_uint64_t class_invalid;                      /* unparsable or out-of-range header */
    apr_uint64_t handoffs;      /* thread began a new request before the old one's cleanup */
    apr_uint64_t monitor_ticks;
    apr_uint64_t clock_reads;   /* thread CPU clock reads at request start */
    apr_uint64_t gate_held;     /* gated requests let through by their gate opening */
    apr_uint64_t gate_wait_ns;  /* ... and their total wait */
    apr_uint64_t gate_cancels;  /* the sidecar withdrew the request (503) */
    apr_uint64_t gate_stale;    /* the slot had moved on to another request (503) */
    apr_uint64_t gate_timeouts; /* let through after OvertakeGateTimeout */
    apr_uint64_t gate_aborts;   /* the sidecar closed the connection while the request waited */
    apr_uint64_t gate_invalid;  /* unparsable header or slot out of range (400) */
    apr_uint64_t gate_forged;   /* a header whose MAC is not the key's (403) */
    apr_uint64_t gate_unmapped; /* no usable gate file: let through at once */
    apr_uint64_t gate_faults;   /* loads that found the mapped file shrunk under them */
    apr_uint64_t gate_idle_starts;  /* started at the lowest level before their admission */
    apr_uint64_t gate_promotions;   /* ... and given their priority back on it */
} op_shared;

typedef struct {
    op_shared *shm;
} op_retained;

static op_shared *shm;  /* set in post_config (parent), inherited by the children */

#define ADD(field, v) __atomic_fetch_add(&(field), (v), __ATOMIC_RELAXED)
#define LOAD(field) __atomic_load_n(&(field), __ATOMIC_RELAXED)

/* ------------------------------------------------------------------------ per-child state */

typedef struct {
    pthread_mutex_t mu;         /* guards everything below but reads of active */
    pid_t tid;
    clockid_t clk;              /* the worker thread's CPU clock */
    int orig_policy;
    struct sched_param orig_param;
    int orig_nice;
    int active;                 /* a request is in flight on this thread (atomic) */
    apr_uint64_t seq;           /* request generation on this slot */
    int64_t cpu0_ns;            /* thread CPU at request start, or less by < resolution */
    int64_t clock_read_ns;      /* owner thread only: when it last read its CPU clock ... */
    int64_t clock_cpu_ns;       /* ... and what it read */
    int level;                  /* level applied to the thread now */
    const uint32_t *gate_word;  /* an idle start's gate word until its admission (under mu) */
    uint32_t gate_gen;
} op_slot;

static const op_conf *cconf;    /* main server's config, in the child */
/* What every request start reads, together on one or two cache lines (set in child_init):
 * on a tiny request the module's cost was mostly cache misses on scattered globals. */
static struct {
    int child_ok;               /* self-test passed: demotions can be undone */
    int age;                    /* OvertakePrioAge */
    int nlevels;
    const char *hname;          /* class header, NULL = none */
    int64_t resolution_ns;
    int64_t thr_ns[OP_MAX_LEVELS];
} hot __attribute__((aligned(64)));
static op_slot *slots;
/* due[i]: monotonic time before which slot i's request cannot cross its next threshold;
 * INT64_MAX when no request is in flight there (or none can cross). Apart from the slots so
 * that a monitor pass reads a few cache lines, not two per worker thread. */
static int64_t *due;
static int nslots;
static int slots_used;          /* claimed so far (atomic) */
/* initial-exec: a plain load from the thread pointer instead of a __tls_get_addr call per
 * request (a dlopen'ed module's default); 8 bytes of glibc's static TLS surplus */
static __thread op_slot *my_slot __attribute__((tls_model("initial-exec")));
static apr_uint64_t inflight[OP_MAX_LEVELS + 1];
static int any_idle;            /* some level uses SCHED_IDLE */
static pthread_t monitor;
static int monitor_running;
static int monitor_stop;        /* under monitor_mu */
static int monitor_idle;        /* the monitor waits without a deadline: nothing in flight */
static int monitor_woken;       /* under monitor_mu: a request start ended that wait */
static void monitor_wake(void);
static pthread_mutex_t monitor_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t monitor_cv;   /* CLOCK_MONOTONIC; signalled to stop the monitor */
static int64_t late_max_ns;     /* worst monitor wake-up delay in this child */
static int64_t late_sum_ns;
/* Histogram of the monitor's wake-up delays in this child (Prometheus buckets, seconds). */
static const double late_le[] = {0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05};
#define OP_LATE_BUCKETS (sizeof late_le / sizeof late_le[0])
static apr_uint64_t late_count[OP_LATE_BUCKETS + 1];  /* last = above every bound */
static int rlimit_cur;
static int keep_cap_pending;    /* drop_privileges asked the kernel to keep capabilities */
static int has_cap_sys_nice;    /* this child's threads hold CAP_SYS_NICE */

typedef struct {
    op_slot *slot;
    apr_uint64_t seq;
} op_req;

static ap_filter_rec_t *op_end_filter_handle;

static pid_t op_gettid(void) { return (pid_t)syscall(SYS_gettid); }

static int64_t ts_ns(const struct timespec *ts)
{
    return (int64_t)ts->tv_sec * 1000000000 + ts->tv_nsec;
}

static int64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts_ns(&ts);
}

static op_slot *slot_claim(void)
{
    int i = __atomic_fetch_add(&slots_used, 1, __ATOMIC_ACQ_REL);
    op_slot *s;
    if (i >= nslots) {
        __atomic_store_n(&slots_used, nslots, __ATOMIC_RELEASE);
        return NULL;
    }
    s = &slots[i];
    s->tid = op_gettid();
    s->clock_read_ns = INT64_MIN / 2;  /* never read: the first request reads */
    if (pthread_getcpuclockid(pthread_self(), &s->clk) != 0) {
        s->clk = CLOCK_THREAD_CPUTIME_ID;  /* unusable from the monitor: age checks skip */
    }
    errno = 0;
    s->orig_nice = getpriority(PRIO_PROCESS, (id_t)s->tid);
    if (errno) {
        s->orig_nice = 0;
    }
    s->orig_policy = sched_getscheduler(s->tid);
    if (s->orig_policy < 0 || sched_getparam(s->tid, &s->orig_param) != 0) {
        s->orig_policy = SCHED_OTHER;
        memset(&s->orig_param, 0, sizeof s->orig_param);
    }
    my_slot = s;
    return s;
}

/* Move the slot's thread to level k (> current). Caller holds s->mu. */
static void apply_level(op_slot *s, int k, int by_class)
{
    int nice = conf_nice(cconf, k - 1);
    int rc;
    if (nice != OP_NICE_IDLE) {
        nice = s->orig_nice + nice > 19 ? 19 : s->orig_nice + nice;
    }
    if (nice == OP_NICE_IDLE) {
        struct sched_param p;
        memset(&p, 0, sizeof p);
        rc = sched_setscheduler(s->tid, SCHED_IDLE, &p);
    }
    else {
        rc = setpriority(PRIO_PROCESS, (id_t)s->tid, nice);
    }
    if (rc != 0) {
        ADD(shm->demote_errors, 1);  /* the thread keeps its priority; restore is harmless */
    }
    ADD(inflight[s->level], -1);
    ADD(inflight[k], 1);
    if (by_class) {
        ADD(shm->demoted_class[k], 1);
    }
    else {
        ADD(shm->demoted_age[k], 1);
    }
    s->level = k;
}

/* Give the thread its original policy and nice value back. Caller holds s->mu. */
static int restore_thread(op_slot *s)
{
    int ok = 1;
    if (any_idle && sched_setscheduler(s->tid, s->orig_policy, &s->orig_param) != 0
        && errno != ESRCH) {
        ok = 0;
    }
    if (setpriority(PRIO_PROCESS, (id_t)s->tid, s->orig_nice) != 0 && errno != ESRCH) {
        ok = 0;
    }
    return ok;
}

/* End the slot's current request: restore, count, mark idle. Caller holds s->mu. */
static void slot_close(op_slot *s)
{
    if (s->level > 0) {
        if (restore_thread(s)) {
            ADD(shm->restores, 1);
        }
        else {
            ADD(shm->restore_errors, 1);
        }
    }
    ADD(shm->requests[s->level], 1);
    ADD(inflight[s->level], -1);
    s->level = 0;
    s->gate_word = NULL;
    __atomic_store_n(&due[s - slots], INT64_MAX, __ATOMIC_RELAXED);
    __atomic_store_n(&s->active, 0, __ATOMIC_RELEASE);
}

static apr_status_t op_request_end(void *data)
{
    op_req *q = data;
    op_slot *s = q->slot;
    /* Called twice per request (EOS, then the pool cleanup): the second finds the slot
     * closed, or serving a newer request, without taking the lock (checked again under it). */
    if (!__atomic_load_n(&s->active, __ATOMIC_ACQUIRE)
        || __atomic_load_n(&s->seq, __ATOMIC_ACQUIRE) != q->seq) {
        return APR_SUCCESS;
    }
    pthread_mutex_lock(&s->mu);
    if (__atomic_load_n(&s->active, __ATOMIC_ACQUIRE) && s->seq == q->seq) {
        slot_close(s);
    }
    pthread_mutex_unlock(&s->mu);
    return APR_SUCCESS;
}

/* ------------------------------------------------------------------------ admission gate */

/* The gate file, written by the sidecar (controller/gate.py): a 64-byte head, then one 32-bit
 * futex word per slot, (generation << 2) | state. The sidecar arms a slot (new generation,
 * WAIT) before it sends the request, opens it when the policy admits the request, cancels it
 * when the request is withdrawn, and moves it to the next generation when the exchange ends,
 * so a late or duplicate request on an old generation finds it stale.
 *
 * A gated request's header is "SLOT GENERATION MAC": MAC is the first 128 bits, in hex, of
 * HMAC-SHA256(key, "TOKEN SLOT GENERATION") with the file's pairing token, so a client that
 * reaches Apache directly cannot park a worker with a slot it read or guessed (403 at once).
 * The key is FILE.key, read by the root parent before the children start (created there when
 * missing); the head carries HMAC(key, "OVTGATE2 file SLOTS TOKEN"), and only a file written
 * with this key is mapped, so a file put at the path by anyone else is never used.
 *
 * The file can shrink under the mapping (truncate): every load from it goes through og_load
 * (og_fault.h), which turns the SIGBUS into a failed load; the file then counts as gone and
 * gated requests, held ones included, pass at once, as without a file. */
#define OG_MAGIC "OVTGATE2"
enum { OG_WAIT = 0, OG_OPEN = 1, OG_CANCEL = 2, OG_IDLE = 3 };
#define OG_NOTE "overtake-gate-idle"  /* r->notes: "SLOT GEN" of a request started idle */
#define OG_GEN_MASK 0x3fffffffu
#define OG_SLICE_NS 100000000   /* between checks that the sidecar still holds the connection */
#define OG_MAX_SLOTS (1u << 20) /* the sidecar's gate_slots bound */
#define OG_KEY_BYTES 32
#define OG_MAC_BYTES 16         /* of the header's MAC: HMAC-SHA256 truncated to 128 bits */

typedef struct {
    char magic[8];
    uint32_t nslots;
    uint32_t token;             /* the sidecar's random pairing token, shown in the status */
    uint32_t epoch;             /* bumped (and woken) by the sidecar when it opens an idle start */
    uint32_t reserved[3];
    uint8_t keycheck[32];       /* HMAC(key, "OVTGATE2 file SLOTS TOKEN") */
} og_head;

/* Every mapping covers the largest file, so a file that shrinks and grows again in place
 * (a restarted sidecar with another slot count) is served by the same mapping. */
#define OG_MAP_BYTES (sizeof(og_head) + 4 * (size_t)OG_MAX_SLOTS)

/* A checked file as requests use it, published whole (never freed: a request may hold it). */
typedef struct {
    og_head *head;
    uint32_t *words;
    uint32_t nslots;
} og_view;

/* The key, read in the root parent in post_config; the children inherit it. */
static struct {
    int loaded;
    og_hmac_key mac;            /* the key's pad states */
} gate_key;

/* What a child has said about its file since the file was last good (each once). */
enum { OG_SAID_UNMAPPED = 1, OG_SAID_FAULT = 2, OG_SAID_GONE = 4, OG_SAID_FOREIGN = 8,
       OG_SAID_CHANGED = 16 };

static pthread_t promoter;      /* restores idle starts on admission (gate_promote) */
static int promoter_running;
static volatile int promoter_stop;
static int said_forged, said_invalid;   /* first forged / malformed header of this child */

static struct {
    pthread_mutex_t mu;         /* guards the fields below but reads of view */
    og_view *view;              /* published (release) while the file is usable; NULL: pass */
    og_view *last;              /* the newest view made, republished when the file is good again */
    og_head *map;               /* this child's mapping (OG_MAP_BYTES) of the inode below */
    dev_t dev;
    ino_t ino;
    unsigned said;              /* OG_SAID_* */
    server_rec *s;
} gate = {PTHREAD_MUTEX_INITIALIZER, NULL, NULL, NULL, 0, 0, 0, NULL};

/* A guarded load found the page of addr gone: the file shrank under the mapping. If it is the
 * mapping in use, requests pass from now on, until a gate_map finds a good file again. */
static void gate_fault(const void *addr)
{
    const char *a = addr;
    int first;
    ADD(shm->gate_faults, 1);
    pthread_mutex_lock(&gate.mu);
    if (gate.map && a >= (const char *)gate.map && a < (const char *)gate.map + OG_MAP_BYTES) {
        __atomic_store_n(&gate.view, NULL, __ATOMIC_RELEASE);
    }
    first = !(gate.said & OG_SAID_FAULT);
    gate.said |= OG_SAID_FAULT;
    pthread_mutex_unlock(&gate.mu);
    if (first) {
        ap_log_error(APLOG_MARK, APLOG_ERR, 0, gate.s, APLOGNO(90101) "mod_overtake_prio: "
                     "OvertakeGate %s shrank under its mapping (truncated?): requests held on it "
                     "and new gated requests pass at once until the sidecar writes it again",
                     cconf->gate_file);
    }
}

/* *out = *w from the gate mapping; 0 (and the file counts as gone) if its page is gone. */
static int gate_load(const uint32_t *w, uint32_t *out)
{
    if (og_load(w, out)) {
        return 1;
    }
    gate_fault(w);
    return 0;
}

/* Why the open file fd (st) is no gate file of this server's key, or NULL; *h: its head.
 * Read with pread, not through a mapping: nothing here can fault. */
static const char *gate_check(int fd, const struct stat *st, og_head *h)
{
    uint8_t want[32];
    char msg[64];
    int n;
    if (!S_ISREG(st->st_mode)) {
        return "it is not a regular file";
    }
    if (pread(fd, h, sizeof *h, 0) != (ssize_t)sizeof *h) {
        return "it is shorter than a gate file's head (empty: no sidecar has written it yet)";
    }
    if (memcmp(h->magic, OG_MAGIC, 8)) {
        return "it has no " OG_MAGIC " head (not written by a sidecar of this version)";
    }
    if (h->nslots == 0 || h->nslots > OG_MAX_SLOTS
        || st->st_size != (off_t)(sizeof *h + 4 * (uint64_t)h->nslots)) {
        return "its size does not match its slot count";
    }
    n = snprintf(msg, sizeof msg, "OVTGATE2 file %u %u", h->nslots, h->token);
    og_hmac(&gate_key.mac, msg, (size_t)n, want);
    if (!og_equal(want, h->keycheck, sizeof want)) {
        return "it was not written with this server's key (a sidecar that read another key "
               "file, or no sidecar's file)";
    }
    return NULL;
}

/* Publish a view of the mapping with n slots (the last one made, if it is the same).
 * Caller holds gate.mu. */
static int gate_publish(uint32_t n)
{
    og_view *v = gate.last;
    if (!v || v->head != gate.map || v->nslots != n) {
        v = malloc(sizeof *v);
        if (!v) {
            return 0;
        }
        v->head = gate.map;
        v->words = (uint32_t *)(gate.map + 1);
        v->nslots = n;
        gate.last = v;
    }
    __atomic_store_n(&gate.view, v, __ATOMIC_RELEASE);
    return 1;
}

/* Map the gate file and publish it; 1 if a usable file is published. A request (recheck 0)
 * looks only while none is; the status page (recheck 1) judges the path again every time. The
 * file changed in place (same inode): judged again, unpublished if no longer good. Another
 * inode at the path: mapped if good (a sidecar that re-created it), else ignored; the old
 * mapping stays (requests may still wait on it: they end by the sidecar, stale or by the
 * connection check). Each change is logged once. */
static int gate_map(int recheck)
{
    struct stat st;
    og_head h;
    const char *why = NULL;
    unsigned say = 0;
    int fd, same = 0, gone = 0, err = 0, ok;
    if (!gate_key.loaded) {
        return 0;  /* said at start: gated requests pass */
    }
    if (__atomic_load_n(&gate.view, __ATOMIC_ACQUIRE) && !recheck) {
        return 1;
    }
    pthread_mutex_lock(&gate.mu);
    fd = open(cconf->gate_file, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0 || fstat(fd, &st) != 0) {
        err = errno;
        gone = err == ENOENT;
        why = "it cannot be opened";
    }
    else {
        same = gate.map && st.st_dev == gate.dev && st.st_ino == gate.ino;
        why = gate_check(fd, &st, &h);
        if (!why && !same) {
            void *m = mmap(NULL, OG_MAP_BYTES, PROT_READ, MAP_SHARED, fd, 0);
            if (m == MAP_FAILED || !og_fault_install()) {
                err = errno;
                why = "it cannot be mapped";
                if (m != MAP_FAILED) {
                    munmap(m, OG_MAP_BYTES);
                }
            }
            else {
                gate.map = m;
                gate.dev = st.st_dev;
                gate.ino = st.st_ino;
                same = 1;
            }
        }
    }
    if (fd >= 0) {
        close(fd);
    }
    if (!why) {
        if (gate_publish(h.nslots)) {
            gate.said = 0;
        }
    }
    else if (gate.view && same) {  /* the file in use changed: truncated, or another key's */
        __atomic_store_n(&gate.view, NULL, __ATOMIC_RELEASE);
        say = OG_SAID_CHANGED;
    }
    else if (gate.view) {          /* removed or replaced: what waits keeps the old file */
        say = gone ? OG_SAID_GONE : OG_SAID_FOREIGN;
    }
    if (say & gate.said) {
        say = 0;
    }
    gate.said |= say;
    ok = __atomic_load_n(&gate.view, __ATOMIC_ACQUIRE) != NULL;
    pthread_mutex_unlock(&gate.mu);
    if (say == OG_SAID_CHANGED) {
        ap_log_error(APLOG_MARK, APLOG_ERR, err, gate.s, APLOGNO(90102) "mod_overtake_prio: "
                     "OvertakeGate %s changed under its mapping: %s; gated requests pass at once "
                     "until the sidecar writes it again", cconf->gate_file, why);
    }
    else if (say == OG_SAID_GONE) {
        ap_log_error(APLOG_MARK, APLOG_WARNING, 0, gate.s, APLOGNO(90103) "mod_overtake_prio: "
                     "OvertakeGate %s was removed; requests keep waiting on the file mapped "
                     "before (the sidecar sends no new ones to it)", cconf->gate_file);
    }
    else if (say == OG_SAID_FOREIGN) {
        ap_log_error(APLOG_MARK, APLOG_WARNING, err, gate.s, APLOGNO(90104) "mod_overtake_prio: "
                     "OvertakeGate %s was replaced by a file this server does not use: %s; "
                     "requests keep waiting on the file mapped before", cconf->gate_file, why);
    }
    return ok;
}

/* The sidecar closed the connection (it gave the request up, or it went away)? */
static int gate_client_gone(conn_rec *c)
{
    apr_socket_t *sock = ap_get_conn_socket(c);
    apr_os_sock_t fd;
    char b;
    ssize_t n;
    if (!sock || apr_os_sock_get(&fd, sock) != APR_SUCCESS) {
        return 0;
    }
    n = recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

/* "SLOT GENERATION MAC": two decimal numbers and 2 * OG_MAC_BYTES hex digits. */
static int parse_gate(const char *h, unsigned long *slot, unsigned long *gen,
                      uint8_t mac[OG_MAC_BYTES])
{
    char *end;
    if (*h < '0' || *h > '9') {
        return 0;
    }
    errno = 0;
    *slot = strtoul(h, &end, 10);
    if (errno || *end != ' ' || end[1] < '0' || end[1] > '9') {
        return 0;
    }
    h = end + 1;
    *gen = strtoul(h, &end, 10);
    if (errno || *end != ' ' || *gen > OG_GEN_MASK) {
        return 0;
    }
    h = end + 1;
    return strlen(h) == 2 * OG_MAC_BYTES && og_unhex(h, OG_MAC_BYTES, mac);
}

/* The header's MAC is the key's for this file (token), slot and generation? Constant time. */
static int gate_verify(uint32_t token, unsigned long slot, unsigned long gen,
                       const uint8_t mac[OG_MAC_BYTES])
{
    char msg[48];
    uint8_t want[32];
    int n = snprintf(msg, sizeof msg, "%u %lu %lu", token, slot, gen);
    og_hmac(&gate_key.mac, msg, (size_t)n, want);
    return og_equal(want, mac, OG_MAC_BYTES);
}

/* Log level of a refused header: the first of this child at WARNING, the rest (counted on the
 * status page) at DEBUG, so that a flood of them does not flood the log. */
static int gate_refusal_level(int *said)
{
    return __atomic_exchange_n(said, 1, __ATOMIC_RELAXED) ? APLOG_DEBUG : APLOG_WARNING;
}

/* Before every other hook of the request (and before the CPU-priority start, so that neither
 * its wall age nor its thread CPU counts the wait). */
static int gate_post_read_request(request_rec *r)
{
    const char *h;
    unsigned long slot, gen;
    uint8_t mac[OG_MAC_BYTES];
    og_view *view;
    uint32_t *w, v, token;
    int64_t t0, deadline, now;
    int slices = 0;

    if (!cconf || !cconf->gate_file || !shm || r->main || r->prev) {
        return DECLINED;
    }
    h = apr_table_get(r->headers_in, conf_gate_header(cconf));
    if (!h) {
        return DECLINED;
    }
    if (!parse_gate(h, &slot, &gen, mac)) {
        ADD(shm->gate_invalid, 1);
        ap_log_rerror(APLOG_MARK, gate_refusal_level(&said_invalid), 0, r, APLOGNO(90105)
                      "mod_overtake_prio: %s: '%.80s' is not 'SLOT GENERATION MAC' (400; "
                      "further ones are counted in overtake_gate_invalid_total)",
                      conf_gate_header(cconf), h);
        return HTTP_BAD_REQUEST;
    }
    apr_table_unset(r->headers_in, conf_gate_header(cconf));
    view = gate_map(0) ? __atomic_load_n(&gate.view, __ATOMIC_ACQUIRE) : NULL;
    if (!view || !gate_load(&view->head->token, &token)) {
        int first;
        ADD(shm->gate_unmapped, 1);
        pthread_mutex_lock(&gate.mu);
        first = !(gate.said & (OG_SAID_UNMAPPED | OG_SAID_FAULT));
        gate.said |= OG_SAID_UNMAPPED;
        pthread_mutex_unlock(&gate.mu);
        if (first) {
            ap_log_rerror(APLOG_MARK, APLOG_ERR, 0, r, APLOGNO(90106) "mod_overtake_prio: "
                          "OvertakeGate %s %s; gated requests pass at once", cconf->gate_file,
                          gate_key.loaded ? "is missing or not a gate file of this server's key "
                          "(start the sidecar with --gate on the same path)"
                          : "is not used: its key file was refused at start (see above)");
        }
        return DECLINED;
    }
    if (!gate_verify(token, slot, gen, mac)) {
        ADD(shm->gate_forged, 1);
        ap_log_rerror(APLOG_MARK, gate_refusal_level(&said_forged), 0, r, APLOGNO(90107)
                      "mod_overtake_prio: %s: slot %lu generation %lu carries a MAC that is not "
                      "the sidecar's (403; further ones are counted in "
                      "overtake_gate_forged_total)", conf_gate_header(cconf), slot, gen);
        return HTTP_FORBIDDEN;
    }
    if (slot >= view->nslots) {
        ADD(shm->gate_invalid, 1);
        ap_log_rerror(APLOG_MARK, APLOG_WARNING, 0, r, APLOGNO(90108) "mod_overtake_prio: gate "
                      "slot %lu is beyond the file's %u", slot, view->nslots);
        return HTTP_BAD_REQUEST;
    }
    w = &view->words[slot];
    t0 = mono_ns();
    deadline = t0 + (int64_t)(conf_gate_timeout(cconf) * 1e9);
    for (;;) {
        struct timespec ts;
        int64_t left;
        if (!gate_load(w, &v)) {  /* the file shrank: as without a file */
            ADD(shm->gate_unmapped, 1);
            return DECLINED;
        }
        if ((v >> 2) != gen) {
            ADD(shm->gate_stale, 1);
            return HTTP_SERVICE_UNAVAILABLE;
        }
        if ((v & 3) == OG_OPEN) {
            break;
        }
        /* idle start: only where this child can demote (and restore) its threads */
        if ((v & 3) == OG_IDLE && __atomic_load_n(&hot.child_ok, __ATOMIC_ACQUIRE) && promoter_running) {
            apr_table_setn(r->notes, OG_NOTE, apr_psprintf(r->pool, "%lu %lu", slot, gen));
            ADD(shm->gate_idle_starts, 1);
            return DECLINED;  /* op_post_read_request starts it at the idle level */
        }
        if ((v & 3) == OG_CANCEL) {
            ADD(shm->gate_cancels, 1);
            return HTTP_SERVICE_UNAVAILABLE;
        }
        now = mono_ns();
        if (now >= deadline) {
            ADD(shm->gate_timeouts, 1);
            ap_log_rerror(APLOG_MARK, APLOG_WARNING, 0, r, APLOGNO(90109) "mod_overtake_prio: "
                          "gate slot %lu not opened within OvertakeGateTimeout %g s; let through",
                          slot, conf_gate_timeout(cconf));
            return DECLINED;
        }
        /* a slice ended without news: is the sidecar still there? (one recv per 100 ms) */
        if (slices++ && gate_client_gone(r->connection)) {
            ADD(shm->gate_aborts, 1);
            r->connection->keepalive = AP_CONN_CLOSE;
            return HTTP_SERVICE_UNAVAILABLE;
        }
        left = deadline - now < OG_SLICE_NS ? deadline - now : OG_SLICE_NS;
        ts.tv_sec = (time_t)(left / 1000000000);
        ts.tv_nsec = (long)(left % 1000000000);
        /* shared (not FUTEX_PRIVATE): the sidecar's process wakes us through its own mapping;
         * a page gone under it is EFAULT here, and the next load says so */
        syscall(SYS_futex, w, FUTEX_WAIT, v, &ts, NULL, 0);
    }
    ADD(shm->gate_held, 1);
    ADD(shm->gate_wait_ns, (apr_uint64_t)(mono_ns() - t0));
    return DECLINED;
}

/* Back to level 0: an idle start the sidecar has opened. Caller holds s->mu. */
static void gate_promote(op_slot *s)
{
    if (restore_thread(s)) {
        ADD(shm->restores, 1);
    }
    else {
        ADD(shm->restore_errors, 1);
    }
    ADD(inflight[s->level], -1);
    ADD(inflight[0], 1);
    s->level = 0;
    s->gate_word = NULL;
    ADD(shm->gate_promotions, 1);
    /* its age levels start over from here (attained CPU includes the idle run) */
    __atomic_store_n(&due[s - slots], hot.age && hot.nlevels > 0 ? s->clock_read_ns + hot.thr_ns[0]
                                                                 : INT64_MAX, __ATOMIC_RELAXED);
}

/* Waits on the gate file's epoch word (the sidecar bumps and wakes it when it opens an idle
 * start) and restores every idle start whose slot is open, cancelled, moved on or gone. */
static void *promoter_main(void *arg)
{
    uint32_t seen = 0;
    sigset_t bus;
    (void)arg;
    /* started with every signal blocked; a guarded load needs SIGBUS (og_fault.h) */
    sigemptyset(&bus);
    sigaddset(&bus, SIGBUS);
    pthread_sigmask(SIG_UNBLOCK, &bus, NULL);
    while (!promoter_stop) {
        og_view *view = __atomic_load_n(&gate.view, __ATOMIC_ACQUIRE);
        struct timespec ts = {0, 50000000};  /* 50 ms: also the bound on a missed wake-up */
        int n, i;
        if (!view) {
            nanosleep(&ts, NULL);
            gate_map(0);
        }
        else {
            syscall(SYS_futex, &view->head->epoch, FUTEX_WAIT, seen, &ts, NULL, 0);
            if (!gate_load(&view->head->epoch, &seen)) {
                nanosleep(&ts, NULL);  /* EFAULT returns at once: no busy loop */
            }
        }
        n = __atomic_load_n(&slots_used, __ATOMIC_ACQUIRE);
        if (n > nslots) {
            n = nslots;
        }
        for (i = 0; i < n; i++) {
            op_slot *s = &slots[i];
            const uint32_t *gw = NULL;
            uint32_t v;
            if (!__atomic_load_n(&s->gate_word, __ATOMIC_ACQUIRE)) {
                continue;
            }
            pthread_mutex_lock(&s->mu);
            if (s->gate_word && __atomic_load_n(&s->active, __ATOMIC_ACQUIRE)) {
                if (!og_load(s->gate_word, &v)) {
                    gw = s->gate_word;  /* the file shrank: let it run at its own priority */
                    gate_promote(s);
                }
                else if ((v >> 2) != s->gate_gen || (v & 3) != OG_IDLE) {
                    gate_promote(s);
                }
            }
            pthread_mutex_unlock(&s->mu);
            if (gw) {
                gate_fault(gw);
            }
        }
    }
    return NULL;
}

/* ---- in the root parent (post_config): the key and the file's group -------------------- */

/* The key in path (64 hex digits) into key; NULL, or why not (*missing: no such file). A key
 * file of root's that gives its group nothing (0600) gets the workers' group: a sidecar gives a
 * gate file it creates the key file's group, so that the workers can read it. */
static const char *gate_key_read(apr_pool_t *p, const char *path, uint8_t key[OG_KEY_BYTES],
                                 int *missing)
{
    char buf[4 * OG_KEY_BYTES + 1];
    struct stat st;
    ssize_t n;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    *missing = fd < 0 && errno == ENOENT;
    if (fd < 0) {
        return apr_psprintf(p, "cannot be opened (%s)", strerror(errno));
    }
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return "is not a regular file (remove it)";
    }
    if (st.st_uid != 0 && st.st_uid != geteuid()) {
        close(fd);
        return apr_psprintf(p, "belongs to uid %ld: the key must belong to root (someone else "
                            "may know it; remove it, or chown root and let a sidecar that does "
                            "not run as root read it through the file's group)",
                            (long)st.st_uid);
    }
    if (st.st_mode & 027) {
        close(fd);
        return apr_psprintf(p, "has mode %04o: others may read or change it (chmod 0600, or "
                            "0640 for a sidecar that reads it through the file's group)",
                            (unsigned)(st.st_mode & 07777));
    }
    if (geteuid() == 0 && st.st_uid == 0 && !(st.st_mode & 070)
        && st.st_gid != ap_unixd_config.group_id) {
        (void)!fchown(fd, (uid_t)-1, ap_unixd_config.group_id);  /* best effort: see the file's */
    }
    n = read(fd, buf, sizeof buf - 1);
    close(fd);
    while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == '\r' || buf[n - 1] == ' ')) {
        n--;
    }
    if (n != 2 * OG_KEY_BYTES || !og_unhex(buf, OG_KEY_BYTES, key)) {
        return "does not hold 64 hex digits (remove it: Apache or the sidecar creates a new one)";
    }
    return NULL;
}

/* A new random key at path, mode 0600: written to a temporary file, then linked into place,
 * so that neither side ever reads half a key and a key the sidecar made meanwhile wins. */
static const char *gate_key_create(apr_pool_t *p, const char *path)
{
    uint8_t raw[OG_KEY_BYTES];
    char hex[2 * OG_KEY_BYTES + 2];
    const char *tmp = apr_psprintf(p, "%s.%ld.tmp", path, (long)getpid());
    int fd, ok, err;
    if (apr_generate_random_bytes(raw, sizeof raw) != APR_SUCCESS) {
        return "cannot be created (no random bytes from apr_generate_random_bytes)";
    }
    og_hex(raw, sizeof raw, hex);
    hex[2 * OG_KEY_BYTES] = '\n';
    memset(raw, 0, sizeof raw);
    fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {
        return apr_psprintf(p, "cannot be created (%s)", strerror(errno));
    }
    ok = write(fd, hex, 2 * OG_KEY_BYTES + 1) == 2 * OG_KEY_BYTES + 1;
    err = errno;
    close(fd);
    memset(hex, 0, sizeof hex);
    if (ok && link(tmp, path) != 0 && errno != EEXIST) {
        ok = 0;
        err = errno;
    }
    unlink(tmp);
    return ok ? NULL : apr_psprintf(p, "cannot be created (%s)", strerror(err));
}

/* Root only: the gate file exists (empty until a sidecar writes it) and belongs to the
 * workers' group, mode 0640, so that they can read it and other users cannot. A file of a
 * sidecar that does not run as root is left as it is (its group must be the workers'). */
static void gate_file_prepare(server_rec *s, const char *path)
{
    struct stat st;
    int fd;
    if (geteuid() != 0) {
        return;
    }
    fd = open(path, O_RDONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0640);
    if (fd < 0) {
        ap_log_error(APLOG_MARK, APLOG_WARNING, errno, s, APLOGNO(90110) "mod_overtake_prio: "
                     "cannot create OvertakeGate %s; the sidecar creates it (its group must be "
                     "Apache's Group for the workers to read it)", path);
        return;
    }
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == 0
        && (fchown(fd, (uid_t)-1, ap_unixd_config.group_id) != 0 || fchmod(fd, 0640) != 0)) {
        ap_log_error(APLOG_MARK, APLOG_WARNING, errno, s, APLOGNO(90111) "mod_overtake_prio: "
                     "cannot give OvertakeGate %s to group %ld, mode 0640; the workers may not "
                     "read it", path, (long)ap_unixd_config.group_id);
    }
    close(fd);
}

/* The key (created when missing) and the file, before the children start. */
static void gate_prepare(apr_pool_t *p, server_rec *s, const op_conf *c)
{
    const char *kpath = apr_pstrcat(p, c->gate_file, ".key", NULL);
    uint8_t key[OG_KEY_BYTES];
    int missing;
    const char *why = gate_key_read(p, kpath, key, &missing);
    if (why && missing) {
        why = gate_key_create(p, kpath);
        if (!why) {
            why = gate_key_read(p, kpath, key, &missing);
        }
    }
    gate_key.loaded = !why;
    if (why) {
        ap_log_error(APLOG_MARK, APLOG_ERR, 0, s, APLOGNO(90112) "mod_overtake_prio: the key "
                     "file of OvertakeGate, %s, %s; gated requests pass at once (the sidecar "
                     "keeps its queue itself)", kpath, why);
    }
    else {
        og_hmac_init(&gate_key.mac, key, sizeof key);
    }
    memset(key, 0, sizeof key);
    gate_file_prepare(s, c->gate_file);
}

static int parse_class(const char *h, int *out)
{
    char *end;
    long v;
    errno = 0;
    v = strtol(h, &end, 10);
    while (*end == ' ' || *end == '\t') {
        end++;
    }
    if (errno || end == h || *end || v < 0 || v > hot.nlevels) {
        return 0;
    }
    *out = (int)v;
    return 1;
}

static int op_post_read_request(request_rec *r)
{
    op_slot *s;
    op_req *q;
    int start = 0;
    const uint32_t *gate_word = NULL, *gate_gone = NULL;
    uint32_t gate_gen = 0;
    struct timespec cpu;
    int64_t now;
    const char *hname;

    if (!hot.child_ok || r->main || r->prev) {
        return DECLINED;  /* subrequests and internal redirects belong to the first request */
    }
    s = my_slot ? my_slot : slot_claim();
    if (!s) {
        ADD(shm->untracked, 1);
        return DECLINED;
    }
    hname = hot.hname;
    if (hname) {
        const char *h = apr_table_get(r->headers_in, hname);
        if (h && !parse_class(h, &start)) {
            ADD(shm->class_invalid, 1);
            ap_log_rerror(APLOG_MARK, APLOG_DEBUG, 0, r, APLOGNO(90001)
                          "%s: '%s' is not a level in 0..%d",
                          hname, h, hot.nlevels);
        }
    }
    {
        /* an idle start (the gate's IDLE state): the lowest level until the sidecar opens it */
        const char *note = apr_table_get(r->notes, OG_NOTE);
        og_view *gv = note ? __atomic_load_n(&gate.view, __ATOMIC_ACQUIRE) : NULL;
        unsigned long gslot, ggen;
        if (gv && sscanf(note, "%lu %lu", &gslot, &ggen) == 2 && gslot < gv->nslots) {
            gate_word = &gv->words[gslot];
            gate_gen = (uint32_t)ggen;
            start = hot.nlevels;
        }
    }
    now = mono_ns();
    /* The thread CPU clock is a system call (the vDSO has no thread clocks), which costs a
     * tiny request ~2 % of its CPU: read it at most once per resolution. A reading taken
     * at t <= now is short of the CPU at this start by less than now - t (CPU never runs ahead
     * of wall time), so attained CPU is overcounted by less than the resolution, and no
     * threshold can be crossed before clock_read_ns + threshold. Class-only mode reads none. */
    if (hot.age && now - s->clock_read_ns >= hot.resolution_ns) {
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu);
        s->clock_cpu_ns = ts_ns(&cpu);
        s->clock_read_ns = now;
        ADD(shm->clock_reads, 1);
    }

    pthread_mutex_lock(&s->mu);
    if (__atomic_load_n(&s->active, __ATOMIC_ACQUIRE)) {
        /* The previous request's pool outlived its work on this thread (async write
         * completion): the thread now serves this request, so its priority is reset. */
        slot_close(s);
        ADD(shm->handoffs, 1);
    }
    __atomic_store_n(&s->seq, s->seq + 1, __ATOMIC_RELEASE);
    s->cpu0_ns = s->clock_cpu_ns;
    s->level = 0;
    ADD(inflight[0], 1);
    if (start > 0) {
        apply_level(s, start, 1);
    }
    if (gate_word) {
        uint32_t v = 0;
        if (!og_load(gate_word, &v)) {
            gate_gone = gate_word;  /* the file shrank: it runs at its own priority */
        }
        else if ((v >> 2) == gate_gen && (v & 3) == OG_IDLE) {
            s->gate_word = gate_word;  /* the promoter restores it when the slot opens */
            s->gate_gen = gate_gen;
        }
        else if (s->level > 0) {  /* opened (or given up) meanwhile: run at its own priority */
            gate_promote(s);
        }
    }
    __atomic_store_n(&due[s - slots],
                     hot.age && s->level < hot.nlevels ? s->clock_read_ns + hot.thr_ns[s->level]
                                                           : INT64_MAX,
                     __ATOMIC_RELAXED);
    __atomic_store_n(&s->active, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&s->mu);
    if (gate_gone) {
        gate_fault(gate_gone);
    }
    if (hot.age) {
        __atomic_thread_fence(__ATOMIC_SEQ_CST);  /* due[] before monitor_idle: see monitor_main */
        if (__atomic_load_n(&monitor_idle, __ATOMIC_SEQ_CST)) {
            monitor_wake();
        }
    }

    q = apr_palloc(r->pool, sizeof *q);
    q->slot = s;
    q->seq = s->seq;
    ap_set_module_config(r->request_config, &overtake_prio_module, q);
    apr_pool_cleanup_register(r->pool, q, op_request_end, apr_pool_cleanup_null);
    return DECLINED;
}

/* Every request that runs a handler (internal redirects included) gets the end filter. */
static void op_insert_filter(request_rec *r)
{
    request_rec *first = r;
    op_req *q;
    if (r->main) {
        return;
    }
    while (first->prev) {
        first = first->prev;
    }
    q = ap_get_module_config(first->request_config, &overtake_prio_module);
    if (q) {
        ap_add_output_filter_handle(op_end_filter_handle, q, r, r->connection);
    }
}

/* EOS = the handler and the content filters are done: the rest of the request (protocol
 * filters, the network write, logging) is not the request's CPU demand. Restoring before
 * the last write also means a client never sees the response of a still-demoted thread. */
static apr_status_t op_end_filter(ap_filter_t *f, apr_bucket_brigade *bb)
{
    if (!APR_BRIGADE_EMPTY(bb) && APR_BUCKET_IS_EOS(APR_BRIGADE_LAST(bb))) {
        op_request_end(f->ctx);
        ap_remove_output_filter(f);
    }
    return ap_pass_brigade(f->next, bb);
}

/* One monitor pass: demote the threads whose attained CPU crossed a threshold. Returns the
 * earliest time at which an in-flight request could cross its next one (INT64_MAX: none). */
static int64_t monitor_scan(int64_t now)
{
    int n = __atomic_load_n(&slots_used, __ATOMIC_ACQUIRE);
    int64_t soonest = INT64_MAX;
    int i;
    if (n > nslots) {
        n = nslots;
    }
    for (i = 0; i < n; i++) {
        op_slot *s = &slots[i];
        struct timespec ts;
        int64_t after = __atomic_load_n(&due[i], __ATOMIC_RELAXED);
        if (now < after) {
            /* thread CPU <= wall time since start: it cannot have crossed yet */
            soonest = after < soonest ? after : soonest;
            continue;
        }
        pthread_mutex_lock(&s->mu);
        if (__atomic_load_n(&s->active, __ATOMIC_ACQUIRE) && s->level < hot.nlevels) {
            after = INT64_MAX;
            if (s->clk != CLOCK_THREAD_CPUTIME_ID && clock_gettime(s->clk, &ts) == 0) {
                int64_t cpu = ts_ns(&ts) - s->cpu0_ns;
                int k = s->level;
                while (k < hot.nlevels && cpu >= hot.thr_ns[k]) {
                    k++;
                }
                if (k > s->level) {
                    apply_level(s, k, 0);
                }
                if (s->level < hot.nlevels) {
                    after = now + (hot.thr_ns[s->level] - cpu);
                }
            }
            __atomic_store_n(&due[i], after, __ATOMIC_RELAXED);
            soonest = after < soonest ? after : soonest;
        }
        pthread_mutex_unlock(&s->mu);
    }
    return soonest;
}

/* A request start found the monitor waiting without a deadline: wake it. The monitor holds
 * monitor_mu from raising monitor_idle until its wait begins, so the signal cannot be lost. */
static void monitor_wake(void)
{
    pthread_mutex_lock(&monitor_mu);
    if (monitor_idle) {
        __atomic_store_n(&monitor_idle, 0, __ATOMIC_RELAXED);
        monitor_woken = 1;
        pthread_cond_signal(&monitor_cv);
    }
    pthread_mutex_unlock(&monitor_mu);
}

/* Wakes only when a threshold can be crossed: at the earliest due time of the requests in
 * flight, and no later than one first threshold from now (a request that starts later cannot
 * cross sooner, but for the CPU resolution), but never more often than OvertakePrioInterval;
 * a busy child with short requests wakes about once per first threshold. With nothing in
 * flight it waits without a deadline until a request starts (monitor_wake): an idle Apache
 * costs no wake-ups. */
static void *monitor_main(void *arg)
{
    int64_t period = (int64_t)(conf_interval(cconf) * 1e9 + 0.5);
    int64_t horizon = hot.thr_ns[0] < 100000000 ? hot.thr_ns[0] : 100000000;  /* <= 0.1 s: exit fast */
    int64_t next = mono_ns() + period;
    int idle = 0;
    (void)arg;
    pthread_setname_np(pthread_self(), "overtake-prio");
    pthread_mutex_lock(&monitor_mu);
    while (!monitor_stop) {
        struct timespec ts;
        int64_t now, late, soonest;
        int rc;
        ts.tv_sec = next / 1000000000;
        ts.tv_nsec = next % 1000000000;
        rc = idle ? pthread_cond_wait(&monitor_cv, &monitor_mu)
                  : pthread_cond_timedwait(&monitor_cv, &monitor_mu, &ts);
        if (monitor_stop) {
            break;
        }
        now = mono_ns();
        if (rc != ETIMEDOUT) {
            if (!monitor_woken) {
                continue;  /* a spurious wake-up: wait again */
            }
            monitor_woken = 0;
            idle = 0;
            ADD(shm->monitor_ticks, 1);
            next = now + horizon;
            soonest = monitor_scan(now);
            next = next < soonest ? next : soonest;
            if (next < now + period) {
                next = now + period;
            }
            continue;
        }
        late = now - next;
        if (late > late_max_ns) {
            late_max_ns = late;
        }
        late_sum_ns += late;
        {
            unsigned b = 0;
            while (b < OP_LATE_BUCKETS && late > (int64_t)(late_le[b] * 1e9)) {
                b++;
            }
            ADD(late_count[b], 1);
        }
        ADD(shm->monitor_ticks, 1);
        soonest = monitor_scan(now);
        if (soonest == INT64_MAX) {
            /* Nothing to watch. Raise the flag, then look once more: a request start publishes
             * its due time before it reads the flag (both sequentially consistent), so either
             * this pass sees it or that start sees the flag and wakes us. */
            __atomic_store_n(&monitor_idle, 1, __ATOMIC_SEQ_CST);
            __atomic_thread_fence(__ATOMIC_SEQ_CST);
            soonest = monitor_scan(mono_ns());
            if (soonest == INT64_MAX) {
                idle = 1;
                continue;
            }
            __atomic_store_n(&monitor_idle, 0, __ATOMIC_RELAXED);
        }
        next = now + horizon < soonest ? now + horizon : soonest;
        if (next < now + period) {
            next = now + period;
        }
    }
    pthread_mutex_unlock(&monitor_mu);
    return NULL;
}

/* ------------------------------------------------------------------------ capabilities */

/* Runs in the child as root, just before mod_unixd switches to the worker user. If
 * RLIMIT_NICE will not let the workers undo a demotion, ask the kernel to keep the permitted
 * capabilities over setuid(); child_init then reduces them to CAP_SYS_NICE alone. */
static int op_drop_privileges(apr_pool_t *pchild, server_rec *s)
{
    const op_conf *c = ap_get_module_config(s->module_config, &overtake_prio_module);
    struct rlimit rl;
    int need;
    (void)pchild;
    if (!conf_enabled(c) || c->cap_sys_nice == OP_CAP_OFF || geteuid() != 0) {
        return DECLINED;
    }
    errno = 0;
    need = 20 - getpriority(PRIO_PROCESS, 0);  /* the workers' own nice value */
    if (c->cap_sys_nice == OP_CAP_AUTO && getrlimit(RLIMIT_NICE, &rl) == 0
        && (rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur >= (rlim_t)need)) {
        return DECLINED;
    }
    if (prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0) == 0) {
        keep_cap_pending = 1;
    }
    return DECLINED;  /* mod_unixd still does the switch */
}

/* After the switch: effective = permitted = {CAP_SYS_NICE}; nothing else survives. */
static int keep_only_cap_sys_nice(void)
{
    struct __user_cap_header_struct hdr;
    struct __user_cap_data_struct data[2];
    memset(&hdr, 0, sizeof hdr);
    memset(data, 0, sizeof data);
    hdr.version = _LINUX_CAPABILITY_VERSION_3;
    hdr.pid = 0;
    data[CAP_TO_INDEX(CAP_SYS_NICE)].effective = CAP_TO_MASK(CAP_SYS_NICE);
    data[CAP_TO_INDEX(CAP_SYS_NICE)].permitted = CAP_TO_MASK(CAP_SYS_NICE);
    prctl(PR_SET_KEEPCAPS, 0, 0, 0, 0);
    return syscall(SYS_capset, &hdr, data) == 0;
}

/* ------------------------------------------------------------------------ child lifecycle */

/* Demote this (throw-away) thread as far as the deepest level and undo it: proves that the
 * worker threads, running as the same user with the same RLIMIT_NICE, can be restored. */
static void *self_test(void *arg)
{
    const char **why = arg;
    pid_t tid = op_gettid();
    int orig_nice, orig_policy, worst = 0, k;
    struct sched_param orig_param, p;
    errno = 0;
    orig_nice = getpriority(PRIO_PROCESS, (id_t)tid);
    orig_policy = sched_getscheduler(tid);
    sched_getparam(tid, &orig_param);
    for (k = 0; k < hot.nlevels; k++) {
        int v = conf_nice(cconf, k);
        if (v != OP_NICE_IDLE && v > worst) {
            worst = v;
        }
    }
    if (worst && setpriority(PRIO_PROCESS, (id_t)tid,
                             orig_nice + worst > 19 ? 19 : orig_nice + worst) != 0) {
        *why = "lowering the priority (setpriority) was refused";
        return NULL;
    }
    memset(&p, 0, sizeof p);
    if (any_idle && sched_setscheduler(tid, SCHED_IDLE, &p) != 0) {
        *why = "sched_setscheduler(SCHED_IDLE) failed";
        return NULL;
    }
    if (any_idle && sched_setscheduler(tid, orig_policy, &orig_param) != 0) {
        *why = "leaving SCHED_IDLE (sched_setscheduler) was refused";
        return NULL;
    }
    if (setpriority(PRIO_PROCESS, (id_t)tid, orig_nice) != 0) {
        *why = "returning to the original nice value (setpriority) was refused";
        return NULL;
    }
    *why = NULL;
    return NULL;
}

static apr_status_t op_child_exit(void *data)
{
    int i, n;
    (void)data;
    if (monitor_running) {
        pthread_mutex_lock(&monitor_mu);
        monitor_stop = 1;
        pthread_cond_signal(&monitor_cv);
        pthread_mutex_unlock(&monitor_mu);
        pthread_join(monitor, NULL);
        monitor_running = 0;
    }
    if (promoter_running) {
        promoter_stop = 1;  /* it wakes within its 50 ms wait */
        pthread_join(promoter, NULL);
        promoter_running = 0;
    }
    n = __atomic_load_n(&slots_used, __ATOMIC_ACQUIRE);
    if (n > nslots) {
        n = nslots;
    }
    for (i = 0; i < n; i++) {
        pthread_mutex_lock(&slots[i].mu);
        if (__atomic_load_n(&slots[i].active, __ATOMIC_ACQUIRE)) {
            slot_close(&slots[i]);
        }
        pthread_mutex_unlock(&slots[i].mu);
    }
    __atomic_store_n(&hot.child_ok, 0, __ATOMIC_RELEASE);
    return APR_SUCCESS;
}

static void op_child_init(apr_pool_t *p, server_rec *s)
{
    const char *why = "self-test did not run";
    pthread_t t;
    struct rlimit rl;
    int threads = 0, k;
    sigset_t all, old;

    cconf = ap_get_module_config(s->module_config, &overtake_prio_module);
    gate.s = s;
    if (!conf_enabled(cconf) || !shm) {
        return;
    }
    hot.nlevels = conf_nlevels(cconf);
    any_idle = 0;
    for (k = 0; k < hot.nlevels; k++) {
        hot.thr_ns[k] = (int64_t)(conf_threshold(cconf, k) * 1e9 + 0.5);
        any_idle |= conf_nice(cconf, k) == OP_NICE_IDLE;
    }
    hot.resolution_ns = (int64_t)(conf_resolution(cconf) * 1e9 + 0.5);
    hot.age = conf_age(cconf);
    hot.hname = conf_header(cconf);
    rlimit_cur = getrlimit(RLIMIT_NICE, &rl) == 0 ? (int)rl.rlim_cur : -1;
    if (keep_cap_pending) {
        /* Before any thread exists: the MPM's threads inherit these credentials. */
        has_cap_sys_nice = keep_only_cap_sys_nice();
        keep_cap_pending = 0;
        if (!has_cap_sys_nice) {
            ap_log_error(APLOG_MARK, APLOG_WARNING, errno, s,
                         APLOGNO(90002) "mod_overtake_prio: cannot reduce the kept capabilities to "
                         "CAP_SYS_NICE");
        }
        else {
            ap_log_error(APLOG_MARK, APLOG_INFO, 0, s,
                         APLOGNO(90003)
                         "mod_overtake_prio: RLIMIT_NICE %d is too low to restore a demoted "
                         "thread; child %ld keeps CAP_SYS_NICE (only) instead", rlimit_cur,
                         (long)getpid());
        }
    }

    if (pthread_create(&t, NULL, self_test, &why) == 0) {
        pthread_join(t, NULL);
    }
    if (why) {
        ap_log_error(APLOG_MARK, APLOG_ERR, 0, s,
                     APLOGNO(90004)
                     "mod_overtake_prio: disabled in child %ld: %s (RLIMIT_NICE %d, user id "
                     "%ld, CAP_SYS_NICE %s); a demoted thread could not get its priority back. "
                     "Start Apache as root (it raises RLIMIT_NICE to OvertakePrioRlimitNice, or "
                     "keeps CAP_SYS_NICE with OvertakePrioCapSysNice auto) or run "
                     "`ulimit -e 20` before starting it",
                     (long)getpid(), why, rlimit_cur, (long)getuid(),
                     has_cap_sys_nice ? "kept" : "not kept");
        return;
    }

    ap_mpm_query(AP_MPMQ_MAX_THREADS, &threads);
    /* Worker threads, plus room for threads that other modules run requests on (mod_http2). */
    nslots = 2 * (threads > 0 ? threads : 64) + 16;
    slots = apr_pcalloc(p, sizeof *slots * (apr_size_t)nslots);
    due = apr_palloc(p, sizeof *due * (apr_size_t)nslots);
    for (k = 0; k < nslots; k++) {
        pthread_mutex_init(&slots[k].mu, NULL);
        due[k] = INT64_MAX;
    }
    apr_pool_cleanup_register(p, NULL, op_child_exit, apr_pool_cleanup_null);
    __atomic_store_n(&hot.child_ok, 1, __ATOMIC_RELEASE);

    if (conf_age(cconf)) {
        pthread_condattr_t ca;
        pthread_condattr_init(&ca);
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        pthread_cond_init(&monitor_cv, &ca);
        pthread_condattr_destroy(&ca);
        /* Signals belong to the MPM's threads, never to the monitor. */
        sigfillset(&all);
        pthread_sigmask(SIG_BLOCK, &all, &old);
        monitor_running = pthread_create(&monitor, NULL, monitor_main, NULL) == 0;
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (!monitor_running) {
            ap_log_error(APLOG_MARK, APLOG_ERR, 0, s,
                         APLOGNO(90005)
                         "mod_overtake_prio: cannot start the monitor thread; requests are "
                         "tracked but never demoted by age");
        }
    }
    if (cconf->gate_file && any_idle) {  /* idle starts need a thread to promote them */
        sigfillset(&all);
        pthread_sigmask(SIG_BLOCK, &all, &old);
        promoter_running = pthread_create(&promoter, NULL, promoter_main, NULL) == 0;
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (!promoter_running) {
            ap_log_error(APLOG_MARK, APLOG_ERR, 0, s, APLOGNO(90006) "mod_overtake_prio: cannot "
                         "start the gate's promoter thread; idle starts wait for their admission "
                         "instead");
        }
    }
}

/* ------------------------------------------------------------------------ server lifecycle */

static int op_check_config(apr_pool_t *pconf, apr_pool_t *plog, apr_pool_t *ptemp,
                           server_rec *s)
{
    op_conf *c = ap_get_module_config(s->module_config, &overtake_prio_module);
    (void)pconf; (void)plog; (void)ptemp;
    if (c->nnice && c->nnice != conf_nlevels(c)) {
        ap_log_error(APLOG_MARK, APLOG_STARTUP | APLOG_EMERG, 0, s,
                     APLOGNO(90007)
                     "OvertakePrioNice: %d values for %d levels (OvertakePrioLevels%s); give "
                     "one nice value or 'idle' per threshold", c->nnice, conf_nlevels(c),
                     c->nlevels ? "" : " default 0.005 0.05");
        return HTTP_INTERNAL_SERVER_ERROR;
    }
    return OK;
}

static int op_post_config(apr_pool_t *pconf, apr_pool_t *plog, apr_pool_t *ptemp,
                          server_rec *s)
{
    op_conf *c = ap_get_module_config(s->module_config, &overtake_prio_module);
    op_retained *ret;
    struct rlimit rl;
    (void)pconf; (void)plog; (void)ptemp;

    ret = ap_retained_data_get(OP_RETAINED_KEY);
    if (!ret) {
        ret = ap_retained_data_create(OP_RETAINED_KEY, sizeof *ret);
        ret->shm = NULL;
    }
    if (!ret->shm) {
        void *m = mmap(NULL, sizeof(op_shared), PROT_READ | PROT_WRITE,
                       MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) {
            ap_log_error(APLOG_MARK, APLOG_ERR, errno, s,
                         APLOGNO(90008)
                         "mod_overtake_prio: cannot map the shared counters; module disabled");
            return OK;
        }
        memset(m, 0, sizeof(op_shared));
        ret->shm = m;
    }
    shm = ret->shm;
    if (c->gate_file) {
        gate_prepare(ptemp, s, c);
    }
    if (!conf_enabled(c)) {
        return OK;
    }
    /* Here the parent still runs as root: raise RLIMIT_NICE so that the workers (www-data,
     * no CAP_SYS_NICE) may lower their nice value back. Inherited by every child. */
    if (getrlimit(RLIMIT_NICE, &rl) == 0 && rl.rlim_cur < (rlim_t)conf_rlimit(c)) {
        rl.rlim_cur = (rlim_t)conf_rlimit(c);
        if (rl.rlim_max != RLIM_INFINITY && rl.rlim_max < rl.rlim_cur) {
            rl.rlim_max = rl.rlim_cur;
        }
        if (setrlimit(RLIMIT_NICE, &rl) != 0) {
            ap_log_error(APLOG_MARK, geteuid() == 0 && c->cap_sys_nice != OP_CAP_OFF
                         ? APLOG_INFO : APLOG_WARNING, errno, s,
                         APLOGNO(90009) "mod_overtake_prio: cannot raise RLIMIT_NICE to %d (no "
                         "CAP_SYS_RESOURCE); %s", conf_rlimit(c),
                         geteuid() == 0 && c->cap_sys_nice != OP_CAP_OFF
                         ? "children keep CAP_SYS_NICE instead (OvertakePrioCapSysNice)"
                         : "children will disable the module unless `ulimit -e 20` was set");
        }
    }
    return OK;
}

/* ------------------------------------------------------------------------ status handler */

static void metric_head(request_rec *r, const char *name, const char *type, const char *help)
{
    ap_rprintf(r, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static int op_status_handler(request_rec *r)
{
    const op_conf *c;
    int k, n;
    if (!r->handler || strcmp(r->handler, OP_HANDLER)) {
        return DECLINED;
    }
    if (r->method_number != M_GET) {
        r->allowed = AP_METHOD_BIT << M_GET;
        return HTTP_METHOD_NOT_ALLOWED;
    }
    c = ap_get_module_config(r->server->module_config, &overtake_prio_module);
    ap_set_content_type(r, "text/plain; version=0.0.4; charset=utf-8");
    apr_table_setn(r->headers_out, "Cache-Control", "no-store");
    if (r->header_only) {
        return OK;
    }
    n = conf_nlevels(c);

    metric_head(r, "overtake_cpu_prio_enabled", "gauge",
                "1 if this child demotes and restores worker threads (self-test passed).");
    ap_rprintf(r, "overtake_cpu_prio_enabled %d\n", __atomic_load_n(&hot.child_ok, __ATOMIC_ACQUIRE));
    metric_head(r, "overtake_cpu_prio_levels", "gauge", "Demoted levels (level 0 = original).");
    ap_rprintf(r, "overtake_cpu_prio_levels %d\n", n);
    metric_head(r, "overtake_cpu_prio_level_threshold_seconds", "gauge",
                "Thread CPU at which a request enters the level.");
    for (k = 1; k <= n; k++) {
        ap_rprintf(r, "overtake_cpu_prio_level_threshold_seconds{level=\"%d\"} %.9g\n", k,
                   conf_threshold(c, k - 1));
    }
    metric_head(r, "overtake_cpu_prio_level_nice_increment", "gauge",
                "Nice increment of the level over the thread's own (not for SCHED_IDLE levels).");
    for (k = 0; k <= n; k++) {
        int v = k ? conf_nice(c, k - 1) : 0;
        if (v != OP_NICE_IDLE) {
            ap_rprintf(r, "overtake_cpu_prio_level_nice_increment{level=\"%d\"} %d\n", k, v);
        }
    }
    metric_head(r, "overtake_cpu_prio_level_sched_idle", "gauge",
                "1 if the level runs its threads under SCHED_IDLE.");
    for (k = 0; k <= n; k++) {
        ap_rprintf(r, "overtake_cpu_prio_level_sched_idle{level=\"%d\"} %d\n", k,
                   k > 0 && conf_nice(c, k - 1) == OP_NICE_IDLE);
    }
    metric_head(r, "overtake_cpu_prio_monitor_interval_seconds", "gauge",
                "Period of the monitor thread.");
    ap_rprintf(r, "overtake_cpu_prio_monitor_interval_seconds %.9g\n", conf_interval(c));
    metric_head(r, "overtake_cpu_prio_cpu_resolution_seconds", "gauge",
                "A worker re-reads its thread CPU clock at most this often; attained CPU is "
                "overcounted by less.");
    ap_rprintf(r, "overtake_cpu_prio_cpu_resolution_seconds %.9g\n", conf_resolution(c));
    metric_head(r, "overtake_cpu_prio_age_enabled", "gauge",
                "1 if requests are demoted by attained thread CPU.");
    ap_rprintf(r, "overtake_cpu_prio_age_enabled %d\n", conf_age(c));
    metric_head(r, "overtake_cpu_prio_rlimit_nice", "gauge",
                "RLIMIT_NICE of this child (20 lets a thread return to nice 0).");
    ap_rprintf(r, "overtake_cpu_prio_rlimit_nice %d\n", rlimit_cur);
    metric_head(r, "overtake_cpu_prio_cap_sys_nice", "gauge",
                "1 if this child kept CAP_SYS_NICE to restore threads (RLIMIT_NICE too low).");
    ap_rprintf(r, "overtake_cpu_prio_cap_sys_nice %d\n", has_cap_sys_nice);
    metric_head(r, "overtake_cpu_prio_child_pid", "gauge",
                "PID of the child that answered (in-flight gauges are per child).");
    ap_rprintf(r, "overtake_cpu_prio_child_pid %ld\n", (long)getpid());

    metric_head(r, "overtake_cpu_prio_in_flight", "gauge",
                "Requests in flight in this child, by current level.");
    for (k = 0; k <= n; k++) {
        ap_rprintf(r, "overtake_cpu_prio_in_flight{level=\"%d\"} %" APR_INT64_T_FMT "\n", k,
                   (apr_int64_t)LOAD(inflight[k]));
    }
    if (!shm) {
        return OK;
    }
    metric_head(r, "overtake_cpu_prio_requests_total", "counter",
                "Requests ended, by the deepest level they reached.");
    for (k = 0; k <= n; k++) {
        ap_rprintf(r, "overtake_cpu_prio_requests_total{level=\"%d\"} %" APR_UINT64_T_FMT "\n",
                   k, LOAD(shm->requests[k]));
    }
    metric_head(r, "overtake_cpu_prio_demotions_total", "counter",
                "Requests that entered the level, by cause (attained CPU or class header).");
    for (k = 1; k <= n; k++) {
        ap_rprintf(r, "overtake_cpu_prio_demotions_total{level=\"%d\",cause=\"age\"} %"
                   APR_UINT64_T_FMT "\n", k, LOAD(shm->demoted_age[k]));
        ap_rprintf(r, "overtake_cpu_prio_demotions_total{level=\"%d\",cause=\"class\"} %"
                   APR_UINT64_T_FMT "\n", k, LOAD(shm->demoted_class[k]));
    }
/* a counter of the shared block: overtake_<prefix><name>_total */
#define COUNTER(prefix, name, field, help)                                              \
    metric_head(r, "overtake_" prefix name "_total", "counter", help);                  \
    ap_rprintf(r, "overtake_" prefix name "_total %" APR_UINT64_T_FMT "\n", LOAD(shm->field))
#define PRIO_COUNTER(name, field, help) COUNTER("cpu_prio_", name, field, help)
#define GATE_COUNTER(name, field, help) COUNTER("gate_", name, field, help)
    PRIO_COUNTER("restores", restores, "Demoted threads given their original priority back.");
    PRIO_COUNTER("restore_errors", restore_errors, "Restores the kernel refused.");
    PRIO_COUNTER("demote_errors", demote_errors, "Demotions the kernel refused.");
    PRIO_COUNTER("untracked", untracked, "Requests on threads beyond the slot table.");
    PRIO_COUNTER("class_invalid", class_invalid, "Class headers that were not a level.");
    PRIO_COUNTER("handoffs", handoffs,
            "Threads that began a request before the previous one's pool was cleaned up.");
    PRIO_COUNTER("monitor_ticks", monitor_ticks, "Monitor passes, all children.");
    PRIO_COUNTER("clock_reads", clock_reads, "Thread CPU clock reads at request start, all children.");
    {
        int mapped = c->gate_file && cconf && gate_map(1);
        og_view *gv = mapped ? __atomic_load_n(&gate.view, __ATOMIC_ACQUIRE) : NULL;
        uint32_t token = 0;
        mapped = gv && gate_load(&gv->head->token, &token);
        metric_head(r, "overtake_gate_configured", "gauge", "1 if OvertakeGate names a gate file.");
        ap_rprintf(r, "overtake_gate_configured %d\n", c->gate_file != NULL);
        metric_head(r, "overtake_gate_key_loaded", "gauge",
                    "1 if Apache read the gate's key file at start (else gated requests pass).");
        ap_rprintf(r, "overtake_gate_key_loaded %d\n", gate_key.loaded);
        metric_head(r, "overtake_gate_mapped", "gauge",
                    "1 if this child has mapped the sidecar's gate file (written with its key).");
        ap_rprintf(r, "overtake_gate_mapped %d\n", mapped);
        metric_head(r, "overtake_gate_token", "gauge",
                    "Pairing token in the mapped gate file (the sidecar checks it is its own).");
        ap_rprintf(r, "overtake_gate_token %u\n", mapped ? token : 0u);
        metric_head(r, "overtake_gate_slots", "gauge", "Slots in the mapped gate file.");
        ap_rprintf(r, "overtake_gate_slots %u\n", mapped ? gv->nslots : 0u);
    }
    GATE_COUNTER("held", gate_held, "Gated requests let through by the sidecar's admission.");
    GATE_COUNTER("cancels", gate_cancels, "Gated requests the sidecar withdrew (answered 503).");
    GATE_COUNTER("stale", gate_stale, "Gated requests whose slot had moved on (answered 503).");
    GATE_COUNTER("timeouts", gate_timeouts, "Gated requests let through after OvertakeGateTimeout.");
    GATE_COUNTER("aborts", gate_aborts, "Gated requests whose connection the sidecar closed.");
    GATE_COUNTER("invalid", gate_invalid, "Gate headers that were not a slot of the file (400).");
    GATE_COUNTER("forged", gate_forged, "Gate headers whose MAC is not the sidecar's key's (403).");
    GATE_COUNTER("unmapped", gate_unmapped, "Gated requests let through for want of a gate file.");
    GATE_COUNTER("faults", gate_faults,
            "Loads that found the gate file shrunk under its mapping (its requests let through).");
    GATE_COUNTER("idle_starts", gate_idle_starts,
            "Gated requests started at the lowest level (SCHED_IDLE) before their admission.");
    GATE_COUNTER("promotions", gate_promotions, "Idle starts given their priority back on admission.");
#undef GATE_COUNTER
#undef PRIO_COUNTER
#undef COUNTER
    metric_head(r, "overtake_gate_wait_seconds_total", "counter",
                "Time gated requests waited for their admission, all children.");
    ap_rprintf(r, "overtake_gate_wait_seconds_total %.9g\n", LOAD(shm->gate_wait_ns) * 1e-9);
    metric_head(r, "overtake_cpu_prio_monitor_late_max_seconds", "gauge",
                "Worst delay of a monitor wake-up in this child.");
    ap_rprintf(r, "overtake_cpu_prio_monitor_late_max_seconds %.9g\n", late_max_ns * 1e-9);
    metric_head(r, "overtake_cpu_prio_monitor_late_seconds", "histogram",
                "Delay of the monitor's wake-ups past their deadline, this child.");
    {
        apr_uint64_t cum = 0;
        unsigned b;
        for (b = 0; b < OP_LATE_BUCKETS; b++) {
            cum += LOAD(late_count[b]);
            ap_rprintf(r, "overtake_cpu_prio_monitor_late_seconds_bucket{le=\"%g\"} %"
                       APR_UINT64_T_FMT "\n", late_le[b], cum);
        }
        cum += LOAD(late_count[OP_LATE_BUCKETS]);
        ap_rprintf(r, "overtake_cpu_prio_monitor_late_seconds_bucket{le=\"+Inf\"} %"
                   APR_UINT64_T_FMT "\n", cum);
        ap_rprintf(r, "overtake_cpu_prio_monitor_late_seconds_sum %.9g\n", late_sum_ns * 1e-9);
        ap_rprintf(r, "overtake_cpu_prio_monitor_late_seconds_count %" APR_UINT64_T_FMT "\n", cum);
    }
    return OK;
}

static void op_register_hooks(apr_pool_t *p)
{
    (void)p;
    ap_hook_check_config(op_check_config, NULL, NULL, APR_HOOK_MIDDLE);
    ap_hook_post_config(op_post_config, NULL, NULL, APR_HOOK_MIDDLE);
    /* First: the capability reduction must precede any thread another module may start. */
    ap_hook_child_init(op_child_init, NULL, NULL, APR_HOOK_REALLY_FIRST);
    ap_hook_drop_privileges(op_drop_privileges, NULL, NULL, APR_HOOK_REALLY_FIRST);
    /* The gate before everything: a held request has not started, for any module. */
    ap_hook_post_read_request(gate_post_read_request, NULL, NULL, APR_HOOK_REALLY_FIRST - 1);
    ap_hook_post_read_request(op_post_read_request, NULL, NULL, APR_HOOK_REALLY_FIRST);
    ap_hook_handler(op_status_handler, NULL, NULL, APR_HOOK_MIDDLE);
    ap_hook_insert_filter(op_insert_filter, NULL, NULL, APR_HOOK_MIDDLE);
    /* After the content filters (deflate, ...), before the protocol filters. */
    op_end_filter_handle = ap_register_output_filter("OVERTAKE_PRIO_END", op_end_filter, NULL,
                                                     AP_FTYPE_CONTENT_SET + 5);
}

AP_DECLARE_MODULE(overtake_prio) = {
    STANDARD20_MODULE_STUFF,
    NULL,                       /* per-directory config */
    NULL,
    op_create_server_conf,
    NULL,                       /* vhosts share the main server's (global) settings */
    op_cmds,
    op_register_hooks,
    AP_MODULE_FLAG_NONE
};
