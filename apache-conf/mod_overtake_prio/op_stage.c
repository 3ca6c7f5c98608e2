/*
 * op_stage.c -- stages and their count policy inside Apache (module mode: no proxy in front).
 *
 * `OvertakeStage NAME` in a <Location>, <LocationMatch> or <If> section names the stage of the
 * requests Apache matches there (so methods and query strings select stages through <If>
 * expressions). Per stage, the requests waiting and running are counted in shared memory that
 * every child maps (the parent's anonymous mapping, kept across graceful restarts). The control
 * file's stage section (os_table.h, written by the sidecar from a blind policy) says, for each
 * observation of those counts, how many waiting requests of each stage start.
 *
 * A request of a stage arrives in the fixups hook (after access control: a refused request never
 * waits) and takes a ticket of its stage's queue; the arrival is a decision epoch. A request that
 * may not start waits on its stage's futex word (the head of its queue) in the shared mapping,
 * as a gated request waits on the gate file's. When a running request ends (its pool's cleanup,
 * after the response and the log), the completing worker takes the next decision: it looks the
 * new counts up in the table and moves the queues' heads past the tickets that start, waking them
 * (FUTEX_WAKE_BITSET, one bit per ticket modulo 32, so a wake-up rarely reaches a request that
 * must go on waiting). A request held past `OvertakeStageHold` seconds runs anyway and is counted
 * (no request is lost); with no table in force (no control file, none valid, no stage section,
 * or a stage the table does not name) requests run at once and are still counted.
 *
 * Where the work of a stage runs is counted too: at the log of each request, by the handler that
 * served it (Apache itself, FastCGI as PHP-FPM, another proxy, a CGI process), so the controller
 * can say which CPU lever reaches the stage (the module's age priority only reaches Apache's own
 * threads; behind FastCGI the Apache worker only waits, though it still counts as running: the
 * table is admission against the backend's pool).
 *
 * Tandem routing (van der Weij et al.: a request leaving stage i joins queue i+1 at that instant):
 * with `OvertakeStageNext FIRST SECOND`, a request of FIRST that ends on a keep-alive HTTP/1
 * connection leaves a reservation for the connection's next request in SECOND's queue before the
 * completing worker decides, as the sidecar's limiter does, so the decision sees the request that
 * moves on. The reservation takes a ticket like an arrival (it waits, or is started and holds its
 * slot idle). The connection's next request of SECOND takes the ticket over (it runs at once if
 * the ticket was started, else it waits on it); any other request on the connection, the
 * connection's close, or `OvertakeStageFollowUp` seconds without a request give it up (counted
 * by outcome). Without it the client's round trip lets a newcomer of SECOND take the slot first.
 * Expiry is checked at every decision and status read, and a held request wakes at least once
 * per follow-up timeout while reservations exist, so an expired one never blocks a start for
 * long when nothing else happens.
 *
 * Like the sidecar's limiter, a table that starts nothing while nothing runs would idle the server
 * with requests waiting: then the oldest request of the last stage with waiters starts (a
 * guard start, counted).
 *
 * One lock (a process-shared, robust mutex in the shared mapping) orders every count change and
 * decision; its sections are a few loads and stores. The table a child uses is its own copy,
 * swapped under that lock when op_control.c puts a new generation in force: every decision holds
 * it already, so reading the table takes no second lock.
 */
#include "mod_overtake_prio.h"

#include <errno.h>
#include <limits.h>
#include <strings.h>
#include <linux/futex.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "apr_strings.h"
#include "http_protocol.h"
#include "http_request.h"

#include "os_table.h"

#define OS_MAX_STAGES 16            /* OvertakeStage names per server */
#define OS_RETAINED_KEY "mod_overtake_prio_stages_v2"  /* v2: wakes, sleepers */
#define OS_NONE (-1)                /* OvertakeStage none */
#define OS_UNSET (-2)
#define OS_CONN_KEY "overtake-stage-follow"  /* on the connection's pool: its os_conn */
#define OS_MAX_RES 1024             /* reservations outstanding at once (one per connection) */

/* How a reservation ended (overtake_stage_reservations_ended_total{outcome}). */
enum { OS_RES_CLAIMED, OS_RES_EXPIRED, OS_RES_CLOSED, OS_RES_OTHER, OS_RES_N };
static const char *const os_res_name[OS_RES_N] = {"claimed", "expired", "closed", "other"};

/* Where a request's work ran, by the handler that served it (overtake_stage_served_total). */
enum { OS_BY_APACHE, OS_BY_FCGI, OS_BY_PROXY, OS_BY_CGI, OS_BY_N };
static const char *const os_by_name[OS_BY_N] = {"apache", "fcgi", "proxy", "cgi"};

typedef struct {
    os_queue q;
    uint32_t sleepers;              /* requests between their last look at q.head and their wake-up */
    apr_uint64_t requests;          /* arrivals */
    apr_uint64_t held;              /* requests that waited */
    apr_uint64_t hold_ns;           /* ... and their total wait */
    apr_uint64_t hold_timeouts;     /* waited OvertakeStageHold and ran anyway */
    apr_uint64_t overflows;         /* found the queue's ticket ring full and ran at once */
    apr_uint64_t unheld;            /* ran at once because no table was in force for the stage */
    apr_uint64_t served[OS_BY_N];   /* logged, by where their work ran */
    apr_uint64_t reservations;      /* follow-up reservations made in this stage */
    apr_uint64_t res_full;          /* ... not made: every reservation slot was in use */
    apr_uint64_t res_ended[OS_RES_N];
    int32_t reserved;               /* reservations outstanding (each holds a ticket) */
} os_stage;

/* A connection's reservation: a ticket of its stage's queue, kept for the connection's next
 * request until expires_ns. Slots are reused: gen tells a connection's slot from its reuse. */
typedef struct {
    int32_t stage;                  /* -1: free */
    uint32_t ticket;
    uint32_t gen;
    int64_t expires_ns;
} os_res;

typedef struct {
    pthread_mutex_t mu;
    uint32_t nstages;
    char names[OS_MAX_STAGES][OS_NAME_BYTES];
    apr_uint64_t epochs;            /* decisions taken */
    apr_uint64_t guard_starts;
    apr_uint64_t wakes;             /* futex wake-ups issued (a system call each) */
    os_stage st[OS_MAX_STAGES];
    int32_t next[OS_MAX_STAGES];    /* OvertakeStageNext: the stage a follow-up reserves, or -1 */
    int64_t follow_ns;              /* OvertakeStageFollowUp */
    uint32_t nres;                  /* reservations outstanding, all stages */
    uint32_t res_hi;                /* slots [0, res_hi) may be in use */
    int64_t res_due;                /* no reservation expires before this */
    os_res res[OS_MAX_RES];
} os_shared;

static os_shared *os_shm;
static int os_follow_on;            /* some stage has a next stage (OvertakeStageNext) */

/* The names of the config being read (reset by pre_config: Apache reads its config twice). */
static char os_names[OS_MAX_STAGES][OS_NAME_BYTES];
static int os_nnames;
static double os_hold_s = 30.0;     /* OvertakeStageHold */
static int os_next[OS_MAX_STAGES];  /* OvertakeStageNext of the config being read (-1: none) */
static double os_follow_s = 0.005;  /* OvertakeStageFollowUp: about a loopback client's round trip */

/* This child's table: a copy of the control file's stage section, and where its stages are.
 * Written only by op_stage_table (op_control.c calls it under its own mutex: one writer at a time)
 * while it holds os_shm->mu; read under os_shm->mu. */
static struct {
    uint8_t *bytes;                 /* owns the section's bytes (t.act points into them) */
    size_t len;
    os_table t;
    int shm_of[OS_MAX_TSTAGES];     /* table stage -> shared stage, or -1 (not configured) */
    int in_table[OS_MAX_STAGES];    /* shared stage -> table stage, or -1 (run at once) */
    uint32_t generation;            /* 0: no table */
} tab = {NULL, 0, {0}, {0}, {0}, 0};

typedef struct {
    int stage;                      /* shared stage index, OS_NONE or OS_UNSET */
} os_dir_conf;

typedef struct {
    int stage;                      /* the stage the request was counted in */
    request_rec *r;                 /* the first request (its connection, at its end) */
} os_req;

/* A connection's hold on a reservation slot (on its pool; slot -1: none). */
typedef struct {
    int slot;
    uint32_t gen;
} os_conn;

/* ------------------------------------------------------------------------ directives */

void *op_stage_create_dir_conf(apr_pool_t *p, char *dir)
{
    os_dir_conf *d = apr_palloc(p, sizeof *d);
    (void)dir;
    d->stage = OS_UNSET;
    return d;
}

/* Per request whose URL matches a section: the configs are never written after the config read,
 * so the one that decides is returned as it is (no allocation). */
void *op_stage_merge_dir_conf(apr_pool_t *p, void *base, void *add)
{
    (void)p;
    return ((const os_dir_conf *)add)->stage != OS_UNSET ? add : base;
}

/* The index of stage name (added if new), or -1 with *err set. */
static int stage_index(cmd_parms *cmd, const char *name, const char **err)
{
    uint8_t padded[OS_NAME_BYTES];
    int i;
    memset(padded, 0, sizeof padded);
    if (strlen(name) >= OS_NAME_BYTES || (memcpy(padded, name, strlen(name)), !os_name_ok(padded))) {
        *err = apr_psprintf(cmd->pool, "%s: '%s' is not a stage name: 1..%d letters, digits, '_', "
                            "'.', '-' (the name of the sidecar's stages file)",
                            cmd->cmd->name, name, OS_NAME_BYTES - 1);
        return -1;
    }
    for (i = 0; i < os_nnames && strcmp(os_names[i], name); i++) {
    }
    if (i == os_nnames) {
        if (os_nnames == OS_MAX_STAGES) {
            *err = apr_psprintf(cmd->pool, "%s: '%s' would be stage %d; at most %d stages",
                                cmd->cmd->name, name, OS_MAX_STAGES + 1, OS_MAX_STAGES);
            return -1;
        }
        memcpy(os_names[os_nnames], padded, OS_NAME_BYTES);
        os_next[os_nnames++] = -1;
    }
    return i;
}

const char *op_stage_set(cmd_parms *cmd, void *dconf, const char *name)
{
    os_dir_conf *d = dconf;
    const char *err = NULL;
    int i;
    if (!strcasecmp(name, "none")) {
        d->stage = OS_NONE;
        return NULL;
    }
    if ((i = stage_index(cmd, name, &err)) < 0) {
        return err;
    }
    d->stage = i;
    return NULL;
}

const char *op_stage_set_next(cmd_parms *cmd, void *dconf, const char *from, const char *to)
{
    const char *err = ap_check_cmd_context(cmd, GLOBAL_ONLY);
    int a, b;
    (void)dconf;
    if (err) {
        return err;
    }
    if ((a = stage_index(cmd, from, &err)) < 0 || (b = stage_index(cmd, to, &err)) < 0) {
        return err;
    }
    if (a == b) {
        return apr_psprintf(cmd->pool, "OvertakeStageNext: '%s' cannot follow itself; name the "
                            "stage its requests' follow-ups belong to", from);
    }
    if (os_next[a] >= 0 && os_next[a] != b) {
        return apr_psprintf(cmd->pool, "OvertakeStageNext: '%s' already has next stage '%s'; a "
                            "stage has at most one", from, os_names[os_next[a]]);
    }
    os_next[a] = b;
    return NULL;
}

const char *op_stage_set_follow_up(cmd_parms *cmd, void *dconf, const char *w)
{
    const char *err = ap_check_cmd_context(cmd, GLOBAL_ONLY);
    double v;
    (void)dconf;
    if (err) {
        return err;
    }
    if (!op_parse_seconds(w, 0.0001, 60, &v)) {
        return apr_psprintf(cmd->pool, "OvertakeStageFollowUp: '%s' must be seconds in [0.0001, 60], "
                            "the longest a reservation waits for the connection's next request", w);
    }
    os_follow_s = v;
    return NULL;
}

const char *op_stage_set_hold(cmd_parms *cmd, void *dconf, const char *w)
{
    const char *err = ap_check_cmd_context(cmd, GLOBAL_ONLY);
    double v;
    (void)dconf;
    if (err) {
        return err;
    }
    if (!op_parse_seconds(w, 0.001, 3600, &v)) {
        return apr_psprintf(cmd->pool, "OvertakeStageHold: '%s' must be seconds in [0.001, 3600], "
                            "the longest a request waits for its stage's turn", w);
    }
    os_hold_s = v;
    return NULL;
}

/* ------------------------------------------------------------------------ the lock, the futex */

static void os_lock(void)
{
    if (pthread_mutex_lock(&os_shm->mu) == EOWNERDEAD) {
        /* a child died inside a section: every section leaves the counts whole at each store */
        pthread_mutex_consistent(&os_shm->mu);
    }
}

static void os_unlock(void)
{
    pthread_mutex_unlock(&os_shm->mu);
}

/* Wake the granted tickets' waiters. Most grants go to the request that is deciding at its own
 * arrival, which sleeps on nothing: a FUTEX_WAKE (a system call on a shared word) is made only
 * when some request may sleep. The head's store (grant) and this load are sequentially
 * consistent, as are a waiter's count and its load of the head (hold): either the waiter sees
 * its grant, or this sees the waiter; FUTEX_WAIT checks the head again in the kernel. */
static void os_wake(os_stage *s, uint32_t bits)
{
    if (bits && __atomic_load_n(&s->sleepers, __ATOMIC_SEQ_CST)) {
        /* shared (not FUTEX_PRIVATE): waiters of every child share the mapping */
        syscall(SYS_futex, &s->q.head, FUTEX_WAKE_BITSET, INT_MAX, NULL, NULL, bits);
        ADD(os_shm->wakes, 1);
    }
}

/* ------------------------------------------------------------------------ decisions */

/* Grant n starts in shared stage i (lock held) and wake them. */
static int32_t grant(int i, int32_t n)
{
    uint32_t bits = 0;
    int32_t done = os_grant(&os_shm->st[i].q, n, &bits);
    __atomic_store_n(&os_shm->st[i].q.head, os_shm->st[i].q.head, __ATOMIC_SEQ_CST);
    os_wake(&os_shm->st[i], bits);
    return done;
}

/* ------------------------------------------------------------------------ reservations */

/* Free reservation slot i (lock held), ended by outcome; its ticket stays where it is. */
static void res_free(uint32_t i, int outcome)
{
    os_res *v = &os_shm->res[i];
    os_shm->st[v->stage].reserved--;
    ADD(os_shm->st[v->stage].res_ended[outcome], 1);
    v->stage = -1;
    v->gen++;  /* the connection that held it no longer finds it */
    os_shm->nres--;
    while (os_shm->res_hi && os_shm->res[os_shm->res_hi - 1].stage < 0) {
        os_shm->res_hi--;
    }
}

/* Give reservation slot i up (lock held): a started ticket frees its slot, a waiting one is
 * skipped by the grants. The caller decides next. */
static void res_end(uint32_t i, int outcome)
{
    os_queue *q = &os_shm->st[os_shm->res[i].stage].q;
    uint32_t t = os_shm->res[i].ticket;
    if (os_granted(q->head, t)) {
        os_complete(q);
    }
    else {
        q->gone[t % OS_RING] = 1;
        q->waiting--;
    }
    res_free(i, outcome);
}

/* Give up the reservations whose follow-up did not come in time (lock held); how many. */
static int res_expire(int64_t now)
{
    int64_t due = INT64_MAX;
    uint32_t i;
    int n = 0;
    if (!os_shm->nres || now < os_shm->res_due) {
        return 0;
    }
    for (i = 0; i < os_shm->res_hi; i++) {
        const os_res *v = &os_shm->res[i];
        if (v->stage < 0) {
            continue;
        }
        if (v->expires_ns <= now) {
            res_end(i, OS_RES_EXPIRED);
            n++;
        }
        else if (v->expires_ns < due) {
            due = v->expires_ns;
        }
    }
    os_shm->res_due = due;
    return n;
}

/* The reservation the connection still holds (lock held), taken from it: its slot, or -1. */
static int res_take(os_conn *oc)
{
    int i;
    if (!oc || oc->slot < 0) {
        return -1;
    }
    i = oc->slot;
    oc->slot = -1;
    return os_shm->res[i].stage >= 0 && os_shm->res[i].gen == oc->gen ? i : -1;
}

/* Reserve a ticket of stage for the connection's next request (lock held, before the decision):
 * 0 if every slot or the stage's ticket ring is in use (no reservation: the follow-up arrives as
 * a newcomer). */
static int res_make(os_conn *oc, int stage, int64_t now)
{
    os_stage *s = &os_shm->st[stage];
    os_res *v;
    uint32_t i, t;
    for (i = 0; i < os_shm->res_hi && os_shm->res[i].stage >= 0; i++) {
    }
    if (i == OS_MAX_RES || !os_enqueue(&s->q, &t)) {
        ADD(s->res_full, 1);
        return 0;
    }
    v = &os_shm->res[i];
    v->stage = stage;
    v->ticket = t;
    v->expires_ns = now + os_shm->follow_ns;
    if (i == os_shm->res_hi) {
        os_shm->res_hi++;
    }
    os_shm->res_due = os_shm->nres++ && os_shm->res_due < v->expires_ns ? os_shm->res_due : v->expires_ns;
    s->reserved++;
    ADD(s->reservations, 1);
    oc->slot = (int)i;
    oc->gen = v->gen;
    return 1;
}

/* A decision epoch (lock held): what the table says for the counts now. */
static void epoch(void)
{
    uint32_t n = os_shm->nstages, i;
    int32_t running = 0, w[OS_MAX_TSTAGES], k[OS_MAX_TSTAGES];
    uint8_t a[OS_MAX_TSTAGES];
    int started = 0;
    ADD(os_shm->epochs, 1);
    if (os_shm->nres) {
        res_expire(op_mono_ns());  /* an expired reservation's slot is free for this decision */
    }
    for (i = 0; i < n; i++) {
        if (!tab.generation || tab.in_table[i] < 0) {
            grant((int)i, INT32_MAX);  /* no table for this stage: nothing waits */
        }
    }
    if (tab.generation) {
        for (i = 0; i < tab.t.n; i++) {
            int s = tab.shm_of[i];
            w[i] = s < 0 ? 0 : os_shm->st[s].q.waiting;
            k[i] = s < 0 ? 0 : os_shm->st[s].q.active;
        }
        os_lookup(&tab.t, w, k, a);
        for (i = 0; i < tab.t.n; i++) {
            if (a[i] && tab.shm_of[i] >= 0) {
                started += grant(tab.shm_of[i], a[i]);
            }
        }
    }
    for (i = 0; i < n; i++) {
        running += os_shm->st[i].q.active;
    }
    if (!started && !running) {
        for (i = n; i-- > 0;) {
            if (os_shm->st[i].q.waiting > 0 && grant((int)i, 1)) {
                ADD(os_shm->guard_starts, 1);
                break;
            }
        }
    }
}

/* The control file's stage section of generation gen is in force in this child (NULL: none). */
void op_stage_table(const uint8_t *section, size_t n, uint32_t gen)
{
    uint8_t *copy = NULL, *old;
    os_table t;
    uint32_t i, j;
    if (!os_shm) {
        return;
    }
    /* the one writer reads what it wrote without the lock */
    j = gen && gen == tab.generation && section && tab.bytes && n == tab.len
        && !memcmp(tab.bytes, section, n);
    if (j || (!section && !tab.generation && !gen)) {
        return;  /* the table in force (a look at an unchanged file) */
    }
    if (section && (!(copy = malloc(n ? n : 1)) || (memcpy(copy, section, n),
                                                     os_check(copy, n, &t) != OS_OK))) {
        free(copy);
        copy = NULL;  /* checked by oc_check already: only an allocation fails here */
    }
    os_lock();
    old = tab.bytes;
    tab.bytes = copy;
    tab.len = copy ? n : 0;
    tab.generation = copy ? gen : 0;
    if (copy) {
        tab.t = t;
        for (i = 0; i < OS_MAX_STAGES; i++) {
            tab.in_table[i] = -1;
        }
        for (j = 0; j < t.n; j++) {
            tab.shm_of[j] = -1;
            for (i = 0; i < os_shm->nstages; i++) {
                if (!strncmp(os_shm->names[i], t.name[j], OS_NAME_BYTES)) {
                    tab.shm_of[j] = (int)i;
                    tab.in_table[i] = (int)j;
                }
            }
        }
    }
    epoch();  /* requests held under the old table get the new one's answer now */
    os_unlock();
    free(old);
}

/* ------------------------------------------------------------------------ requests */

/* The connection closed: its reservation, if any, is given up. */
static apr_status_t conn_closed(void *data)
{
    os_conn *oc = data;
    int i;
    if (oc->slot < 0) {
        return APR_SUCCESS;
    }
    os_lock();
    if ((i = res_take(oc)) >= 0) {
        res_end((uint32_t)i, OS_RES_CLOSED);
        epoch();
    }
    os_unlock();
    return APR_SUCCESS;
}

/* The connection's reservation state (created with the cleanup that gives it up on close). */
static os_conn *conn_state(conn_rec *c, int create)
{
    void *oc = NULL;
    if (apr_pool_userdata_get(&oc, OS_CONN_KEY, c->pool) == APR_SUCCESS && oc) {
        return oc;
    }
    if (!create) {
        return NULL;
    }
    oc = apr_palloc(c->pool, sizeof(os_conn));
    ((os_conn *)oc)->slot = -1;
    apr_pool_userdata_setn(oc, OS_CONN_KEY, NULL, c->pool);
    apr_pool_cleanup_register(c->pool, oc, conn_closed, apr_pool_cleanup_null);
    return oc;
}

static apr_status_t complete(void *data)
{
    const os_req *q = data;
    conn_rec *c = q->r->connection;
    int nx = os_shm->next[q->stage], i, full = 0;
    /* a follow-up can come only on an HTTP/1 connection kept alive (an HTTP/2 stream's
     * connection ends with its stream) */
    os_conn *oc = nx >= 0 && q->r->proto_num < HTTP_VERSION(2, 0) && c->keepalive == AP_CONN_KEEPALIVE
                  && !c->aborted ? conn_state(c, 1) : NULL;
    op_control_look();  /* decide by the newest table, not the one of this request's start */
    os_lock();
    os_complete(&os_shm->st[q->stage].q);
    if (oc) {
        if ((i = res_take(oc)) >= 0) {
            res_end((uint32_t)i, OS_RES_OTHER);  /* a pipelined request's, never claimed */
        }
        full = !res_make(oc, nx, op_mono_ns()) && LOAD(os_shm->st[nx].res_full) == 1;
    }
    epoch();  /* the completing worker decides what starts next */
    os_unlock();
    if (full) {  /* once per stage: the counter tells the rest */
        ap_log_cerror(APLOG_MARK, APLOG_WARNING, 0, c, APLOGNO(90303) "mod_overtake_prio: no "
                      "follow-up reservation of stage %s could be made (all %d slots or its "
                      "queue's tickets in use); its follow-ups arrive as newcomers meanwhile",
                      os_shm->names[nx], OS_MAX_RES);
    }
    return APR_SUCCESS;
}

/* Wait for ticket t of stage s until deadline: 1 when granted, 0 when the hold bound passed (it
 * runs anyway). The caller counts it among the stage's sleepers. */
static int hold_counted(os_stage *s, uint32_t t, int64_t deadline)
{
    for (;;) {
        uint32_t h = __atomic_load_n(&s->q.head, __ATOMIC_SEQ_CST);
        struct timespec ts;
        int given;
        int64_t now = op_mono_ns(), wake = deadline;
        if (os_granted(h, t)) {
            return 1;
        }
        if (now >= deadline) {
            os_lock();
            given = os_give_up(&s->q, t);
            os_unlock();
            return given;
        }
        if (os_follow_on) {
            /* a reservation expires without a decision: some held request must see it */
            if (LOAD(os_shm->nres) && now >= LOAD(os_shm->res_due)) {
                os_lock();
                if (res_expire(now)) {
                    epoch();
                }
                os_unlock();
                continue;
            }
            if (now + os_shm->follow_ns < wake) {
                wake = now + os_shm->follow_ns;
            }
        }
        ts.tv_sec = (time_t)(wake / 1000000000);
        ts.tv_nsec = (long)(wake % 1000000000);
        /* absolute CLOCK_MONOTONIC deadline; wakes for this ticket's bit or a spurious one */
        syscall(SYS_futex, &s->q.head, FUTEX_WAIT_BITSET, h, &ts, NULL, 1u << (t & 31));
    }
}

/* Wait for ticket t of stage s: 1 when granted, 0 when the hold bound passed (it runs anyway). */
static int hold(os_stage *s, uint32_t t)
{
    int64_t deadline = op_mono_ns() + (int64_t)(os_hold_s * 1e9);
    int given;
    __atomic_fetch_add(&s->sleepers, 1, __ATOMIC_SEQ_CST);  /* before the head is loaded: os_wake */
    given = hold_counted(s, t, deadline);
    __atomic_fetch_sub(&s->sleepers, 1, __ATOMIC_SEQ_CST);
    return given;
}

/* The stage's name for the handler: CGI and FastCGI get it as OVERTAKE_STAGE (mod_proxy_fcgi
 * passes the request's environment as parameters), so the overtake_prio PHP extension counts
 * PHP-FPM's demotions by stage. A client cannot set it: its headers arrive as HTTP_*. */
static void stage_env(request_rec *r, int stage)
{
    apr_table_setn(r->subprocess_env, "OVERTAKE_STAGE", os_shm->names[stage]);
}

int op_stage_fixups(request_rec *r)
{
    const os_dir_conf *d;
    request_rec *r0 = r;
    os_req *q;
    os_stage *s;
    os_conn *oc;
    uint32_t ticket;
    int queued, granted, stage, res;
    int64_t t0;
    op_request_state *st;
    if (!os_shm || r->main) {
        return DECLINED;  /* subrequests belong to their main request */
    }
    while (r0->prev) {
        r0 = r0->prev;  /* an internal redirect is counted once, in the stage first matched */
    }
    st = op_request_state_of(r0, 0);
    if (st && st->stage) {
        stage_env(r, ((const os_req *)st->stage)->stage);  /* a redirect's env has it as REDIRECT_... */
        return DECLINED;
    }
    d = ap_get_module_config(r->per_dir_config, &overtake_prio_module);
    stage = d && d->stage >= 0 && (uint32_t)d->stage < os_shm->nstages ? d->stage : -1;
    oc = os_follow_on ? conn_state(r->connection, 0) : NULL;
    if (stage < 0) {
        if (oc && oc->slot >= 0) {
            os_lock();
            if ((res = res_take(oc)) >= 0) {
                res_end((uint32_t)res, OS_RES_OTHER);  /* not the follow-up it was kept for */
                epoch();
            }
            os_unlock();
        }
        return DECLINED;
    }
    q = apr_palloc(r0->pool, sizeof *q);
    q->stage = stage;
    q->r = r0;
    stage_env(r, q->stage);
    (st ? st : op_request_state_of(r0, 1))->stage = q;
    s = &os_shm->st[q->stage];
    ADD(s->requests, 1);
    os_lock();
    res = res_take(oc);
    if (res >= 0 && (os_shm->res[res].stage != stage || os_shm->res[res].expires_ns <= op_mono_ns())) {
        res_end((uint32_t)res, os_shm->res[res].stage != stage ? OS_RES_OTHER : OS_RES_EXPIRED);
        epoch();
        res = -1;
    }
    if (res >= 0) {
        /* the follow-up takes its reservation's ticket over: started already, or waiting in
         * the place the reservation took */
        ticket = os_shm->res[res].ticket;
        res_free((uint32_t)res, OS_RES_CLAIMED);
        queued = 1;
    }
    else if (!(queued = os_enqueue(&s->q, &ticket))) {
        s->q.active++;
        ADD(s->overflows, 1);
    }
    else {
        epoch();
    }
    granted = !queued || os_granted(s->q.head, ticket);
    os_unlock();
    apr_pool_cleanup_register(r0->pool, q, complete, apr_pool_cleanup_null);
    if (granted) {
        return DECLINED;
    }
    t0 = op_mono_ns();
    ADD(s->held, 1);
    if (!hold(s, ticket)) {
        ADD(s->hold_timeouts, 1);
        ap_log_rerror(APLOG_MARK, APLOG_WARNING, 0, r, APLOGNO(90301) "mod_overtake_prio: a "
                      "request of stage %s waited OvertakeStageHold %g s for its turn; it runs "
                      "anyway", os_shm->names[q->stage], os_hold_s);
    }
    ADD(s->hold_ns, (apr_uint64_t)(op_mono_ns() - t0));
    return DECLINED;
}

/* Where the final request's work ran, from its handler (and for a proxy, its target's scheme). */
static int served_by(const request_rec *r)
{
    const char *h = r->handler;
    if (h && (!strcmp(h, "proxy-server") || !strncasecmp(h, "proxy:", 6))) {
        /* ProxyPass: handler proxy-server, filename proxy:fcgi://...; SetHandler "proxy:fcgi://..."
         * or "proxy:unix:/sock|fcgi://..." */
        return (strstr(h, "fcgi://") || (r->filename && strstr(r->filename, "fcgi://"))) ? OS_BY_FCGI
               : OS_BY_PROXY;
    }
    if (h && (!strcmp(h, "cgi-script") || !strcmp(h, "application/x-httpd-cgi"))) {
        return OS_BY_CGI;
    }
    return OS_BY_APACHE;
}

/* Log hook: count where a counted request's work ran. */
int op_stage_log(request_rec *r)
{
    const request_rec *last = r;
    const op_request_state *st;
    if (!os_shm || r->main || !(st = op_request_state_of(r, 0)) || !st->stage) {
        return DECLINED;
    }
    while (last->next) {
        last = last->next;  /* an internal redirect: the request that ran the handler */
    }
    ADD(os_shm->st[((const os_req *)st->stage)->stage].served[served_by(last)], 1);
    return DECLINED;
}

/* ------------------------------------------------------------------------ lifecycle, status */

int op_stage_pre_config(apr_pool_t *pconf, apr_pool_t *plog, apr_pool_t *ptemp)
{
    (void)pconf; (void)plog; (void)ptemp;
    os_nnames = 0;
    os_hold_s = 30.0;
    os_follow_s = 0.005;
    return OK;
}

/* Root parent (post_config): the shared counts, created once and kept across restarts. */
void op_stage_prepare(server_rec *s)
{
    os_shared **ret = ap_retained_data_get(OS_RETAINED_KEY);
    pthread_mutexattr_t ma;
    int i;
    if (!os_nnames) {
        os_shm = NULL;
        return;
    }
    if (!ret) {
        ret = ap_retained_data_create(OS_RETAINED_KEY, sizeof *ret);
        *ret = NULL;
    }
    if (!*ret) {
        void *m = mmap(NULL, sizeof(os_shared), PROT_READ | PROT_WRITE,
                       MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) {
            ap_log_error(APLOG_MARK, APLOG_ERR, errno, s, APLOGNO(90302) "mod_overtake_prio: "
                         "cannot map the stage counts; OvertakeStage requests are not held");
            return;
        }
        memset(m, 0, sizeof(os_shared));
        for (i = 0; i < OS_MAX_RES; i++) {
            ((os_shared *)m)->res[i].stage = -1;
        }
        pthread_mutexattr_init(&ma);
        pthread_mutexattr_setpshared(&ma, PTHREAD_PROCESS_SHARED);
        pthread_mutexattr_setrobust(&ma, PTHREAD_MUTEX_ROBUST);
        pthread_mutex_init(&((os_shared *)m)->mu, &ma);
        pthread_mutexattr_destroy(&ma);
        *ret = m;
    }
    os_shm = *ret;
    os_lock();
    /* a restart may rename or reorder the stages: the counts follow the names' positions */
    for (i = 0; i < os_nnames; i++) {
        if (strncmp(os_shm->names[i], os_names[i], OS_NAME_BYTES)) {
            uint32_t j;
            for (j = 0; j < os_shm->res_hi; j++) {
                if (os_shm->res[j].stage == i) {
                    res_free(j, OS_RES_CLOSED);  /* its ticket went with the queue */
                }
            }
            memset(&os_shm->st[i].q, 0, sizeof os_shm->st[i].q);
            os_shm->st[i].reserved = 0;
            memcpy(os_shm->names[i], os_names[i], OS_NAME_BYTES);
        }
    }
    os_shm->nstages = (uint32_t)os_nnames;
    os_follow_on = 0;
    for (i = 0; i < OS_MAX_STAGES; i++) {
        os_shm->next[i] = i < os_nnames ? os_next[i] : -1;
        os_follow_on |= os_shm->next[i] >= 0;
    }
    os_shm->follow_ns = (int64_t)(os_follow_s * 1e9);
    os_unlock();
}

static void metric(request_rec *r, const char *name, const char *type, const char *help)
{
    ap_rprintf(r, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

#define STAGE_COUNTER(name, field, help) do {                                             \
        metric(r, name, "counter", help);                                                 \
        for (i = 0; i < n; i++) {                                                         \
            ap_rprintf(r, name "{stage=\"%s\"} %" APR_UINT64_T_FMT "\n", os_shm->names[i],   \
                       LOAD(os_shm->st[i].field));                                        \
        }                                                                                 \
    } while (0)

void op_stage_status(request_rec *r)
{
    uint32_t n, i;
    int32_t waiting[OS_MAX_STAGES], active[OS_MAX_STAGES], rwait[OS_MAX_STAGES] = {0},
            rrun[OS_MAX_STAGES] = {0}, held[OS_MAX_STAGES];
    uint32_t gen;
    os_table t;
    if (!os_shm) {
        return;
    }
    os_lock();
    if (res_expire(op_mono_ns())) {
        epoch();  /* a freed slot may start a waiting request */
    }
    n = os_shm->nstages;
    for (i = 0; i < os_shm->res_hi; i++) {
        const os_res *v = &os_shm->res[i];
        if (v->stage >= 0) {
            (os_granted(os_shm->st[v->stage].q.head, v->ticket) ? rrun : rwait)[v->stage]++;
        }
    }
    for (i = 0; i < n; i++) {
        waiting[i] = os_shm->st[i].q.waiting - rwait[i];  /* requests only: reservations apart */
        active[i] = os_shm->st[i].q.active - rrun[i];
        held[i] = tab.generation && tab.in_table[i] >= 0;
    }
    gen = tab.generation;  /* the table in force, copied: nothing is written under the lock */
    t = tab.t;
    os_unlock();
    /* the stage links as Apache read them, for the controller to compare with its stages file */
    metric(r, "overtake_stage_next", "gauge",
           "1 per OvertakeStage, labelled with the stage its OvertakeStageNext names (next=\"\": none).");
    for (i = 0; i < n; i++) {
        int32_t nx = os_shm->next[i];
        ap_rprintf(r, "overtake_stage_next{stage=\"%s\",next=\"%s\"} 1\n", os_shm->names[i],
                   nx >= 0 && (uint32_t)nx < n ? os_shm->names[nx] : "");
    }
    metric(r, "overtake_stage_waiting", "gauge", "Requests of the stage waiting for their turn.");
    for (i = 0; i < n; i++) {
        ap_rprintf(r, "overtake_stage_waiting{stage=\"%s\"} %d\n", os_shm->names[i], waiting[i]);
    }
    metric(r, "overtake_stage_active", "gauge", "Requests of the stage running (started, not ended).");
    for (i = 0; i < n; i++) {
        ap_rprintf(r, "overtake_stage_active{stage=\"%s\"} %d\n", os_shm->names[i], active[i]);
    }
    metric(r, "overtake_stage_reserved", "gauge", "Follow-up reservations of the stage outstanding "
           "(state=waiting: in its queue; started: holding a slot idle for the connection's next "
           "request). The count table sees waiting + active + reserved.");
    for (i = 0; i < n; i++) {
        ap_rprintf(r, "overtake_stage_reserved{stage=\"%s\",state=\"waiting\"} %d\n"
                   "overtake_stage_reserved{stage=\"%s\",state=\"started\"} %d\n",
                   os_shm->names[i], rwait[i], os_shm->names[i], rrun[i]);
    }
    STAGE_COUNTER("overtake_stage_reservations_total", reservations,
                  "Follow-up reservations made in the stage (OvertakeStageNext).");
    STAGE_COUNTER("overtake_stage_reservations_refused_total", res_full,
                  "Follow-ups of the stage not reserved: every reservation slot or queue ticket was in use.");
    metric(r, "overtake_stage_reservations_ended_total", "counter",
           "Follow-up reservations ended, by outcome (claimed: the connection's next request took "
           "it; expired: none came within OvertakeStageFollowUp; closed: the connection closed; "
           "other: the next request was of another stage).");
    for (i = 0; i < n; i++) {
        int o;
        for (o = 0; o < OS_RES_N; o++) {
            ap_rprintf(r, "overtake_stage_reservations_ended_total{stage=\"%s\",outcome=\"%s\"} %"
                       APR_UINT64_T_FMT "\n", os_shm->names[i], os_res_name[o],
                       LOAD(os_shm->st[i].res_ended[o]));
        }
    }
    STAGE_COUNTER("overtake_stage_requests_total", requests, "Requests of the stage (OvertakeStage).");
    STAGE_COUNTER("overtake_stage_held_total", held, "Requests of the stage that waited for their turn.");
    STAGE_COUNTER("overtake_stage_hold_timeouts_total", hold_timeouts,
                  "Requests that waited OvertakeStageHold and ran anyway.");
    STAGE_COUNTER("overtake_stage_overflows_total", overflows,
                  "Requests that found their stage's queue full and ran at once.");
    metric(r, "overtake_stage_hold_seconds_total", "counter", "Total wait of the stage's held requests.");
    for (i = 0; i < n; i++) {
        ap_rprintf(r, "overtake_stage_hold_seconds_total{stage=\"%s\"} %.9f\n", os_shm->names[i],
                   (double)LOAD(os_shm->st[i].hold_ns) / 1e9);
    }
    metric(r, "overtake_stage_served_total", "counter",
           "Requests of the stage logged, by where their work ran (by=apache: a handler in Apache's "
           "process; fcgi: a FastCGI server such as PHP-FPM; proxy: another HTTP server; cgi: a CGI process).");
    for (i = 0; i < n; i++) {
        int b;
        for (b = 0; b < OS_BY_N; b++) {
            ap_rprintf(r, "overtake_stage_served_total{stage=\"%s\",by=\"%s\"} %" APR_UINT64_T_FMT "\n",
                       os_shm->names[i], os_by_name[b], LOAD(os_shm->st[i].served[b]));
        }
    }
    metric(r, "overtake_stage_decisions_total", "counter",
           "Decisions taken (arrivals, completions and table changes).");
    ap_rprintf(r, "overtake_stage_decisions_total %" APR_UINT64_T_FMT "\n", LOAD(os_shm->epochs));
    metric(r, "overtake_stage_wakeups_total", "counter",
           "Futex wake-ups issued to start held requests (a system call each).");
    ap_rprintf(r, "overtake_stage_wakeups_total %" APR_UINT64_T_FMT "\n", LOAD(os_shm->wakes));
    metric(r, "overtake_stage_guard_starts_total", "counter",
           "Requests started because nothing ran while requests waited and the table started none.");
    ap_rprintf(r, "overtake_stage_guard_starts_total %" APR_UINT64_T_FMT "\n",
               LOAD(os_shm->guard_starts));
    metric(r, "overtake_stage_table_generation", "gauge",
           "Generation of the control file whose count table this child enforces (0: none: "
           "requests run at once).");
    ap_rprintf(r, "overtake_stage_table_generation %u\n", gen);
    metric(r, "overtake_stage_table_in_force", "gauge",
           "1 if the stage is held by the count table in this child, 0 if its requests run at once.");
    for (i = 0; i < n; i++) {
        ap_rprintf(r, "overtake_stage_table_in_force{stage=\"%s\"} %d\n", os_shm->names[i], held[i]);
    }
    metric(r, "overtake_stage_table_caps", "gauge",
           "The count table's caps per stage (kind=waiting|active): beyond them its documented default applies.");
    for (i = 0; gen && i < t.n; i++) {
        ap_rprintf(r, "overtake_stage_table_caps{stage=\"%s\",kind=\"waiting\"} %u\n"
                   "overtake_stage_table_caps{stage=\"%s\",kind=\"active\"} %u\n",
                   t.name[i], t.wcap[i], t.name[i], t.kcap[i]);
    }
    metric(r, "overtake_stage_hold_limit_seconds", "gauge", "OvertakeStageHold.");
    ap_rprintf(r, "overtake_stage_hold_limit_seconds %g\n", os_hold_s);
    metric(r, "overtake_stage_follow_up_limit_seconds", "gauge",
           "OvertakeStageFollowUp: how long a follow-up reservation waits for its request.");
    ap_rprintf(r, "overtake_stage_follow_up_limit_seconds %g\n", (double)os_shm->follow_ns / 1e9);
}
