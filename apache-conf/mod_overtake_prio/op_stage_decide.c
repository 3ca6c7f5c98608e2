/*
 * op_stage_decide.c -- module mode's shared counts and the count table's decisions.
 *
 * Per stage, the requests waiting and running are counted in shared memory that every child maps
 * (the parent's anonymous mapping, kept across graceful restarts). The control file's stage
 * section (os_table.h, written by the sidecar from a blind policy) says, for each observation of
 * those counts, how many waiting requests of each stage start. A decision (an epoch) is taken at
 * every arrival, completion and table change, under the one lock (op_stage.h): it looks the
 * counts up and moves the queues' heads past the tickets that start (or, once a queue has stood
 * longer than OvertakeStageLifoAfter, starts its newest tickets out of turn), waking them
 * (FUTEX_WAKE_BITSET on the queue's wake word, one bit per ticket modulo 32, so a wake-up rarely
 * reaches a request that must go on waiting). With no table in force for a stage (no control file, none valid, no stage
 * section, or a stage the table does not name), its requests start at once.
 *
 * Like the sidecar's limiter, a table that starts nothing while nothing runs would idle the server
 * with requests waiting: then one request of the last stage with waiters starts (the oldest, or
 * the newest while its queue stands; a guard start, counted).
 */
#include "mod_overtake_prio.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "op_stage.h"

/* the mapping's layout: a graceful restart into a module of another layout (an upgrade) must not
 * reuse the old one (v3: the fast word; v4: the children's blocks and the tickets' owners; v5: the
 * dropped count; v6: the wake word and the starts out of turn) */
#define OS_RETAINED_KEY "mod_overtake_prio_stages_v6"

os_shared *os_shm;
int os_follow_on;
os_tab os_tab_now = {NULL, 0, {0}, {0}, {0}, 0};

/* ------------------------------------------------------------------------ the futex */

/* Wake the granted tickets' waiters. Most grants go to the request that is deciding at its own
 * arrival, which sleeps on nothing: a FUTEX_WAKE (a system call on a shared word) is made only
 * when some request may sleep. The wake word's store (every grant makes one) and this load are
 * sequentially consistent, as are a waiter's count and its load of the wake word before it looks
 * at its ticket (hold): either the waiter sees its grant, or this sees the waiter; FUTEX_WAIT
 * compares the wake word again in the kernel. (The head cannot be that word: a start out of
 * turn does not move it.) */
static void os_wake(os_stage *s, uint32_t bits)
{
    if (bits && __atomic_load_n(&s->sleepers, __ATOMIC_SEQ_CST)) {
        /* shared (not FUTEX_PRIVATE): waiters of every child share the mapping */
        syscall(SYS_futex, &s->q.wake, FUTEX_WAKE_BITSET, INT_MAX, NULL, NULL, bits);
        ADD(os_shm->wakes, 1);
    }
}

/* ------------------------------------------------------------------------ decisions */

/* A ticket of shared stage i was just enqueued (lock held): the queue's wait starts now if it was
 * empty (the clock is read only then). */
void os_waiting_from(int i)
{
    if (os_shm->st[i].q.waiting == 1) {
        os_shm->st[i].waiting_since = op_mono_ns();
    }
}

/* Whether stage i's starts go newest first now (lock held): its queue has stood, never empty,
 * longer than OvertakeStageLifoAfter. Which waiting request of a stage starts does not change
 * the counts a table decides by, so the model's mean response time is the same either way; but
 * once a queue stands, the oldest requests are those whose clients are about to give up, and
 * the newest can still be answered in time (adaptive LIFO). */
static int newest_first(int i)
{
    const os_stage *s = &os_shm->st[i];
    return os_shm->lifo_ns > 0 && s->q.waiting > 0 && op_mono_ns() - s->waiting_since > os_shm->lifo_ns;
}

/* Grant n starts in shared stage i (lock held) and wake them; how many started. */
int32_t os_start(int i, int32_t n)
{
    os_stage *s = &os_shm->st[i];
    uint32_t bits = 0;
    int32_t done;
    if (n < INT32_MAX && newest_first(i)) {
        done = os_grant_newest(&s->q, n, &bits);
        ADD(s->newest_first, (apr_uint64_t)done);
    }
    else {
        done = os_grant(&s->q, n, &bits);
    }
    if (bits) {
        __atomic_store_n(&s->q.wake, s->q.wake + 1, __ATOMIC_SEQ_CST);
    }
    os_wake(s, bits);
    return done;
}

/* The table's answer for the counts now (lock held, a table in force); how many it started. */
static int table_starts(void)
{
    int32_t w[OS_MAX_TSTAGES], k[OS_MAX_TSTAGES];
    uint8_t a[OS_MAX_TSTAGES];
    const os_tab *tab = &os_tab_now;
    uint32_t i;
    int started = 0;
    for (i = 0; i < tab->t.n; i++) {
        int s = tab->shm_of[i];
        w[i] = s < 0 ? 0 : os_shm->st[s].q.waiting;
        k[i] = s < 0 ? 0 : os_shm->st[s].q.active;
    }
    os_lookup(&tab->t, w, k, a);
    for (i = 0; i < tab->t.n; i++) {
        if (a[i] && tab->shm_of[i] >= 0) {
            started += os_start(tab->shm_of[i], a[i]);
        }
    }
    return started;
}

/* A decision epoch (lock held): what the table says for the counts now. */
void os_epoch(void)
{
    uint32_t n = os_shm->nstages, i;
    int32_t running = 0;
    int started = 0;
    ADD(os_shm->epochs, 1);
    if (os_shm->nres) {
        os_res_expire(op_mono_ns());  /* an expired reservation's slot is free for this decision */
    }
    for (i = 0; i < n; i++) {
        if (!os_tab_now.generation || os_tab_now.in_table[i] < 0) {
            os_start((int)i, INT32_MAX);  /* no table for this stage: nothing waits */
        }
    }
    if (os_tab_now.generation) {
        started = table_starts();
    }
    for (i = 0; i < n; i++) {
        running += os_shm->st[i].q.active;
    }
    if (!started && !running) {
        for (i = n; i-- > 0;) {
            if (os_shm->st[i].q.waiting > 0 && os_start((int)i, 1)) {
                ADD(os_shm->guard_starts, 1);
                break;
            }
        }
    }
}

/* Where the checked table t's stages are among the configured ones (lock held). */
static void tab_map(const os_table *t)
{
    uint32_t i, j;
    for (i = 0; i < OS_MAX_STAGES; i++) {
        os_tab_now.in_table[i] = -1;
    }
    for (j = 0; j < t->n; j++) {
        os_tab_now.shm_of[j] = -1;
        for (i = 0; i < os_shm->nstages; i++) {
            if (!strncmp(os_shm->names[i], t->name[j], OS_NAME_BYTES)) {
                os_tab_now.shm_of[j] = (int)i;
                os_tab_now.in_table[i] = (int)j;
            }
        }
    }
}

/* The two buffers a child's table is copied into, in turn (the one not in force takes the next):
 * mapped at the first table, never unmapped, as a lock-free reader (op_stage_fast.c) may still
 * load from the one a swap just left; pages are committed only where a table was written. */
static uint8_t *tab_buf[2];

static uint8_t *spare_buffer(void)
{
    int i;
    if (!tab_buf[0]) {
        for (i = 0; i < 2; i++) {
            void *m = mmap(NULL, OS_MAX_BYTES, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (m == MAP_FAILED) {
                return NULL;  /* no table: its stages run at once */
            }
            tab_buf[i] = m;
        }
    }
    return os_tab_now.bytes == tab_buf[0] ? tab_buf[1] : tab_buf[0];
}

/* The control file's stage section of generation gen is in force in this child (NULL: none). */
void op_stage_table(const uint8_t *section, size_t n, uint32_t gen)
{
    os_tab *tab = &os_tab_now;
    uint8_t *copy = NULL;
    os_table t;
    if (!os_shm) {
        return;
    }
    /* the one writer reads what it wrote without the lock */
    if ((gen && gen == tab->generation && section && tab->bytes && n == tab->len
         && !memcmp(tab->bytes, section, n)) || (!section && !tab->generation && !gen)) {
        return;  /* the table in force (a look at an unchanged file) */
    }
    if (section && (n > OS_MAX_BYTES || !(copy = spare_buffer())
                    || (memcpy(copy, section, n), os_check(copy, n, &t) != OS_OK))) {
        copy = NULL;  /* checked by oc_check already: only a mapping fails here */
    }
    os_fast_tab_begin();
    os_lock();
    tab->bytes = copy;
    tab->len = copy ? n : 0;
    tab->generation = copy ? gen : 0;
    if (copy) {
        tab->t = t;
        tab_map(&t);
    }
    os_epoch();  /* requests held under the old table get the new one's answer now */
    os_unlock();
    os_fast_tab_end();
}

/* ------------------------------------------------------------------------ the shared mapping */

/* Whether mapping m counts exactly this config's stages, in its order. A stage's position is its
 * number in every child, and the stage count bounds every child's decisions: a child of the
 * previous generation, still finishing its requests, must find the stages it was forked with. */
static int same_stages(const os_shared *m)
{
    int i;
    if (m->nstages != (uint32_t)os_nnames) {
        return 0;
    }
    for (i = 0; i < os_nnames; i++) {
        if (strncmp(m->names[i], os_names[i], OS_NAME_BYTES)) {
            return 0;
        }
    }
    return 1;
}

static os_shared *new_map(server_rec *s)
{
    pthread_mutexattr_t ma;
    os_shared *m;
    int i;
    m = mmap(NULL, sizeof(os_shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) {
        ap_log_error(APLOG_MARK, APLOG_ERR, errno, s, APLOGNO(90302) "mod_overtake_prio: "
                     "cannot map the stage counts; OvertakeStage requests are not held");
        return NULL;
    }
    memset(m, 0, sizeof(os_shared));
    for (i = 0; i < OS_MAX_RES; i++) {
        m->res[i].stage = -1;
    }
    pthread_mutexattr_init(&ma);
    pthread_mutexattr_setpshared(&ma, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&ma, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(&m->mu, &ma);
    pthread_mutexattr_destroy(&ma);
    return m;
}

/* The mapping, created in the root parent and kept across restarts (NULL if it fails). A restart
 * whose stages differ (added, removed, renamed or reordered) gets a new one: the previous
 * generation's children keep theirs (inherited at their fork) and finish their held and running
 * requests under its counts and tickets, while the new children count afresh. Reusing it with
 * the stages moved would have an old child end its request in another stage's queue (a count
 * left negative for good), leave its waiters holding tickets of a queue that was reset (they
 * wait out OvertakeStageHold), and have its decisions start a new stage's requests it has no
 * table for. */
static os_shared *shared_map(server_rec *s)
{
    os_shared **ret = ap_retained_data_get(OS_RETAINED_KEY);
    os_shared *m;
    if (!ret) {
        ret = ap_retained_data_create(OS_RETAINED_KEY, sizeof *ret);
        *ret = NULL;
    }
    if (*ret && same_stages(*ret)) {
        return *ret;
    }
    if (!(m = new_map(s))) {
        return NULL;
    }
    if (*ret) {
        ap_log_error(APLOG_MARK, APLOG_NOTICE, 0, s, APLOGNO(90305) "mod_overtake_prio: the "
                     "stages changed (added, removed, renamed or reordered): their counts start "
                     "afresh; the previous generation's requests end under the counts they "
                     "started with");
        munmap(*ret, sizeof(os_shared));  /* the parent's view only: old children keep theirs */
    }
    *ret = m;
    return m;
}

/* Root parent (post_config): the shared counts, with the stages of the config just read. */
void op_stage_prepare(server_rec *s)
{
    int i;
    if (!os_nnames || !(os_shm = shared_map(s))) {
        os_shm = NULL;
        return;
    }
    os_lock();
    /* the same stages as the mapping's (shared_map), or a new mapping's first */
    for (i = 0; i < os_nnames; i++) {
        memcpy(os_shm->names[i], os_names[i], OS_NAME_BYTES);
    }
    os_shm->nstages = (uint32_t)os_nnames;
    os_follow_on = 0;
    for (i = 0; i < OS_MAX_STAGES; i++) {
        os_shm->next[i] = i < os_nnames ? os_next[i] : -1;
        os_follow_on |= os_shm->next[i] >= 0;
    }
    os_shm->follow_ns = (int64_t)(os_follow_s * 1e9);
    os_shm->lifo_ns = (int64_t)(os_lifo_s * 1e9);
    os_unlock();
}
