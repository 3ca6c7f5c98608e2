/*
 * op_stage.h -- what the files of module mode's stages share (included after mod_overtake_prio.h):
 * the counts in shared memory, the table in force in this child, the configuration being read and
 * the functions one file offers the others.
 *
 *   op_stage_conf.c     which request is of which stage: OvertakeStage in a section,
 *                       OvertakeStagePrefix at server level, and the other stage directives
 *   op_stage_decide.c   the shared counts, their lock, and the decision the count table takes
 *   op_stage_follow.c   follow-up reservations (OvertakeStageNext)
 *   op_stage_fast.c     the arrival and end that take no lock while nothing waits
 *   op_stage.c          a request's arrival, hold and end
 *   op_stage_status.c   the stages' lines on the status page
 *
 * One lock (a process-shared, robust mutex in the shared mapping) orders every count change and
 * decision; its sections are a few loads and stores. The table a child uses is its own copy,
 * swapped under that lock when op_control.c puts a new generation in force: every decision holds
 * it already, so reading the table takes no second lock.
 */
#ifndef OP_STAGE_H
#define OP_STAGE_H

#include <errno.h>

#include "os_table.h"

#pragma GCC visibility push(hidden)

#define OS_MAX_STAGES 16            /* stage names per server */
#define OS_NONE (-1)                /* OvertakeStage none */
#define OS_UNSET (-2)
#define OS_MAX_RES 1024             /* reservations outstanding at once (one per connection) */
#define OS_MAX_CHILDREN 4096        /* children whose counts are given back if they crash */
#define OS_CLIENT_CLOSED 499        /* the status a dropped request is logged with (nginx's) */

/* How a reservation ended (overtake_stage_reservations_ended_total{outcome}). */
enum { OS_RES_CLAIMED, OS_RES_EXPIRED, OS_RES_CLOSED, OS_RES_OTHER, OS_RES_N };

/* Where a request's work ran, by the handler that served it (overtake_stage_served_total). */
enum { OS_BY_APACHE, OS_BY_FCGI, OS_BY_PROXY, OS_BY_CGI, OS_BY_N };

/* One stage's counts: the counters a request touches and its queue's head first, the queue's ring
 * (4 KiB) last, so that a request of stage 0 touches one page of the mapping (os_shared). */
typedef struct {
    uint32_t sleepers;              /* requests between their last look at q.head and their wake-up */
    apr_uint64_t requests;          /* arrivals */
    apr_uint64_t held;              /* requests that waited */
    apr_uint64_t hold_ns;           /* ... and their total wait */
    apr_uint64_t hold_timeouts;     /* waited OvertakeStageHold and ran anyway */
    apr_uint64_t overflows;         /* found the queue's ticket ring full and ran at once */
    apr_uint64_t unheld;            /* ran at once because no table was in force for the stage */
    apr_uint64_t given_back;        /* counted by a child that died without ending them */
    apr_uint64_t dropped;           /* held, then dropped: their client went away */
    apr_uint64_t newest_first;      /* starts given to the newest waiting request (OvertakeStageLifoAfter) */
    int64_t waiting_since;          /* when the queue last went from empty to waiting */
    apr_uint64_t served[OS_BY_N];   /* ended, by where their work ran */
    apr_uint64_t reservations;      /* follow-up reservations made in this stage */
    apr_uint64_t res_full;          /* ... not made: every reservation slot was in use */
    apr_uint64_t res_ended[OS_RES_N];
    int32_t reserved;               /* reservations outstanding (each holds a ticket) */
    os_queue q;
} os_stage;

/* A connection's reservation: a ticket of its stage's queue, kept for the connection's next
 * request until expires_ns. Slots are reused: gen tells a connection's slot from its reuse. */
typedef struct {
    int32_t stage;                  /* -1: free */
    uint32_t ticket;
    uint32_t gen;
    int64_t expires_ns;
} os_res;

/* A child's share of the counts (op_stage_child.c): pid 0 is a free block. Written by its own
 * child's threads, read by the parent once the child is gone; a cache line or two each. */
typedef struct {
    int32_t pid;
    int32_t active[OS_MAX_STAGES];  /* its requests of each stage counted running */
} __attribute__((aligned(64))) os_child;

typedef struct {
    uint64_t fast __attribute__((aligned(64)));  /* the running counts while unlocked (op_stage_fast.c) */
    pthread_mutex_t mu __attribute__((aligned(64)));
    uint32_t nstages;
    int32_t next[OS_MAX_STAGES];    /* OvertakeStageNext: the stage a follow-up reserves, or -1 */
    char names[OS_MAX_STAGES][OS_NAME_BYTES];
    apr_uint64_t epochs;            /* decisions taken */
    apr_uint64_t guard_starts;
    apr_uint64_t wakes;             /* futex wake-ups issued (a system call each) */
    os_stage st[OS_MAX_STAGES];
    int64_t follow_ns;              /* OvertakeStageFollowUp */
    int64_t lifo_ns;                /* OvertakeStageLifoAfter (0: never newest first) */
    uint32_t nres;                  /* reservations outstanding, all stages */
    uint32_t res_hi;                /* slots [0, res_hi) may be in use */
    int64_t res_due;                /* no reservation expires before this */
    os_res res[OS_MAX_RES];
    uint32_t repairs;               /* a dead child's counts were given back (op_stage_child.c) */
    os_child child[OS_MAX_CHILDREN];
} os_shared;

/* This child's table: a copy of the control file's stage section, and where its stages are.
 * Written only by op_stage_table (op_control.c calls it under its own mutex: one writer at a time)
 * while it holds os_shm->mu; read under os_shm->mu. */
typedef struct {
    uint8_t *bytes;                 /* owns the section's bytes (t.act points into them) */
    size_t len;
    os_table t;
    int shm_of[OS_MAX_TSTAGES];     /* table stage -> shared stage, or -1 (not configured) */
    int in_table[OS_MAX_STAGES];    /* shared stage -> table stage, or -1 (run at once) */
    uint32_t generation;            /* 0: no table */
} os_tab;

/* A connection's hold on a reservation slot (on its pool; slot -1: none). */
typedef struct {
    int slot;
    uint32_t gen;
} os_conn;

/* op_stage_decide.c */
extern os_shared *os_shm;           /* NULL: no stage configured, or no mapping */
extern os_tab os_tab_now;
extern int os_follow_on;            /* some stage has a next stage (OvertakeStageNext) */

/* op_stage_fast.c: the lock-free arrival and end while nothing waits */
void os_fast_own(void);
void os_fast_publish(void);
int os_fast_arrive(int s);
int os_fast_complete(int s);
void os_fast_tab_begin(void);
void os_fast_tab_end(void);

/* The stages' lock (in every file: a request takes it when something waits). Under it the
 * queues' running counts are the truth (os_fast_own takes them over from the word), unlocked the
 * word is (os_fast_publish hands them back when nothing waits). */
static inline void os_lock(void)
{
    if (pthread_mutex_lock(&os_shm->mu) == EOWNERDEAD) {
        /* a child died inside a section: every section leaves the counts whole at each store
         * (the word stays owned by the lock: the queues' counts are the truth) */
        pthread_mutex_consistent(&os_shm->mu);
    }
    os_fast_own();
}

static inline void os_unlock(void)
{
    os_fast_publish();
    pthread_mutex_unlock(&os_shm->mu);
}

/* op_stage_child.c: this child's block (-1: none) and its running counts */
extern int os_me;
int op_stage_child_blocks(void);

static inline void os_mine(int stage, int32_t d)
{
    if (os_me >= 0) {
        __atomic_fetch_add(&os_shm->child[os_me].active[stage], d, __ATOMIC_RELAXED);
    }
}

/* A waiter of ticket t counts itself running: the ticket no longer names its child (the
 * exchange leaves a newer ticket's owner alone, if the ring came round meanwhile). */
static inline void os_taken(os_queue *q, uint32_t t)
{
    uint16_t me = (uint16_t)(os_me + 1);
    __atomic_compare_exchange_n(&q->owner[t % OS_RING], &me, 0, 0, __ATOMIC_RELAXED,
                                __ATOMIC_RELAXED);
}

int32_t os_start(int i, int32_t n);
void os_waiting_from(int i);
void os_epoch(void);

/* op_stage_conf.c: the configuration read last (reset by pre_config: Apache reads it twice) */
extern char os_names[OS_MAX_STAGES][OS_NAME_BYTES];
extern int os_nnames;
extern int os_next[OS_MAX_STAGES];
extern double os_hold_s;
extern double os_follow_s;
extern int os_abort_on_close;
extern double os_lifo_s;
int os_stage_of(const request_rec *r);

/* op_stage_follow.c */
void os_res_free(uint32_t i, int outcome);
void os_res_end(uint32_t i, int outcome);
int os_res_expire(int64_t now);
int os_res_take(os_conn *oc);
int os_res_make(os_conn *oc, int stage, int64_t now);
os_conn *os_conn_state(conn_rec *c, int create);

#pragma GCC visibility pop

#endif
