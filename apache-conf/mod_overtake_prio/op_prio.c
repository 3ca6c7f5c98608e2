/*
 * op_prio.c -- per-request CPU priority: a slot per worker thread, the request's start (its
 * starting level, its CPU clock), the move to a lower level, and the restore at its end (the
 * end filter on EOS, the request pool's cleanup, a hand-over to the thread's next request).
 * The monitor thread (op_monitor.c) decides the moves by attained CPU.
 */
#include "mod_overtake_prio.h"
#include "op_guard.h"

#include <errno.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "http_request.h"

op_slot *op_slots;
int64_t *op_due;
int op_nslots;
int op_slots_used;
ap_filter_rec_t *op_end_filter_handle;
/* initial-exec: a plain load from the thread pointer instead of a __tls_get_addr call per
 * request (a dlopen'ed module's default); 8 bytes of glibc's static TLS surplus */
static __thread op_slot *my_slot __attribute__((tls_model("initial-exec")));

pid_t op_gettid(void) { return (pid_t)syscall(SYS_gettid); }

OP_HOT int64_t op_mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return op_ts_ns(&ts);
}

/* Worker threads, plus room for threads that other modules run requests on (mod_http2). */
void op_slots_create(apr_pool_t *p, int threads)
{
    int k;
    char *m;
    op_nslots = 2 * (threads > 0 ? threads : 64) + 16;
    /* on a cache line each, as the type says (a pool gives 8-byte alignment) */
    m = apr_pcalloc(p, sizeof *op_slots * (apr_size_t)op_nslots + 63);
    op_slots = (op_slot *)(((uintptr_t)m + 63) & ~(uintptr_t)63);
    op_due = apr_palloc(p, sizeof *op_due * (apr_size_t)op_nslots);
    for (k = 0; k < op_nslots; k++) {
        pthread_mutex_init(&op_slots[k].mu, NULL);
        op_due[k] = INT64_MAX;
    }
    op_guard_slots_create(p, op_nslots);
}

/* Slots claimed so far (a claim beyond the table counts up before it is refused). */
int op_slots_in_use(void)
{
    int n = __atomic_load_n(&op_slots_used, __ATOMIC_ACQUIRE);
    return n > op_nslots ? op_nslots : n;
}

static op_slot *slot_claim(void)
{
    int i = __atomic_fetch_add(&op_slots_used, 1, __ATOMIC_ACQ_REL);
    op_slot *s;
    if (i >= op_nslots) {
        __atomic_store_n(&op_slots_used, op_nslots, __ATOMIC_RELEASE);
        return NULL;
    }
    s = &op_slots[i];
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
void op_apply_level(op_slot *s, int k, int by_class)
{
    int nice = op_level_nice(s->orig_nice, conf_nice(op_cconf, k - 1));
    int rc;
    if (nice == OP_NICE_IDLE) {
        struct sched_param p;
        memset(&p, 0, sizeof p);
        rc = sched_setscheduler(s->tid, SCHED_IDLE, &p);
    }
    else {
        rc = setpriority(PRIO_PROCESS, (id_t)s->tid, nice);
    }
    if (rc != 0) {
        ADD(op_shm->demote_errors, 1);  /* the thread keeps its priority; restore is harmless */
    }
    if (by_class) {
        ADD(op_shm->demoted_class[k], 1);
    }
    else {
        ADD(op_shm->demoted_age[k], 1);
    }
    s->level = k;
}

/* The kernel's struct sched_attr, first version (48 bytes; linux/sched/types.h, whose own
 * struct sched_param clashes with glibc's). */
typedef struct {
    uint32_t size, sched_policy;
    uint64_t sched_flags;
    int32_t sched_nice;
    uint32_t sched_priority;
    uint64_t sched_runtime, sched_deadline, sched_period;
} op_sched_attr;

/* Set a thread's policy and nice value in one system call where the kernel allows it
 * (sched_setattr, Linux 3.14): two calls would leave the thread for a moment at the demoted nice
 * value under its normal policy, a state no level has. Real-time policies keep no nice value in
 * sched_setattr, and kernels without it answer ENOSYS: both take the two calls. */
int op_set_sched(pid_t tid, int policy, const struct sched_param *param, int nice)
{
    if (policy == SCHED_OTHER || policy == SCHED_BATCH || policy == SCHED_IDLE) {
        op_sched_attr a;
        memset(&a, 0, sizeof a);
        a.size = sizeof a;
        a.sched_policy = (uint32_t)policy;
        a.sched_nice = nice;
        a.sched_priority = (uint32_t)param->sched_priority;
        if (syscall(SYS_sched_setattr, tid, &a, 0) == 0) {
            return 0;
        }
        if (errno != ENOSYS) {
            return -1;
        }
    }
    if (sched_setscheduler(tid, policy, param) != 0) {
        return -1;
    }
    return setpriority(PRIO_PROCESS, (id_t)tid, nice);
}

/* Give the thread its original policy and nice value back. Caller holds s->mu (or ends its own
 * request: end_own). */
static int restore_thread(op_slot *s)
{
    int rc = op_any_idle ? op_set_sched(s->tid, s->orig_policy, &s->orig_param, s->orig_nice)
                         : setpriority(PRIO_PROCESS, (id_t)s->tid, s->orig_nice);
    return rc == 0 || errno == ESRCH;
}

static void count_restore(op_slot *s)
{
    if (restore_thread(s)) {
        ADD(op_shm->restores, 1);
    }
    else {
        ADD(op_shm->restore_errors, 1);
    }
}

/* The end of the slot's request but marking it idle: restore, count, reset. By its closer: the
 * lock's holder, or the owner whose exchange made the slot idle (end_own). */
static void end_request(op_slot *s)
{
    if (s->level > 0) {
        count_restore(s);
    }
    ADD(op_shm->requests[s->level], 1);
    s->level = 0;
    s->gate_word = NULL;
    __atomic_store_n(&op_due[s - op_slots], INT64_MAX, __ATOMIC_RELAXED);
}

/* End the slot's current request: restore, count, mark idle. Caller holds s->mu. */
void op_slot_close(op_slot *s)
{
    end_request(s);
    __atomic_store_n(&s->active, 0, __ATOMIC_RELEASE);
}

/* The requests in flight in this child by current level (the status page's gauge): counted from
 * the slots when asked, not kept up to date by two locked additions per request. */
void op_inflight_count(apr_int64_t counts[OP_MAX_LEVELS + 1])
{
    int i, n = op_slots_in_use();
    memset(counts, 0, sizeof(apr_int64_t) * (OP_MAX_LEVELS + 1));
    for (i = 0; i < n; i++) {
        pthread_mutex_lock(&op_slots[i].mu);
        if (__atomic_load_n(&op_slots[i].active, __ATOMIC_ACQUIRE)
            && op_slots[i].level >= 0 && op_slots[i].level <= OP_MAX_LEVELS) {
            counts[op_slots[i].level]++;
        }
        pthread_mutex_unlock(&op_slots[i].mu);
    }
}

/* A thread other than the slot's owner that changes an active slot's level, gate word or state
 * (the monitor, the promoter, the child's exit) claims it first, under its lock: active goes from
 * 1 to 2 until op_slot_unclaim, so that the owner's lock-free end (end_own) cannot close the
 * request meanwhile. 0: the request ended (or the slot is idle). */
int op_slot_claim(op_slot *s)
{
    int one = 1;
    return __atomic_compare_exchange_n(&s->active, &one, 2, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

void op_slot_unclaim(op_slot *s)
{
    __atomic_store_n(&s->active, 1, __ATOMIC_RELEASE);
}

/* Child exit: every request still in flight gets its thread's priority back. */
void op_slots_close_all(void)
{
    int i, n = op_slots_in_use();
    for (i = 0; i < n; i++) {
        pthread_mutex_lock(&op_slots[i].mu);
        if (op_slot_claim(&op_slots[i])) {
            op_slot_close(&op_slots[i]);  /* idle at its end */
        }
        pthread_mutex_unlock(&op_slots[i].mu);
    }
}

/* Back to level 0, restored and counted. Caller holds s->mu. */
void op_release(op_slot *s)
{
    count_restore(s);
    s->level = 0;
    s->gate_word = NULL;
}

/* Back to level 0: an idle start the sidecar has opened. Caller holds s->mu. */
void op_promote(op_slot *s)
{
    op_release(s);
    ADD(op_shm->gate_promotions, 1);
    /* its age levels start over from here (attained CPU includes the idle run) */
    __atomic_store_n(&op_due[s - op_slots],
                     op_hot.age ? op_next_due(s->clock_read_ns, 0, 0, op_hot.thr_ns,
                                              op_hot.nlevels)
                                : INT64_MAX, __ATOMIC_RELAXED);
}

/* The end of the request on its own thread at level 0 (the common end: EOS, in the thread that
 * ran the handler), without the slot's lock: 1 if it closed the slot. Only the owner starts a
 * request on its slot, and the two ends of one request (EOS, the pool's cleanup) never run at
 * once, so nothing but a claim (op_slot_claim) can change active between the looks and the
 * exchange, and a claim makes the exchange fail (the caller then takes the lock, which the
 * claimer holds). A demotion that came between the look at the level and the exchange is seen
 * after it, and restored here: the slot is idle by then, and nobody else writes an idle slot. */
static int end_own(op_slot *s, const op_request_state *st)
{
    int one = 1;
    if (s != my_slot || s->seq != st->seq || s->level || s->gate_word
        || !__atomic_compare_exchange_n(&s->active, &one, 0, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
        return 0;
    }
    end_request(s);
    return 1;
}

/* End the request's tracking: restore its thread, count it, mark the slot idle. Called at EOS and
 * by the pool's cleanup; whichever comes first ends it (or finds the slot serving a newer request)
 * and forgets the slot, so the second has nothing to look at. */
OP_HOT void op_prio_request_end(op_request_state *st)
{
    op_slot *s = st->slot;
    st->slot = NULL;
    if (!s || !__atomic_load_n(&s->active, __ATOMIC_ACQUIRE)
        || __atomic_load_n(&s->seq, __ATOMIC_ACQUIRE) != st->seq || end_own(s, st)) {
        return;
    }
    pthread_mutex_lock(&s->mu);
    if (__atomic_load_n(&s->active, __ATOMIC_ACQUIRE) && s->seq == st->seq) {
        op_slot_close(s);
    }
    pthread_mutex_unlock(&s->mu);
}

/* The starting level the class header asks for (0 without one; a bad one is counted). */
static int class_level(request_rec *r)
{
    const char *h = apr_table_get(r->headers_in, op_hot.hname);
    int start = 0;
    if (h && !op_parse_class(h, op_hot.nlevels, &start)) {
        ADD(op_shm->class_invalid, 1);
        ap_log_rerror(APLOG_MARK, APLOG_DEBUG, 0, r, APLOGNO(90001)
                      "%s: '%s' is not a level in 0..%d", op_hot.hname, h, op_hot.nlevels);
        start = 0;
    }
    return start;
}

/* The thread CPU clock is a system call (the vDSO has no thread clocks), which costs a tiny
 * request ~2 % of its CPU: read it at most once per resolution. A reading taken at t <= now is
 * short of the CPU at this start by less than now - t (CPU never runs ahead of wall time), so
 * attained CPU is overcounted by less than the resolution, and no threshold can be crossed before
 * clock_read_ns + threshold. Class-only mode reads none. */
static void read_clock(op_slot *s, int64_t now)
{
    struct timespec cpu;
    if (op_hot.age && now - s->clock_read_ns >= op_hot.resolution_ns) {
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu);
        s->clock_cpu_ns = op_ts_ns(&cpu);
        s->clock_read_ns = now;
        ADD(op_shm->clock_reads, 1);
    }
}

static int64_t first_due(const op_slot *s, int exempt)
{
    return op_hot.age && !exempt ? op_next_due(s->clock_read_ns, 0, s->level, op_hot.thr_ns,
                                               op_hot.nlevels)
                                 : INT64_MAX;
}

/* A start's due time. One the monitor must see is a sequentially consistent store (an exchange
 * on x86), ordered before the loads of due_published as a full fence after a plain store was; a
 * never (INT64_MAX: exempt, or no age) needs no look and is a plain store. */
static inline void publish_due(const op_slot *s, int64_t due)
{
    if (due != INT64_MAX) {
        __atomic_store_n(&op_due[s - op_slots], due, __ATOMIC_SEQ_CST);
    }
    else {
        __atomic_store_n(&op_due[s - op_slots], due, __ATOMIC_RELAXED);
    }
}

/* The common start: an idle slot, level 0, no gate word. No lock: an idle slot (active 0, due
 * INT64_MAX, level 0, no gate word: op_slot_close) is written by nobody else -- the monitor, the
 * promoter and the child's exit act only on an active slot, under its lock, and only this thread
 * ends its slot's request or starts the next one -- and active's release store publishes the
 * fields before it to whoever then takes the lock. The monitor may store its own due time for the
 * new request before or after this one's: each is a moment it may look at the request again. */
static int64_t start_unlocked(op_slot *s, int exempt)
{
    int64_t due = first_due(s, exempt);
    __atomic_store_n(&s->seq, s->seq + 1, __ATOMIC_RELEASE);
    s->cpu0_ns = s->clock_cpu_ns;
    s->exempt = exempt;
    __atomic_store_n(&s->active, 1, __ATOMIC_RELEASE);
    publish_due(s, due);
    return due;
}

/* A start at a class level, an idle start, or one that finds its thread's previous request still
 * open: under the slot's lock, as the monitor and the promoter may act on it. */
static OP_COLD int64_t start_locked(op_slot *s, int64_t now, int exempt, int start,
                            const uint32_t *gate_word, uint32_t gate_gen)
{
    const uint32_t *gate_gone = NULL;
    int64_t due;
    pthread_mutex_lock(&s->mu);
    if (__atomic_load_n(&s->active, __ATOMIC_ACQUIRE)) {
        /* The previous request's pool outlived its work on this thread (async write
         * completion): the thread now serves this request, so its priority is reset. */
        op_slot_close(s);
        ADD(op_shm->handoffs, 1);
    }
    __atomic_store_n(&s->seq, s->seq + 1, __ATOMIC_RELEASE);
    s->cpu0_ns = s->clock_cpu_ns;
    s->exempt = exempt;
    s->level = 0;
    if (start > 0) {
        op_apply_level(s, start, 1);
    }
    if (gate_word) {
        gate_gone = op_gate_idle_hold(s, gate_word, gate_gen);
    }
    due = op_guard_slot_due(s, now, first_due(s, exempt));
    publish_due(s, due);
    __atomic_store_n(&s->active, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&s->mu);
    if (gate_gone) {
        op_gate_fault(gate_gone);
    }
    return due;
}

/* After a start stored its due time (thr_gen: op_hot.thr_gen before it read the thresholds). The
 * due store (publish_due) and the loads here are sequentially consistent: see op_monitor_rearm
 * and the monitor's pass. */
static void due_published(op_slot *s, unsigned thr_gen)
{
    if (__atomic_load_n(&op_hot.thr_gen, __ATOMIC_SEQ_CST) != thr_gen) {
        /* new thresholds came while this took its due from the old ones: look at it now */
        __atomic_store_n(&op_due[s - op_slots], 0, __ATOMIC_RELAXED);
    }
    if (__atomic_load_n(&op_pass_at, __ATOMIC_SEQ_CST) == INT64_MAX) {
        op_monitor_wake();
    }
}

OP_HOT int op_post_read_request(request_rec *r)
{
    op_slot *s;
    op_request_state *st;
    int start, exempt;
    int64_t due, now;
    const uint32_t *gate_word = NULL;
    uint32_t gate_gen = 0;
    unsigned thr_gen;
    const char *note;

    if (!op_hot.child_ok || r->main || r->prev) {
        return DECLINED;  /* subrequests and internal redirects belong to the first request */
    }
    s = my_slot ? my_slot : slot_claim();
    if (!s) {
        ADD(op_shm->untracked, 1);
        return DECLINED;
    }
    exempt = op_guard_request(r);  /* may hold a lock others wait for: never demoted */
    start = exempt || !op_hot.hname ? 0 : class_level(r);
    /* an idle start (the gate's IDLE state): the lowest level until the sidecar opens it */
    note = op_cconf->gate_file ? apr_table_get(r->notes, OG_NOTE) : NULL;
    if (note && op_gate_idle_word(note, &gate_word, &gate_gen)) {
        start = op_hot.nlevels;
    }
    now = op_mono_ns();
    read_clock(s, now);
    thr_gen = __atomic_load_n(&op_hot.thr_gen, __ATOMIC_ACQUIRE);  /* before the thresholds */
    due = start == 0 && !gate_word && !__atomic_load_n(&s->active, __ATOMIC_ACQUIRE)
          ? start_unlocked(s, exempt) : start_locked(s, now, exempt, start, gate_word, gate_gen);
    if (due != INT64_MAX) {
        due_published(s, thr_gen);
    }
    st = op_request_state_of(r);
    st = st ? st : op_request_state_new(r);
    st->slot = s;
    st->seq = s->seq;
    /* one that stays at level 0 needs no restore before its response: its pool's cleanup ends it */
    st->demotable = start > 0 || gate_word || (op_hot.age && !exempt);
    if (start == 0 && !gate_word && now >= __atomic_load_n(&op_pass_at, __ATOMIC_RELAXED)) {
        op_monitor_pass_due(now);  /* the monitor's pass, here: its thread sleeps through */
    }
    return DECLINED;
}

/* Every request that runs a handler (internal redirects included) and may be demoted gets the end
 * filter. It is a connection filter, added at the connection's first such request and kept for the
 * rest: adding a request filter to each was most of what a request that is never demoted paid for
 * it. Its context is the request in progress: this one's record, cleared at its EOS, or at its
 * end (the record's cleanup) if it has none. */
OP_HOT void op_insert_filter(request_rec *r)
{
    op_request_state *st;
    ap_filter_t *f;
    conn_rec *c = r->connection;
    if (r->main) {
        return;
    }
    st = op_request_state_of(r);
    if (!st || !st->slot || !st->demotable) {
        return;
    }
    f = ap_get_module_config(c->conn_config, &overtake_prio_module);
    if (!f) {
        /* with r: Apache relinks this request's chain to the new connection filter */
        f = ap_add_output_filter_handle(op_end_filter_handle, NULL, r, c);
        ap_set_module_config(c->conn_config, &overtake_prio_module, f);
    }
    if (f) {
        f->ctx = st;
        st->end_f = f;
    }
}

/* EOS = the handler and the content filters are done: the rest of the request (the protocol
 * filters' few bytes, the network write, TLS, logging) is not the request's CPU demand.
 * Restoring before the last write also means a client never sees the response of a
 * still-demoted thread. After it the filter waits, with no context, for the connection's next
 * request: brigades in between (another EOS, the end-of-request bucket) pass through. */
OP_HOT apr_status_t op_end_filter(ap_filter_t *f, apr_bucket_brigade *bb)
{
    if (f->ctx && !APR_BRIGADE_EMPTY(bb) && APR_BUCKET_IS_EOS(APR_BRIGADE_LAST(bb))) {
        op_prio_request_end(f->ctx);
        f->ctx = NULL;
    }
    return ap_pass_brigade(f->next, bb);
}
