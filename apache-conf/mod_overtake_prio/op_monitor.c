/*
 * op_monitor.c -- the monitor thread of a child: it wakes when an in-flight request can have
 * crossed its next threshold of attained thread CPU and moves its thread to that level.
 */
#include "mod_overtake_prio.h"
#include "op_guard.h"

#include <errno.h>
#include <signal.h>

/* Histogram of the monitor's wake-up delays in this child (Prometheus buckets, seconds). */
const double op_late_le[OP_LATE_BUCKETS] = {0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05};
apr_uint64_t op_late_count[OP_LATE_BUCKETS + 1];
int64_t op_late_max_ns;
int64_t op_late_sum_ns;
int op_monitor_idle;

static pthread_t monitor;
static int monitor_running;
static int monitor_stop;        /* under monitor_mu */
static int monitor_woken;       /* under monitor_mu: a request start ended that wait */
static pthread_mutex_t monitor_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t monitor_cv;   /* CLOCK_MONOTONIC; signalled to stop the monitor */

/* One monitor pass: demote the threads whose attained CPU crossed a threshold. Returns the
 * earliest time at which an in-flight request could cross its next one (INT64_MAX: none). */
static int64_t monitor_scan(int64_t now)
{
    int n = op_slots_in_use();
    int64_t soonest = INT64_MAX;
    int i;
    for (i = 0; i < n; i++) {
        op_slot *s = &op_slots[i];
        struct timespec ts;
        int64_t after = __atomic_load_n(&op_due[i], __ATOMIC_RELAXED);
        if (now < after) {
            /* thread CPU <= wall time since start: it cannot have crossed yet */
            soonest = after < soonest ? after : soonest;
            continue;
        }
        pthread_mutex_lock(&s->mu);
        if (__atomic_load_n(&s->active, __ATOMIC_ACQUIRE)) {
            after = INT64_MAX;
            if (op_hot.age && s->level < op_hot.nlevels && s->clk != CLOCK_THREAD_CPUTIME_ID
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
            soonest = after < soonest ? after : soonest;
        }
        else {
            /* idle: op_monitor_rearm may have stored its 0 after the request's end */
            __atomic_store_n(&op_due[i], INT64_MAX, __ATOMIC_RELAXED);
        }
        pthread_mutex_unlock(&s->mu);
    }
    return soonest;
}

/* New thresholds are in force (op_control.c, after bumping op_hot.thr_gen): a request in flight
 * was given its due time by the thresholds of its start, so a lowered threshold would reach it
 * only at the old one. Every slot is due at once and the monitor wakes, deadline or not: its pass
 * looks at every request in flight by the new thresholds (and an idle slot's due goes back to
 * never). A request start that read the old thresholds and stored its due after this sees the
 * generation move and makes itself due (op_prio.c). */
void op_monitor_rearm(void)
{
    int i, n = op_slots_in_use();
    for (i = 0; i < n; i++) {
        __atomic_store_n(&op_due[i], 0, __ATOMIC_SEQ_CST);
    }
    pthread_mutex_lock(&monitor_mu);
    __atomic_store_n(&op_monitor_idle, 0, __ATOMIC_RELAXED);
    monitor_woken = 1;
    pthread_cond_signal(&monitor_cv);
    pthread_mutex_unlock(&monitor_mu);
}

/* A request start found the monitor waiting without a deadline: wake it. The monitor holds
 * monitor_mu from raising op_monitor_idle until its wait begins, so the signal cannot be lost. */
void op_monitor_wake(void)
{
    pthread_mutex_lock(&monitor_mu);
    if (op_monitor_idle) {
        __atomic_store_n(&op_monitor_idle, 0, __ATOMIC_RELAXED);
        monitor_woken = 1;
        pthread_cond_signal(&monitor_cv);
    }
    pthread_mutex_unlock(&monitor_mu);
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

/* Wakes only when a threshold can be crossed: at the earliest due time of the requests in
 * flight, and no later than one first threshold from now (a request that starts later cannot
 * cross sooner, but for the CPU resolution), but never more often than OvertakePrioInterval;
 * a busy child with short requests wakes about once per first threshold. With nothing in
 * flight it waits without a deadline until a request starts (op_monitor_wake): an idle Apache
 * costs no wake-ups. */
static void *monitor_main(void *arg)
{
    int64_t period = (int64_t)(conf_interval(op_cconf) * 1e9 + 0.5);
    int64_t next = op_mono_ns() + period;
    int idle = 0;
    (void)arg;
    pthread_setname_np(pthread_self(), "overtake-prio");
    pthread_mutex_lock(&monitor_mu);
    while (!monitor_stop) {
        struct timespec ts;
        int64_t now, soonest, horizon = first_threshold();
        int rc;
        ts.tv_sec = next / 1000000000;
        ts.tv_nsec = next % 1000000000;
        rc = idle ? pthread_cond_wait(&monitor_cv, &monitor_mu)
                  : pthread_cond_timedwait(&monitor_cv, &monitor_mu, &ts);
        if (monitor_stop) {
            break;
        }
        now = op_mono_ns();
        if (rc != ETIMEDOUT) {
            if (!monitor_woken) {
                continue;  /* a spurious wake-up: wait again */
            }
            monitor_woken = 0;
            idle = 0;
            ADD(op_shm->monitor_ticks, 1);
            next = op_next_wake(now, monitor_scan(now), horizon, period);
            continue;
        }
        count_late(now - next);
        ADD(op_shm->monitor_ticks, 1);
        soonest = monitor_scan(now);
        if (soonest == INT64_MAX) {
            /* Nothing to watch. Raise the flag, then look once more: a request start publishes
             * its due time before it reads the flag (both sequentially consistent), so either
             * this pass sees it or that start sees the flag and wakes us. */
            __atomic_store_n(&op_monitor_idle, 1, __ATOMIC_SEQ_CST);
            __atomic_thread_fence(__ATOMIC_SEQ_CST);
            soonest = monitor_scan(op_mono_ns());
            if (soonest == INT64_MAX) {
                idle = 1;
                continue;
            }
            __atomic_store_n(&op_monitor_idle, 0, __ATOMIC_RELAXED);
        }
        next = op_next_wake(now, soonest, horizon, period);
    }
    pthread_mutex_unlock(&monitor_mu);
    return NULL;
}

/* Start the monitor (child_init); 0 if the thread could not be created. */
int op_monitor_start(void)
{
    pthread_condattr_t ca;
    sigset_t all, old;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&monitor_cv, &ca);
    pthread_condattr_destroy(&ca);
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
    pthread_mutex_lock(&monitor_mu);
    monitor_stop = 1;
    pthread_cond_signal(&monitor_cv);
    pthread_mutex_unlock(&monitor_mu);
    pthread_join(monitor, NULL);
    monitor_running = 0;
}
