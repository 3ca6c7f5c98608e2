/*
 * op_stage_fast.c -- module mode's arrival and end without the lock while nothing waits.
 *
 * Most requests find no request waiting in any stage: then an arrival's decision only asks the
 * table whether one more request of its stage may run at the running counts now, and an end
 * needs no decision at all (nothing waits to be started). Those two take one compare-and-swap on
 * a 64-bit word of the shared mapping that holds every stage's running count, instead of the
 * robust mutex and two decisions.
 *
 * The word: bit 63 set while the lock owns the counts (a section runs, or something waits, or a
 * reservation is outstanding, or a count does not fit); bits 58..62 the stage count less one;
 * bits 0..57 the stages' running counts, 58 / stages bits each. Its layout travels in the word,
 * so a swap never reads a count with another layout than the one it replaces.
 *
 * The lock takes the word over at each section's start (os_fast_own: one atomic OR, after which
 * every swap fails) and hands it back at its end only when nothing waits (os_fast_publish):
 * a waiting request is therefore only ever started by a locked decision, as before. A child that
 * dies inside a section leaves the word owned: the queues' counts stay the truth. A child that
 * crashes while its requests run has them given back by the parent (op_stage_child.c), which
 * takes the word over as any section does.
 *
 * The table a child decides by is its own copy, swapped by op_stage_table under a sequence count
 * (of_view.seq, odd while a swap is under way): a lock-free reader takes the count before it looks and
 * compares it after, and takes the locked path if it moved. A reader thus writes nothing shared
 * (an announced reader count cost each arrival two locked operations). A swap writes the section
 * into the one of two buffers that is not in force, and neither is ever unmapped
 * (op_stage_decide.c): a reader that raced a swap may read stale bytes, within bounds, and its
 * answer is thrown away.
 */
#include "mod_overtake_prio.h"

#include "op_stage.h"

#define OF_OWNED (UINT64_C(1) << 63)
#define OF_NSHIFT 58
#define OF_BITS 58u
#define OF_TRIES 4

/* A table stage as an arrival's look reads it. */
typedef struct {
    uint32_t kcap, kstride, wcap, wstride;
    int32_t shm;                    /* its shared stage, or -1 (not configured) */
} of_tstage;

/* What an arrival's look at this child's table reads, packed so that a one-stage table's look
 * touches one cache line (os_tab_now spreads it over several, each cold again after another
 * process had the core): copied from os_tab_now by the swap, under the sequence count. Never
 * shared between processes. */
static struct {
    unsigned seq;                   /* odd while a swap is under way */
    uint32_t n;                     /* the table's stages; 0: no table in force */
    const uint8_t *act;
    int8_t in_table[OS_MAX_STAGES]; /* shared stage -> table stage, or -1 (it runs at once) */
    of_tstage st[OS_MAX_TSTAGES];
} of_view __attribute__((aligned(64)));

/* Each count's width for 1..32 stages: a table, not a division (a few dozen cycles) at every
 * arrival and end. */
#define OF_W(n) (OF_BITS / (n))
static const uint8_t of_widths[33] = {
    0, OF_W(1), OF_W(2), OF_W(3), OF_W(4), OF_W(5), OF_W(6), OF_W(7), OF_W(8), OF_W(9), OF_W(10),
    OF_W(11), OF_W(12), OF_W(13), OF_W(14), OF_W(15), OF_W(16), OF_W(17), OF_W(18), OF_W(19),
    OF_W(20), OF_W(21), OF_W(22), OF_W(23), OF_W(24), OF_W(25), OF_W(26), OF_W(27), OF_W(28),
    OF_W(29), OF_W(30), OF_W(31), OF_W(32)};

static inline uint32_t of_n(uint64_t w) { return (uint32_t)(w >> OF_NSHIFT & 31) + 1; }
static inline uint32_t of_width(uint32_t n) { return of_widths[n]; }
static inline uint64_t of_max(uint32_t b) { return (UINT64_C(1) << b) - 1; }
static inline uint64_t of_count(uint64_t w, uint32_t i, uint32_t b) { return w >> (i * b) & of_max(b); }

/* Section start (lock held): the lock owns the counts; if the word had them, they are copied. */
void os_fast_own(void)
{
    uint64_t w = __atomic_fetch_or(&os_shm->fast, OF_OWNED, __ATOMIC_SEQ_CST);
    uint32_t n, b, i;
    if (w & OF_OWNED) {
        return;  /* the queues' counts are the truth already */
    }
    n = of_n(w);
    b = of_width(n);
    for (i = 0; i < n && i < OS_MAX_STAGES; i++) {
        os_shm->st[i].q.active = (int32_t)of_count(w, i, b);
    }
}

/* Section end (lock held): the counts back to the word if nothing waits and they fit. */
void os_fast_publish(void)
{
    uint32_t n = os_shm->nstages, b, i;
    uint64_t w;
    if (n == 0 || n > OS_MAX_STAGES || os_shm->nres) {
        return;
    }
    b = of_width(n);
    w = (uint64_t)(n - 1) << OF_NSHIFT;
    for (i = 0; i < n; i++) {
        const os_queue *q = &os_shm->st[i].q;
        if (q->waiting || q->active < 0 || (uint64_t)q->active >= of_max(b)) {
            return;
        }
        w |= (uint64_t)q->active << (i * b);
    }
    __atomic_store_n(&os_shm->fast, w, __ATOMIC_SEQ_CST);
}

/* Would the locked decision start stage s's one arrival at the running counts of w (nothing
 * else waits)? table_starts' lookup (op_stage_decide.c, os_lookup) with w_s = 1, the other
 * waiting counts 0, computed for the one cell it reads. */
static int may_start(uint64_t w, int s, uint32_t n, uint32_t b)
{
    const uint8_t *act = of_view.act;
    uint32_t i, cell = 0, tn = of_view.n;
    size_t at;
    int ts;
    if (!tn || (ts = of_view.in_table[s]) < 0) {
        return 1;  /* no table for the stage: it runs at once */
    }
    /* a swap may be under way (the count tells after): every index stays within the arrays and
     * the buffer, whatever mix of two tables this reads */
    if (!act || tn > OS_MAX_TSTAGES || ts >= OS_MAX_TSTAGES) {
        return 0;
    }
    for (i = 0; i < tn; i++) {
        const of_tstage *e = &of_view.st[i];
        uint64_t k = e->shm < 0 || (uint32_t)e->shm >= n ? 0 : of_count(w, (uint32_t)e->shm, b);
        if (k > e->kcap) {
            return 0;  /* beyond a running cap the table starts nothing */
        }
        cell += e->kstride * (uint32_t)k;
    }
    if (of_view.st[ts].wcap) {
        cell += of_view.st[ts].wstride;
    }
    at = (size_t)cell * tn + (uint32_t)ts;
    return at < (size_t)OS_MAX_CELLS * OS_MAX_TSTAGES && act[at] > 0;
}

/* An arrival of stage s: 1 if it was counted running without the lock, 0 if it must take the
 * locked path (something waits, the table holds it, a swap or a table change raced). */
OP_HOT int os_fast_arrive(int s)
{
    uint64_t w = __atomic_load_n(&os_shm->fast, __ATOMIC_ACQUIRE);
    int tries, ok;
    for (tries = 0; tries < OF_TRIES; tries++) {
        uint32_t n = of_n(w), b = of_width(n);
        unsigned q;
        if ((w & OF_OWNED) || (uint32_t)s >= n || of_count(w, (uint32_t)s, b) + 1 >= of_max(b)) {
            return 0;
        }
        q = __atomic_load_n(&of_view.seq, __ATOMIC_ACQUIRE);
        ok = !(q & 1) && may_start(w, s, n, b);
        /* the table's loads before the second look at the count */
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (!ok || __atomic_load_n(&of_view.seq, __ATOMIC_RELAXED) != q) {
            return 0;
        }
        if (__atomic_compare_exchange_n(&os_shm->fast, &w, w + (UINT64_C(1) << (s * b)), 0,
                                        __ATOMIC_SEQ_CST, __ATOMIC_ACQUIRE)) {
            return 1;
        }
    }
    return 0;
}

/* An end of stage s: 1 if it was counted without the lock (nothing waits: no decision to take),
 * 0 if it must take the locked path. */
OP_HOT int os_fast_complete(int s)
{
    uint64_t w = __atomic_load_n(&os_shm->fast, __ATOMIC_ACQUIRE);
    int tries;
    for (tries = 0; tries < OF_TRIES; tries++) {
        uint32_t n = of_n(w), b = of_width(n);
        if ((w & OF_OWNED) || (uint32_t)s >= n || of_count(w, (uint32_t)s, b) == 0) {
            return 0;
        }
        if (__atomic_compare_exchange_n(&os_shm->fast, &w, w - (UINT64_C(1) << (s * b)), 0,
                                        __ATOMIC_SEQ_CST, __ATOMIC_ACQUIRE)) {
            return 1;
        }
    }
    return 0;
}

/* op_stage_table is about to rewrite this child's table (its one writer): the count goes odd
 * before any of the table's stores, and even again after the last (the seqlock writer of Boehm,
 * "Can seqlocks get along with programming language memory models?"). */
void os_fast_tab_begin(void)
{
    __atomic_store_n(&of_view.seq, of_view.seq + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
}

/* ... and it is written: the arrivals' copy of it, then the even count. */
void os_fast_tab_end(void)
{
    const os_tab *tab = &os_tab_now;
    uint32_t i;
    of_view.n = tab->generation ? tab->t.n : 0;
    of_view.act = tab->t.act;
    for (i = 0; i < OS_MAX_STAGES; i++) {
        of_view.in_table[i] = (int8_t)tab->in_table[i];
    }
    for (i = 0; i < of_view.n && i < OS_MAX_TSTAGES; i++) {
        of_view.st[i].kcap = tab->t.kcap[i];
        of_view.st[i].kstride = tab->t.kstride[i];
        of_view.st[i].wcap = tab->t.wcap[i];
        of_view.st[i].wstride = tab->t.wstride[i];
        of_view.st[i].shm = tab->shm_of[i];
    }
    __atomic_store_n(&of_view.seq, of_view.seq + 1, __ATOMIC_RELEASE);
}
