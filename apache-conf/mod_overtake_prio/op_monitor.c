/*
 * op_monitor.c -- the monitor passes of a child: when an in-flight request can have crossed its
 * next threshold of attained thread CPU, a pass moves its thread to that level. The first request
 * start at or after that time makes the pass; the monitor thread, on a timer, when none does.
 */
#include "mod_overtake_prio.h"
#include "op_guard.h"

#include <signal.h>
#include <string.h>
#include <sys/timerfd.h>
#include <unistd.h>

/* Histogram of the delays of the monitor's passes in this child (Prometheus buckets, seconds). */
const double op_late_le[OP_LATE_BUCKETS] = {0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05};
apr_uint64_t op_late_count[OP_LATE_BUCKETS + 1];
int64_t op_late_max_ns;
int64_t op_late_sum_ns;

static pthread_t monitor;
static int monitor_running;
static int monitor_stop;
static int monitor_tfd = -1;        /* CLOCK_MONOTONIC timerfd: the monitor's one wait */
static int64_t period_ns;           /* OvertakePrioInterval */
static int threaded;                /* more than one worker thread a child: a start can come */
/* One pass at a time, the monitor's or a request start's; it also orders the timer's arming. */
static pthread_mutex_t pass_mu = PTHREAD_MUTEX_INITIALIZER;
static int64_t armed_at = INT64_MAX;    /* under pass_mu: the timer's expiry, INT64_MAX: disarmed */
static int64_t grace_ns;                /* under pass_mu: the timer's delay past op_pass_at */
static unsigned *seen_seq;              /* under pass_mu: each slot's request at the last pass */
int64_t op_pass_at = INT64_MAX;

/* One monitor pass: demote the threads whose attained CPU crossed a threshold. Returns the
 * earliest time at which an in-flight request could cross its next one (INT64_MAX: none);
 * *started: whether a request started on some slot since the last pass. */
static int64_t monitor_scan(int64_t now, int *started)
{
    int n = op_slots_in_use();
    int64_t soonest = INT64_MAX;
    int i;
    for (i = 0; i < n; i++) {
        op_slot *s = &op_slots[i];
        struct timespec ts;
        int64_t after = __atomic_load_n(&op_due[i], __ATOMIC_RELAXED);
        unsigned seq = __atomic_load_n(&s->seq, __ATOMIC_RELAXED);
        *started |= seq != seen_seq[i];
        seen_seq[i] = seq;
        if (now < after) {
            /* thread CPU <= wall time since start: it cannot have crossed yet */
            soonest = after < soonest ? after : soonest;
            continue;
        }
        pthread_mutex_lock(&s->mu);
        if (op_slot_claim(s)) {
            after = INT64_MAX;
            /* an exempt request is looked at only when every slot is made due (new
             * thresholds): it is never demoted by age */
            if (op_hot.age && !s->exempt && s->level < op_hot.nlevels
                && s->clk != CLOCK_THREAD_CPUTIME_ID
                && clock_gettime(s->clk, &ts) == 0) {
                int64_t cpu = op_ts_ns(&ts) - s->cpu0_ns;
                int k = op_level_for(cpu, s->level, op_hot.thr_ns, op_hot.nlevels);
                if (k > s->level) {
                    op_apply_level(s, k, 0);
                }
                after = op_next_due(now, cpu, s->level, op_hot.thr_ns, op_hot.nlevels);
            }
            after = op_guard_slot_due(s, now, after);
            __atomic_store_n(&op_due[i], after, __ATOMIC_RELAXED);
            op_slot_unclaim(s);
            soonest = after < soonest ? after : soonest;
        }
        else {
            /* idle: op_monitor_rearm may have stored its 0 after the request's end. A lock-free
             * start (op_prio.c) may have published its due time between the claim and this
             * store, which would then hide that request from every later pass: it stores active
             * before its due time (sequentially consistent), so a start this store overwrote is
             * seen active here, and is made due at once -- unless it stored again meanwhile. */
            int64_t never = INT64_MAX;
            __atomic_store_n(&op_due[i], INT64_MAX, __ATOMIC_SEQ_CST);
            if (__atomic_load_n(&s->active, __ATOMIC_SEQ_CST)
                && __atomic_compare_exchange_n(&op_due[i], &never, now, 0, __ATOMIC_SEQ_CST,
                                               __ATOMIC_RELAXED)) {
                soonest = now < soonest ? now : soonest;
            }
        }
        pthread_mutex_unlock(&s->mu);
    }
    return soonest;
}

/* Set the monitor's timer to expire at `at` (INT64_MAX: disarm). Caller holds pass_mu. */
static void arm(int64_t at)
{
    struct itimerspec its;
    if (__atomic_load_n(&monitor_stop, __ATOMIC_ACQUIRE)) {
        at = 1;  /* stopping: whoever arms last, the monitor's read returns */
    }
    else if (at == armed_at) {
        return;
    }
    memset(&its, 0, sizeof its);
    if (at != INT64_MAX) {
        at = at > 0 ? at : 1;  /* 0 would disarm it */
        its.it_value.tv_sec = at / 1000000000;
        its.it_value.tv_nsec = at % 1000000000;
    }
    timerfd_settime(monitor_tfd, TFD_TIMER_ABSTIME, &its, NULL);
    armed_at = at;
}

static void count_late(int64_t late)
{
    if (late > op_late_max_ns) {
        op_late_max_ns = late;
    }
    op_late_sum_ns += late;
    ADD(op_late_count[op_bucket(late, op_late_le, OP_LATE_BUCKETS)], 1);
}

/* The longest the monitor may sleep with requests in flight: the first threshold in force (a
 * request that starts later cannot cross sooner), at most 0.1 s so that it exits fast. */
static int64_t first_threshold(void)
{
    int64_t t = __atomic_load_n(&op_hot.thr_ns[0], __ATOMIC_RELAXED);
    return t < 100000000 ? t : 100000000;
}

/* A pass (caller holds pass_mu), and when the next is due: at the soonest due time of the
 * requests in flight, no later than one first threshold from now (a request that starts later
 * cannot cross sooner, but for the CPU resolution), no sooner than OvertakePrioInterval. The
 * next pass is made by the first request start at or after that time (op_monitor_pass_due),
 * or by the monitor when its timer expires. In a child where requests started since the last
 * pass (and that has more than one thread: under prefork a child's running request is the only
 * one), the timer waits one interval longer: a start usually comes first and the monitor
 * sleeps through (its wake-up would preempt a worker, and many of them lengthen the queue of
 * a saturated core). Half an interval was too short when another process shares the core: its
 * turns on the CPU often outlast that, and the monitor woke for a pass its own child's next
 * start would make. Where none started, a pass is the monitor's, on time. With nothing in
 * flight there is no next pass and the timer is off: an idle child costs no wake-ups. */
static void pass(int64_t now)
{
    int started = 0;
    int64_t soonest = monitor_scan(now, &started);
    ADD(op_shm->monitor_ticks, 1);
    if (soonest == INT64_MAX) {
        /* Nothing to watch. Say so, then look once more: a request start publishes its due
         * time before it reads op_pass_at (both sequentially consistent), so either this look
         * sees it or that start sees INT64_MAX and makes a pass (op_monitor_wake). */
        __atomic_store_n(&op_pass_at, INT64_MAX, __ATOMIC_SEQ_CST);
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        soonest = monitor_scan(op_mono_ns(), &started);
        if (soonest == INT64_MAX) {
            arm(INT64_MAX);
            return;
        }
    }
    grace_ns = started && threaded ? period_ns : 0;
    now = op_next_wake(now, soonest, first_threshold(), period_ns);
    __atomic_store_n(&op_pass_at, now, __ATOMIC_SEQ_CST);
    arm(now + grace_ns);
}

/* A request start at level 0 at or after the next pass's time makes it, unless a pass is under
 * way. (A thread at a lower level could hold pass_mu for long, the monitor waiting behind it.) */
OP_HOT void op_monitor_pass_due(int64_t now)
{
    if (pthread_mutex_trylock(&pass_mu) == 0) {
        int64_t at = __atomic_load_n(&op_pass_at, __ATOMIC_RELAXED);
        if (now >= at) {
            count_late(now - at);
            pass(now);
        }
        pthread_mutex_unlock(&pass_mu);
    }
}

/* A pass as soon as possible: at the next request start at level 0, or by the monitor, woken
 * now. Not a pass here: the caller may run at a lowered priority, and a pass holds pass_mu. */
static void pass_now(void)
{
    pthread_mutex_lock(&pass_mu);
    __atomic_store_n(&op_pass_at, op_mono_ns(), __ATOMIC_SEQ_CST);
    arm(1);
    pthread_mutex_unlock(&pass_mu);
}

/* New thresholds are in force (op_control.c, after bumping op_hot.thr_gen): a request in flight
 * was given its due time by the thresholds of its start, so a lowered threshold would reach it
 * only at the old one. Every slot is due at once and a pass comes at once: it looks at every
 * request in flight by the new thresholds (and an idle slot's due goes back to never). A
 * request start that read the old thresholds and stored its due after this sees the generation
 * move and makes itself due (op_prio.c). */
void op_monitor_rearm(void)
{
    int i, n = op_slots_in_use();
    if (!monitor_running) {
        return;
    }
    for (i = 0; i < n; i++) {
        __atomic_store_n(&op_due[i], 0, __ATOMIC_SEQ_CST);
    }
    pass_now();
}

/* A request start found nothing watched (op_pass_at INT64_MAX): a pass at once (the monitor's,
 * woken, or the next start's), which finds the request's due time and sets the next. */
void op_monitor_wake(void)
{
    if (monitor_running && __atomic_load_n(&op_pass_at, __ATOMIC_SEQ_CST) == INT64_MAX) {
        pass_now();
    }
}

/* Waits on its timer; a pass when it expires and no request start made the pass meanwhile. */
static void *monitor_main(void *arg)
{
    (void)arg;
    pthread_setname_np(pthread_self(), "overtake-prio");
    while (!__atomic_load_n(&monitor_stop, __ATOMIC_ACQUIRE)) {
        uint64_t expiries;
        int64_t now, at;
        if (read(monitor_tfd, &expiries, sizeof expiries) != (ssize_t)sizeof expiries) {
            continue;  /* EINTR; a re-arm between the expiry and the read (it reads nothing) */
        }
        pthread_mutex_lock(&pass_mu);
        armed_at = INT64_MAX;  /* one shot: it expired */
        now = op_mono_ns();
        at = __atomic_load_n(&op_pass_at, __ATOMIC_RELAXED);
        if (now >= at) {
            count_late(now - at);
            pass(now);
        }
        else if (at != INT64_MAX) {
            arm(at + grace_ns);
        }
        pthread_mutex_unlock(&pass_mu);
    }
    return NULL;
}

/* Start the monitor (child_init, after op_slots_create; threads: the MPM's per child); 0 if
 * its timer or thread could not be created. */
int op_monitor_start(apr_pool_t *p, int threads)
{
    sigset_t all, old;
    threaded = threads > 1;
    period_ns = (int64_t)(conf_interval(op_cconf) * 1e9 + 0.5);
    seen_seq = apr_pcalloc(p, sizeof *seen_seq * (apr_size_t)op_nslots);
    monitor_tfd = timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC);
    if (monitor_tfd < 0) {
        return 0;
    }
    /* Signals belong to the MPM's threads, never to the monitor. */
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    monitor_running = pthread_create(&monitor, NULL, monitor_main, NULL) == 0;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return monitor_running;
}

/* Stop it and wait for it (child exit). */
void op_monitor_stop(void)
{
    if (!monitor_running) {
        return;
    }
    __atomic_store_n(&monitor_stop, 1, __ATOMIC_RELEASE);
    pthread_mutex_lock(&pass_mu);
    arm(1);  /* expires at once: the monitor's read returns */
    pthread_mutex_unlock(&pass_mu);
    pthread_join(monitor, NULL);
    monitor_running = 0;
}
