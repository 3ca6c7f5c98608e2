/*
 * op_stage_child.c -- a child's share of the stages' counts, given back when the child dies.
 *
 * A child that crashes (a segfault in mod_php, the OOM killer, a SIGKILL) runs no cleanup: the
 * requests it was running stayed counted as running and its held requests' tickets stayed in
 * their queues, to be granted one day to nobody. A stage capped by the table then ran fewer
 * requests for good, down to none, each request waiting OvertakeStageHold, until Apache was
 * stopped. So each child keeps, in the shared mapping, a block of its own: the requests of each
 * stage it counts running, and each ticket of a queue names the block of the request waiting
 * on it. When the parent reaps a child (the MPM's child_status hook, MPM_CHILD_EXITED), it
 * takes the lock and gives back what the block still holds: the running counts, the tickets
 * still waiting (gone, as a waiter whose bound passed), and the tickets granted to a waiter that
 * never woke (a running count each). A child that exited normally has given everything back
 * already; its block is freed alike. The parent has no table (the children read the control
 * file), so it decides nothing: it counts the repair and wakes the held requests, and the first
 * to wake decides by its child's table what the freed room starts (op_stage.c, hold_counted;
 * a wake-up that falls before a waiter's wait is not lost for long: no wait lasts more than the
 * 100 ms between its looks at its client).
 *
 * A child's running count is taken after the stage's count rises and given back before it drops,
 * and a granted waiter clears its ticket's owner before it counts itself running: a child killed
 * between the two leaves one count behind (as before), never one too few (a cap exceeded).
 */
#include "mod_overtake_prio.h"

#include <limits.h>
#include <linux/futex.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include "op_stage.h"

int os_me = -1;

/* Child (child_init, before any request): a free block, or none (-1: the child's counts are not
 * given back if it crashes, as before). */
void op_stage_child_init(void)
{
    pid_t me = getpid();
    int32_t free_pid;
    int i;
    if (!os_shm) {
        return;
    }
    for (i = 0; i < OS_MAX_CHILDREN; i++) {
        free_pid = 0;
        if (__atomic_compare_exchange_n(&os_shm->child[i].pid, &free_pid, (int32_t)me, 0,
                                        __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
            memset(os_shm->child[i].active, 0, sizeof os_shm->child[i].active);
            os_me = i;
            return;
        }
    }
}

/* Give back block b's counts in stage i's queue (lock held); how many requests it held there. */
static int32_t give_back(uint32_t b, uint32_t i)
{
    os_queue *q = &os_shm->st[i].q;
    int32_t n = 0, a = __atomic_exchange_n(&os_shm->child[b].active[i], 0, __ATOMIC_ACQ_REL);
    uint32_t j;
    for (j = 0; j < OS_RING; j++) {
        uint32_t t = q->tail - OS_RING + j;  /* the one outstanding ticket this ring entry can be */
        if (q->owner[t % OS_RING] != b + 1) {
            continue;
        }
        q->owner[t % OS_RING] = 0;
        if (os_started(q, q->head, t)) {
            a++;  /* granted, counted running, and its waiter never woke */
        }
        else if (!q->gone[t % OS_RING]) {
            q->gone[t % OS_RING] = 1;  /* still waiting: skipped by the grants, as a give-up */
            q->waiting--;
            n++;
        }
    }
    if (a > 0) {
        q->active = q->active > a ? q->active - a : 0;
        n += a;
    }
    if (n) {
        ADD(os_shm->st[i].given_back, (apr_uint64_t)n);
        /* a waiter between its look and its futex wait then finds the word changed */
        __atomic_store_n(&q->wake, q->wake + 1, __ATOMIC_SEQ_CST);
    }
    return n;
}

/* Parent: child pid ended; whatever its block still holds goes back, and the held requests
 * wake to decide what starts now. */
void op_stage_child_status(server_rec *s, pid_t pid, ap_generation_t gen, int slot,
                           mpm_child_status state)
{
    uint32_t b, i;
    int32_t n = 0;
    (void)gen;
    (void)slot;
    if (state != MPM_CHILD_EXITED || !os_shm || pid <= 0) {
        return;
    }
    for (b = 0; b < OS_MAX_CHILDREN && os_shm->child[b].pid != (int32_t)pid; b++) {
    }
    if (b == OS_MAX_CHILDREN) {
        return;  /* no block: a child of a mapping replaced by a restart, or none was free */
    }
    os_lock();
    for (i = 0; i < os_shm->nstages && i < OS_MAX_STAGES; i++) {
        n += give_back(b, i);
    }
    if (n) {
        __atomic_fetch_add(&os_shm->repairs, 1, __ATOMIC_SEQ_CST);
    }
    os_unlock();
    __atomic_store_n(&os_shm->child[b].pid, 0, __ATOMIC_RELEASE);
    for (i = 0; n && i < os_shm->nstages && i < OS_MAX_STAGES; i++) {
        if (__atomic_load_n(&os_shm->st[i].sleepers, __ATOMIC_SEQ_CST)) {
            syscall(SYS_futex, &os_shm->st[i].q.wake, FUTEX_WAKE_BITSET, INT_MAX, NULL, NULL,
                    FUTEX_BITSET_MATCH_ANY);
        }
    }
    if (n) {
        ap_log_error(APLOG_MARK, APLOG_WARNING, 0, s, APLOGNO(90306) "mod_overtake_prio: child %ld "
                     "ended without ending %d request(s) of its stages (it crashed or was killed); "
                     "their counts are given back", (long)pid, n);
    }
}

/* Blocks in use (the status page). */
int op_stage_child_blocks(void)
{
    int i, n = 0;
    for (i = 0; i < OS_MAX_CHILDREN; i++) {
        n += __atomic_load_n(&os_shm->child[i].pid, __ATOMIC_RELAXED) != 0;
    }
    return n;
}
