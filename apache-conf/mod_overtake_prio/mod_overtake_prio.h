/*
 * mod_overtake_prio.h -- what the files of mod_overtake_prio share (see mod_overtake_prio.c
 * for the module as a whole and README.md for the layout): the configuration, the counters in
 * shared memory, the per-thread slots and the functions each file offers the others.
 *
 * Everything declared after the Apache headers is hidden: Apache loads modules with
 * RTLD_GLOBAL, and only the module record may be visible to it and to other modules.
 */
#ifndef MOD_OVERTAKE_PRIO_H
#define MOD_OVERTAKE_PRIO_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE  /* apxs passes it too */
#endif
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <sys/types.h>
#include <time.h>

#include "ap_mpm.h"
#include "httpd.h"
#include "http_config.h"
#include "http_log.h"
#include "util_filter.h"

#include "op_pure.h"

extern module AP_MODULE_DECLARE_DATA overtake_prio_module;

#pragma GCC visibility push(hidden)

#define OP_UNSET (-1)
/* The functions every request runs, together in .text.hot; what a request rarely needs, apart in
 * .text.unlikely: side by side with another process on the core, a tiny request's code misses
 * (cache lines, TLB pages) on a path spread over the module's pages cost it more than the
 * instructions it runs. */
#define OP_HOT __attribute__((hot))
#define OP_COLD __attribute__((cold, noinline))
#define OP_HANDLER "overtake-prio-status"
#define OG_NOTE "overtake-gate-idle"  /* r->notes: "SLOT GEN" of a request started idle */

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
    struct op_guard_conf *guard;        /* exemptions and demotion limit (op_guard.c) */
    const char *control_file;           /* OvertakeControlFile: the sidecar's thresholds, or NULL */
    struct op_stage_prefixes *stage_prefixes;  /* OvertakeStagePrefix of this server (op_stage_conf.c) */
} op_conf;

enum { OP_CAP_AUTO = 0, OP_CAP_ON = 1, OP_CAP_OFF = 2 };

/* Effective values (the directives are global: only the main server's config is used). */
static inline int conf_enabled(const op_conf *c) { return c->enabled == 1; }
static inline double conf_interval(const op_conf *c) { return c->interval > 0 ? c->interval : 0.001; }
static inline double conf_resolution(const op_conf *c) { return c->resolution >= 0 ? c->resolution : 0.001; }
static inline int conf_age(const op_conf *c) { return c->age != 0; }
static inline int conf_rlimit(const op_conf *c) { return c->rlimit_nice >= 0 ? c->rlimit_nice : 20; }
static inline const char *conf_header(const op_conf *c)
{
    return c->class_header_set ? c->class_header : "X-Overtake-Class";
}

static inline const char *conf_gate_header(const op_conf *c)
{
    return c->gate_header ? c->gate_header : "X-Overtake-Gate";
}
static inline double conf_gate_timeout(const op_conf *c) { return c->gate_timeout > 0 ? c->gate_timeout : 60.0; }

static inline int conf_nlevels(const op_conf *c) { return c->nlevels ? c->nlevels : 2; }
static inline double conf_threshold(const op_conf *c, int k)
{
    static const double defaults[] = {0.005, 0.05};
    return c->nlevels ? c->threshold[k] : defaults[k];
}
/* Default priorities: nice +10 for every level but the last, SCHED_IDLE for the last. */
static inline int conf_nice(const op_conf *c, int k)
{
    if (c->nnice) {
        return c->nice[k];
    }
    return k == conf_nlevels(c) - 1 ? OP_NICE_IDLE : 10;
}

/* op_directives.c */
void *op_create_server_conf(apr_pool_t *p, server_rec *s);
extern const command_rec op_cmds[];
/* a server-wide On|Off held in the int its cmd_data points to (OvertakeRequestTimes, ...) */
const char *op_global_flag(cmd_parms *cmd, void *d, int on);

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
    apr_uint64_t guard_exempt[4];   /* never demoted, by cause (op_guard.c) */
    apr_uint64_t guard_releases;    /* given their priority back by the demotion limit */
} op_shared;

extern op_shared *op_shm;   /* set in post_config (parent), inherited by the children */

#define ADD(field, v) __atomic_fetch_add(&(field), (v), __ATOMIC_RELAXED)
#define LOAD(field) __atomic_load_n(&(field), __ATOMIC_RELAXED)

/* ------------------------------------------------------------------------ per-child state */

/* The fields a request's start and end touch on the owner's lock-free path come first, on one
 * cache line (the slots are aligned to it, op_slots_create): side by side with another process
 * on the core, each line a tiny request touches is likely a miss after that process's turn. */
typedef struct {
    int active;                 /* a request is in flight on this thread (atomic): 1, or 2 while
                                 * claimed (op_slot_claim); 0: idle */
    int level;                  /* level applied to the thread now */
    apr_uint64_t seq;           /* request generation on this slot */
    int64_t cpu0_ns;            /* thread CPU at request start, or less by < resolution */
    int64_t clock_read_ns;      /* owner thread only: when it last read its CPU clock ... */
    int64_t clock_cpu_ns;       /* ... and what it read */
    const uint32_t *gate_word;  /* an idle start's gate word until its admission (under mu) */
    int exempt;                 /* the request is never demoted by age (op_guard.c); written
                                 * before active is set, like seq and cpu0_ns */
    uint32_t gate_gen;
    pthread_mutex_t mu;         /* guards everything but reads of active, and the owner's
                                 * lock-free start and end (op_prio.c) */
    pid_t tid;
    clockid_t clk;              /* the worker thread's CPU clock */
    int orig_policy;
    struct sched_param orig_param;
    int orig_nice;
} __attribute__((aligned(64))) op_slot;

/* What every request start reads, together on one or two cache lines (set in child_init):
 * on a tiny request the module's cost was mostly cache misses on scattered globals. */
typedef struct {
    int child_ok;               /* self-test passed: demotions can be undone */
    int age;                    /* OvertakePrioAge */
    int nlevels;
    const char *hname;          /* class header, NULL = none */
    int64_t resolution_ns;
    int64_t thr_ns[OP_MAX_LEVELS];
    unsigned thr_gen;           /* bumped after thr_ns changes (op_control.c): see op_monitor_rearm */
} __attribute__((aligned(64))) op_hot_state;

/* mod_overtake_prio.c: set in child_init */
extern const op_conf *op_cconf;     /* main server's config, in the child */
extern op_hot_state op_hot;
extern int op_any_idle;             /* some level uses SCHED_IDLE */
extern int op_rlimit_cur;
extern int op_has_cap_sys_nice;     /* this child's threads hold CAP_SYS_NICE */

/* op_prio.c: per-request priority */
extern op_slot *op_slots;
/* op_due[i]: monotonic time before which slot i's request cannot cross its next threshold;
 * INT64_MAX when no request is in flight there (or none can cross). Apart from the slots so
 * that a monitor pass reads a few cache lines, not two per worker thread. */
extern int64_t *op_due;
extern int op_nslots;
extern int op_slots_used;           /* claimed so far (atomic) */
extern ap_filter_rec_t *op_end_filter_handle;
static inline int64_t op_ts_ns(const struct timespec *ts)
{
    return (int64_t)ts->tv_sec * 1000000000 + ts->tv_nsec;
}
pid_t op_gettid(void);
int op_set_sched(pid_t tid, int policy, const struct sched_param *param, int nice);
int64_t op_mono_ns(void);
void op_slots_create(apr_pool_t *p, int threads);
void op_slots_close_all(void);
void op_inflight_count(apr_int64_t counts[OP_MAX_LEVELS + 1]);
int op_slots_in_use(void);
void op_apply_level(op_slot *s, int k, int by_class);
void op_slot_close(op_slot *s);
int op_slot_claim(op_slot *s);
void op_slot_unclaim(op_slot *s);
void op_release(op_slot *s);
void op_promote(op_slot *s);
int op_post_read_request(request_rec *r);
/* The module's record of a request, in the request_config of its first request (an internal
 * redirect's request_rec finds it through r->prev): op_prio.c's priority tracking and op_stage.c's
 * stage count. One record, one allocation and one pool cleanup for both parts, made by whichever
 * part meets the request first (op_request_state_new, mod_overtake_prio.c). */
typedef struct {
    op_slot *slot;              /* priority tracking: the thread's slot, NULL while not tracked */
    apr_uint64_t seq;           /* ... and the slot's request generation that is this request */
    int demotable;              /* it may leave level 0 (age, class, idle start): the end filter */
    ap_filter_t *end_f;         /* the connection's end filter while it ends this request, or NULL */
    int stage;                  /* the stage the request was counted in, -1 while none */
    int dropped;                /* its client went away while it was held: it never ran */
    request_rec *r;             /* the first request (its connection, at its end) */
} op_request_state;
/* The record of r's first request, or NULL: an array load (no hash, no call). */
static inline op_request_state *op_request_state_of(const request_rec *r)
{
    while (r->prev) {
        r = r->prev;
    }
    return ap_get_module_config(r->request_config, &overtake_prio_module);
}
op_request_state *op_request_state_new(request_rec *r0);
/* The parts' ends, in the record's cleanup: the stage's first (op_stage.c), then the priority's. */
void op_prio_request_end(op_request_state *st);
void op_stage_request_end(op_request_state *st);
void op_insert_filter(request_rec *r);
apr_status_t op_end_filter(ap_filter_t *f, apr_bucket_brigade *bb);

/* op_monitor.c: the thread that demotes by attained CPU */
#define OP_LATE_BUCKETS 7u
extern const double op_late_le[OP_LATE_BUCKETS];
extern apr_uint64_t op_late_count[OP_LATE_BUCKETS + 1];  /* last = above every bound */
extern int64_t op_late_max_ns;      /* worst delay of a monitor pass in this child */
extern int64_t op_late_sum_ns;
extern int64_t op_pass_at;          /* when the next monitor pass is due; INT64_MAX: nothing in flight */
int op_monitor_start(apr_pool_t *p, int threads);
void op_monitor_stop(void);
void op_monitor_wake(void);
void op_monitor_pass_due(int64_t now);
void op_monitor_rearm(void);

/* op_gate.c: the admission gate */
typedef struct {
    int key_loaded;             /* the key file was read at start */
    int mapped;                 /* a gate file of this key is mapped */
    uint32_t token;             /* its pairing token, 0 unless mapped */
    uint32_t nslots;            /* its slots, 0 unless mapped */
} op_gate_state;
/* op_gate_key.c: the gate's key, read in the root parent; the children inherit it */
extern int op_gate_key_loaded;   /* else gated requests pass */
void op_gate_prepare(apr_pool_t *p, server_rec *s, const op_conf *c);
void op_gate_mac(const void *msg, size_t n, uint8_t out[32]);
void op_gate_child_init(server_rec *s);
int op_gate_post_read_request(request_rec *r);
int op_gate_idle_word(const char *note, const uint32_t **word, uint32_t *gen);
const uint32_t *op_gate_idle_hold(op_slot *s, const uint32_t *word, uint32_t gen);
void op_gate_fault(const void *addr);
void op_gate_snapshot(const op_conf *c, op_gate_state *st);
int op_promoter_start(void);
void op_promoter_stop(void);

/* op_gate_key.c: also the control file's key and file */
const char *op_key_file_load(apr_pool_t *p, const char *kpath, uint8_t key[32]);
void op_shared_file_prepare(server_rec *s, const char *path, const char *directive);

/* op_control.c: the control file, the thresholds the sidecar's policy chose */
void op_control_prepare(apr_pool_t *p, server_rec *s, const op_conf *c);
void op_control_child_init(server_rec *s);
int op_control_post_read_request(request_rec *r);
void op_control_look(void);
void op_control_refresh(const op_conf *c);
double op_control_threshold(const op_conf *c, int k);
void op_control_status(request_rec *r, const op_conf *c);

/* Stages (module mode) and the count table that holds their requests (op_stage.h has the files):
 * op_stage_conf.c, which request is of which stage and the directives */
void *op_stage_create_dir_conf(apr_pool_t *p, char *dir);
void *op_stage_merge_dir_conf(apr_pool_t *p, void *base, void *add);
const char *op_stage_set(cmd_parms *cmd, void *dconf, const char *name);
const char *op_stage_set_prefix(cmd_parms *cmd, void *dconf, const char *prefix, const char *name,
                                const char *method);
const char *op_stage_set_hold(cmd_parms *cmd, void *dconf, const char *w);
const char *op_stage_set_next(cmd_parms *cmd, void *dconf, const char *from, const char *to);
const char *op_stage_set_follow_up(cmd_parms *cmd, void *dconf, const char *w);
const char *op_stage_set_lifo_after(cmd_parms *cmd, void *dconf, const char *w);
int op_stage_pre_config(apr_pool_t *pconf, apr_pool_t *plog, apr_pool_t *ptemp);
int op_stage_check_config(apr_pool_t *p, server_rec *main_s);
/* op_stage_decide.c: the shared counts and the table in force */
void op_stage_prepare(server_rec *s);
void op_stage_table(const uint8_t *section, size_t n, uint32_t gen);
/* op_stage_child.c: a child's block, and what a dead child's gives back (the parent) */
void op_stage_child_init(void);
void op_stage_child_status(server_rec *s, pid_t pid, ap_generation_t gen, int slot,
                           mpm_child_status state);
/* op_stage.c: a request's arrival, hold and end */
int op_stage_fixups(request_rec *r);
void op_stage_insert_filter(request_rec *r);
void op_stage_register_filter(void);
/* op_stage_status.c */
void op_stage_status(request_rec *r);

/* op_status.c */
int op_status_handler(request_rec *r);

#pragma GCC visibility pop

#endif
