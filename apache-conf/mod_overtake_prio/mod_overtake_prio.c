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
 *   - a monitor pass, when a threshold can have been crossed (at most every
 *     OvertakePrioInterval seconds; made by the next request start, or by the child's monitor
 *     thread on a timer when none starts), for each request in flight whose attained
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
 *     (BENCHMARKS.md, handover) shrinks to the sidecar's
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
 * This file holds the module record, its hooks and the server and child lifecycle (privileges,
 * the self-test, the threads). The features live next to it, one file each, sharing
 * mod_overtake_prio.h: op_directives.c (the directives), op_prio.c (per-request priority),
 * op_monitor.c (the monitor thread), op_gate.c (the admission gate), op_gate_key.c (its key
 * and file, in the root parent), op_control.c (the control file: the thresholds the sidecar's
 * policy chose), op_stage*.c (stages and the count table that holds their requests: module
 * mode; op_stage.h lists them), op_status.c (the status page), op_times.c (a request's time
 * split into CPU, run-queue wait and blocked time, for the access log), op_pure.c (what needs no Apache:
 * directive values, headers, level arithmetic).
 *
 * Build: make (apxs -c on every file above; Debian: apt-get install apache2-dev)
 * See README.md next to this file for the directives and for use in an existing Apache.
 */

#include "mod_overtake_prio.h"
#include "op_guard.h"
#include "op_times.h"

#include <errno.h>
#include <signal.h>
#include <string.h>
#include <linux/capability.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "http_protocol.h"
#include "http_request.h"
#include "ap_mpm.h"
#include "mpm_common.h"

#define OP_RETAINED_KEY "mod_overtake_prio_retained_v4"  /* v4: gate_forged, gate_faults */

typedef struct {
    op_shared *shm;
} op_retained;

op_shared *op_shm;
const op_conf *op_cconf;
op_hot_state op_hot;
int op_any_idle;
int op_rlimit_cur;
int op_has_cap_sys_nice;
static int keep_cap_pending;    /* drop_privileges asked the kernel to keep capabilities */

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
    for (k = 0; k < op_hot.nlevels; k++) {
        int v = conf_nice(op_cconf, k);
        if (v != OP_NICE_IDLE && v > worst) {
            worst = v;
        }
    }
    if (worst && setpriority(PRIO_PROCESS, (id_t)tid, op_level_nice(orig_nice, worst)) != 0) {
        *why = "lowering the priority (setpriority) was refused";
        return NULL;
    }
    memset(&p, 0, sizeof p);
    if (op_any_idle && sched_setscheduler(tid, SCHED_IDLE, &p) != 0) {
        *why = "sched_setscheduler(SCHED_IDLE) failed";
        return NULL;
    }
    if (op_any_idle && op_set_sched(tid, orig_policy, &orig_param, orig_nice) != 0) {
        *why = "leaving SCHED_IDLE for the original policy and nice value was refused";
        return NULL;
    }
    if (!op_any_idle && setpriority(PRIO_PROCESS, (id_t)tid, orig_nice) != 0) {
        *why = "returning to the original nice value (setpriority) was refused";
        return NULL;
    }
    *why = NULL;
    return NULL;
}

static apr_status_t op_child_exit(void *data)
{
    (void)data;
    op_monitor_stop();
    op_promoter_stop();
    op_slots_close_all();
    __atomic_store_n(&op_hot.child_ok, 0, __ATOMIC_RELEASE);
    return APR_SUCCESS;
}

static void op_child_init(apr_pool_t *p, server_rec *s)
{
    const char *why = "self-test did not run";
    pthread_t t;
    struct rlimit rl;
    int threads = 0, k;

    op_cconf = ap_get_module_config(s->module_config, &overtake_prio_module);
    op_gate_child_init(s);
    op_stage_child_init();
    if (!conf_enabled(op_cconf) || !op_shm) {
        return;
    }
    op_hot.nlevels = conf_nlevels(op_cconf);
    op_any_idle = 0;
    for (k = 0; k < op_hot.nlevels; k++) {
        op_hot.thr_ns[k] = (int64_t)(conf_threshold(op_cconf, k) * 1e9 + 0.5);
        op_any_idle |= conf_nice(op_cconf, k) == OP_NICE_IDLE;
    }
    op_hot.resolution_ns = (int64_t)(conf_resolution(op_cconf) * 1e9 + 0.5);
    op_hot.age = conf_age(op_cconf);
    op_hot.hname = conf_header(op_cconf);
    op_rlimit_cur = getrlimit(RLIMIT_NICE, &rl) == 0 ? (int)rl.rlim_cur : -1;
    if (keep_cap_pending) {
        /* Before any thread exists: the MPM's threads inherit these credentials. */
        op_has_cap_sys_nice = keep_only_cap_sys_nice();
        keep_cap_pending = 0;
        if (!op_has_cap_sys_nice) {
            ap_log_error(APLOG_MARK, APLOG_WARNING, errno, s,
                         APLOGNO(90002) "mod_overtake_prio: cannot reduce the kept capabilities to "
                         "CAP_SYS_NICE");
        }
        else {
            ap_log_error(APLOG_MARK, APLOG_INFO, 0, s,
                         APLOGNO(90003)
                         "mod_overtake_prio: RLIMIT_NICE %d is too low to restore a demoted "
                         "thread; child %ld keeps CAP_SYS_NICE (only) instead", op_rlimit_cur,
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
                     (long)getpid(), why, op_rlimit_cur, (long)getuid(),
                     op_has_cap_sys_nice ? "kept" : "not kept");
        return;
    }

    ap_mpm_query(AP_MPMQ_MAX_THREADS, &threads);
    op_slots_create(p, threads);
    apr_pool_cleanup_register(p, NULL, op_child_exit, apr_pool_cleanup_null);
    __atomic_store_n(&op_hot.child_ok, 1, __ATOMIC_RELEASE);

    if (conf_age(op_cconf) || op_guard_limited()) {
        if (!op_monitor_start(p, threads)) {
            ap_log_error(APLOG_MARK, APLOG_ERR, 0, s,
                         APLOGNO(90005)
                         "mod_overtake_prio: cannot start the monitor thread; requests are "
                         "tracked but never demoted by age");
        }
    }
    if (op_cconf->control_file) {
        op_control_child_init(s);
    }
    if (op_cconf->gate_file && op_any_idle) {  /* idle starts need a thread to promote them */
        if (!op_promoter_start()) {
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
    if (!op_stage_check_config(pconf, s)) {
        return HTTP_INTERNAL_SERVER_ERROR;  /* logged: a repeated OvertakeStagePrefix */
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
    op_shm = ret->shm;
    op_stage_prepare(s);
    if (c->gate_file) {
        op_gate_prepare(ptemp, s, c);
    }
    if (!conf_enabled(c)) {
        return OK;
    }
    if (c->control_file) {
        op_control_prepare(ptemp, s, c);
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

/* ------------------------------------------------------------------------ a request's record */

static OP_HOT apr_status_t request_done(void *data)
{
    op_request_state *st = data;
    if (st->stage >= 0) {
        op_stage_request_end(st);  /* its decision first, as before the thread's own end */
    }
    if (st->slot) {
        op_prio_request_end(st);
    }
    if (st->end_f && st->end_f->ctx == st) {
        st->end_f->ctx = NULL;  /* no EOS came: the filter outlives this record */
    }
    return APR_SUCCESS;
}

/* The record of first request r0 (the caller found none): on its pool, with the one cleanup that
 * ends both parts (the pool outlives every internal redirect of it). */
OP_HOT op_request_state *op_request_state_new(request_rec *r0)
{
    op_request_state *st = apr_palloc(r0->pool, sizeof *st);
    st->slot = NULL;
    st->seq = 0;
    st->demotable = 0;
    st->end_f = NULL;
    st->stage = -1;
    st->dropped = 0;
    st->r = r0;
    ap_set_module_config(r0->request_config, &overtake_prio_module, st);
    apr_pool_cleanup_register(r0->pool, st, request_done, apr_pool_cleanup_null);
    return st;
}

/* ------------------------------------------------------------------------ request hooks */

/* A request's start, one hook for the module's parts (Apache's loop over hook functions costs a
 * tiny request more than most of them do), in their order: the gate first (a request held there
 * has not started, for any module), then the thresholds in force (OvertakeControlFile), the
 * CPU-priority start and the time split's first reading. */
static OP_HOT int op_request_start(request_rec *r)
{
    int rc = op_cconf && op_cconf->gate_file ? op_gate_post_read_request(r) : DECLINED;
    if (rc != DECLINED && rc != OK) {
        return rc;  /* refused at the gate: the request never starts */
    }
    op_control_post_read_request(r);
    op_post_read_request(r);
    op_times_start(r);
    return DECLINED;
}

/* Every request that runs a handler (internal redirects included) gets the end filters. */
static OP_HOT void op_insert_filters(request_rec *r)
{
    op_insert_filter(r);
    op_times_insert_filter(r);
    op_stage_insert_filter(r);
}

/* ------------------------------------------------------------------------ the module */

static void op_register_hooks(apr_pool_t *p)
{
    ap_hook_check_config(op_check_config, NULL, NULL, APR_HOOK_MIDDLE);
    ap_hook_post_config(op_post_config, NULL, NULL, APR_HOOK_MIDDLE);
    /* First: the capability reduction must precede any thread another module may start. */
    ap_hook_child_init(op_child_init, NULL, NULL, APR_HOOK_REALLY_FIRST);
    ap_hook_drop_privileges(op_drop_privileges, NULL, NULL, APR_HOOK_REALLY_FIRST);
    /* Before everything: a request held at the gate has not started, for any module. */
    ap_hook_post_read_request(op_request_start, NULL, NULL, APR_HOOK_REALLY_FIRST - 1);
    ap_hook_handler(op_status_handler, NULL, NULL, APR_HOOK_MIDDLE);
    /* Stages: names reset per config read; a request waits for its turn after every other
     * fixup (access control and rewrites have had their say). */
    ap_hook_pre_config(op_stage_pre_config, NULL, NULL, APR_HOOK_MIDDLE);
    ap_hook_fixups(op_stage_fixups, NULL, NULL, APR_HOOK_REALLY_LAST);
    /* the parent gives back what a child that died was still counted for */
    ap_hook_child_status(op_stage_child_status, NULL, NULL, APR_HOOK_MIDDLE);
    ap_hook_insert_filter(op_insert_filters, NULL, NULL, APR_HOOK_MIDDLE);
    /* A connection filter (one per connection, not per request), before every other: after the
     * content and protocol filters, before TLS (mod_ssl's is AP_FTYPE_CONNECTION + 5) and the
     * network. */
    op_end_filter_handle = ap_register_output_filter("OVERTAKE_PRIO_END", op_end_filter, NULL,
                                                     AP_FTYPE_CONNECTION);
    op_stage_register_filter();  /* an HTTP/2 stream's end (op_stage.c) */
    op_times_register_hooks(p);  /* OvertakeRequestTimes (op_times.c) */
}

AP_DECLARE_MODULE(overtake_prio) = {
    STANDARD20_MODULE_STUFF,
    op_stage_create_dir_conf,   /* per-directory config: OvertakeStage (op_stage_conf.c) */
    op_stage_merge_dir_conf,
    op_create_server_conf,
    NULL,                       /* vhosts share the main server's (global) settings */
    op_cmds,
    op_register_hooks,
    AP_MODULE_FLAG_NONE
};
