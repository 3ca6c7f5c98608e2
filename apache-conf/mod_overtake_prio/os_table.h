/*
 * os_table.h -- the count table of the control file's stage section: for every observation of
 * per-stage counts (requests waiting, requests running) within the table's caps, how many
 * waiting requests of each stage may start. A blind policy (one that sees counts, not phases:
 * van der Weij, Bhulai and van der Mei, "Dynamic thread assignment in web server performance
 * optimization") is exactly such a table; the sidecar writes it (controller/sidecar/count_table.py)
 * and op_stage.c enforces it inside Apache.
 *
 * Plain C on libc, so that the check and the lookup run on known answers without a server
 * (tests/controller/harness/test_mod_stage_table.py).
 *
 * Section layout (version 1), little-endian, after the control file's rows:
 *   0  u32 n            stages of the table, 1..OS_MAX_TSTAGES
 *   4  u32 reserved     (0)
 *   8  n entries of OS_STAGE_BYTES:
 *        char name[OS_NAME_BYTES]   the OvertakeStage name, 1..31 bytes of [A-Za-z0-9_.-],
 *                                   NUL-padded; unique
 *        u32 wcap                   waiting counts the table shows, 0..OS_MAX_CAP
 *        u32 kcap                   running counts the table shows, 0..OS_MAX_CAP
 *   then one cell per observation (w_1..w_n, k_1..k_n), w_i in 0..wcap_i, k_i in 0..kcap_i, in
 *   row-major order (k_n varies fastest); a cell is n bytes, a_i = requests of stage i to start,
 *   at most w_i.
 *
 * Outside the caps (the conservative default, os_lookup): a waiting count above its cap reads as
 * the cap (more queued requests than the table shows start as if the queue were at the cap, and
 * never more than are waiting); a running count above its cap starts nothing anywhere (the table
 * never runs more than it shows; requests past their hold bound can get there).
 */
#ifndef OS_TABLE_H
#define OS_TABLE_H

#include <stdint.h>
#include <string.h>

#define OS_MAX_TSTAGES 8
#define OS_NAME_BYTES 32
#define OS_STAGE_BYTES (OS_NAME_BYTES + 8)
#define OS_HEAD_BYTES 8
#define OS_MAX_CAP 255
#define OS_MAX_CELLS (1u << 20)
#define OS_MAX_BYTES (OS_HEAD_BYTES + OS_MAX_TSTAGES * OS_STAGE_BYTES \
                      + (uint64_t)OS_MAX_CELLS * OS_MAX_TSTAGES)

typedef struct {
    uint32_t n;
    char name[OS_MAX_TSTAGES][OS_NAME_BYTES];
    uint32_t wcap[OS_MAX_TSTAGES], kcap[OS_MAX_TSTAGES];
    uint32_t wstride[OS_MAX_TSTAGES], kstride[OS_MAX_TSTAGES];  /* in cells */
    uint32_t cells;
    const uint8_t *act;         /* cells * n bytes, into the checked bytes */
} os_table;

/* Why a section is refused (OS_OK: accepted). */
typedef enum {
    OS_OK = 0,
    OS_SHORT,        /* shorter than its head and stage entries */
    OS_STAGES,       /* n not in 1..OS_MAX_TSTAGES */
    OS_NAME,         /* a name empty, too long, not [A-Za-z0-9_.-], not NUL-padded, or repeated */
    OS_CAPS,         /* a cap above OS_MAX_CAP, or more than OS_MAX_CELLS cells */
    OS_SIZE,         /* the size is not the head, entries and cells */
    OS_ACTION,       /* a cell starts more requests of a stage than are waiting */
    OS_RESERVED      /* the reserved word is not 0 */
} os_status;

static inline const char *os_reason(os_status st)
{
    switch (st) {
    case OS_OK: return "accepted";
    case OS_SHORT: return "its stage section is shorter than its stage entries";
    case OS_STAGES: return "its stage section names no stage or more than the module takes";
    case OS_NAME: return "a stage name of its stage section is empty, too long, repeated or not "
                         "letters, digits, '_', '.', '-'";
    case OS_CAPS: return "a count cap of its stage section is too large";
    case OS_SIZE: return "its stage section's size does not match its caps";
    case OS_ACTION: return "a cell of its stage section starts more requests than are waiting";
    case OS_RESERVED: return "a reserved field of its stage section is set";
    }
    return "unknown";
}

static inline uint32_t os_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline int os_name_ok(const uint8_t *p)
{
    int i, len = 0;
    while (len < OS_NAME_BYTES && p[len]) {
        uint8_t ch = p[len];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9')
              || ch == '_' || ch == '.' || ch == '-')) {
            return 0;
        }
        len++;
    }
    if (len == 0 || len == OS_NAME_BYTES) {
        return 0;
    }
    for (i = len; i < OS_NAME_BYTES; i++) {
        if (p[i]) {
            return 0;  /* padding must be NUL: the MAC covers one spelling of a name */
        }
    }
    return 1;
}

/* Check the n bytes at b; on OS_OK fill *t (t->act points into b). */
static inline os_status os_check(const uint8_t *b, uint64_t n, os_table *t)
{
    uint64_t cells = 1;
    uint32_t i, j, c, stride;
    const uint8_t *act;
    if (n < OS_HEAD_BYTES) {
        return OS_SHORT;
    }
    t->n = os_u32(b);
    if (t->n < 1 || t->n > OS_MAX_TSTAGES) {
        return OS_STAGES;
    }
    if (os_u32(b + 4)) {
        return OS_RESERVED;
    }
    if (n < OS_HEAD_BYTES + (uint64_t)t->n * OS_STAGE_BYTES) {
        return OS_SHORT;
    }
    for (i = 0; i < t->n; i++) {
        const uint8_t *e = b + OS_HEAD_BYTES + (size_t)i * OS_STAGE_BYTES;
        if (!os_name_ok(e)) {
            return OS_NAME;
        }
        memcpy(t->name[i], e, OS_NAME_BYTES);
        for (j = 0; j < i; j++) {
            if (!strcmp(t->name[i], t->name[j])) {
                return OS_NAME;
            }
        }
        t->wcap[i] = os_u32(e + OS_NAME_BYTES);
        t->kcap[i] = os_u32(e + OS_NAME_BYTES + 4);
        if (t->wcap[i] > OS_MAX_CAP || t->kcap[i] > OS_MAX_CAP) {
            return OS_CAPS;
        }
        cells *= (uint64_t)(t->wcap[i] + 1) * (t->kcap[i] + 1);
        if (cells > OS_MAX_CELLS) {
            return OS_CAPS;
        }
    }
    if (n != OS_HEAD_BYTES + (uint64_t)t->n * OS_STAGE_BYTES + cells * t->n) {
        return OS_SIZE;
    }
    t->cells = (uint32_t)cells;
    /* strides: k_n fastest, then k_{n-1} .. k_1, then w_n .. w_1 */
    stride = 1;
    for (i = t->n; i-- > 0;) {
        t->kstride[i] = stride;
        stride *= t->kcap[i] + 1;
    }
    for (i = t->n; i-- > 0;) {
        t->wstride[i] = stride;
        stride *= t->wcap[i] + 1;
    }
    act = b + OS_HEAD_BYTES + (size_t)t->n * OS_STAGE_BYTES;
    for (c = 0; c < t->cells; c++) {
        for (i = 0; i < t->n; i++) {
            uint32_t w = c / t->wstride[i] % (t->wcap[i] + 1);
            if (act[(size_t)c * t->n + i] > w) {
                return OS_ACTION;
            }
        }
    }
    t->act = act;
    return OS_OK;
}

/* The requests of each stage to start (a[i]) when w[i] wait and k[i] run (the table's stage
 * order); the conservative default outside the caps (above). */
static inline void os_lookup(const os_table *t, const int32_t *w, const int32_t *k, uint8_t *a)
{
    uint32_t i, cell = 0;
    for (i = 0; i < t->n; i++) {
        if (k[i] < 0 || (uint32_t)k[i] > t->kcap[i] || w[i] < 0) {
            memset(a, 0, t->n);
            return;
        }
        cell += t->kstride[i] * (uint32_t)k[i];
        cell += t->wstride[i] * ((uint32_t)w[i] > t->wcap[i] ? t->wcap[i] : (uint32_t)w[i]);
    }
    memcpy(a, t->act + (size_t)cell * t->n, t->n);
}

/* Count arithmetic of one stage's queue (op_stage.c keeps these words in shared memory under its
 * lock): tickets are handed out at tail, the head passes them in order as starts are granted;
 * a ticket whose request stopped waiting (its hold bound passed) is skipped. The ring of `gone`
 * flags has OS_RING entries: at most that many tickets are outstanding. A start may also go to
 * the newest waiting ticket (os_grant_newest): it is marked `go`, and gone for the head. */
#define OS_RING 4096u

typedef struct {
    uint32_t head, tail;        /* tickets in [head, tail) wait or are gone */
    int32_t waiting, active;
    uint32_t wake;              /* the waiters' futex word: one more at every grant */
    uint8_t gone[OS_RING];
    uint8_t go[OS_RING];        /* started out of turn (newest first), the head not past it yet */
    uint16_t owner[OS_RING];    /* the waiting request's child block + 1 (0: none, or it runs) */
} os_queue;

/* A new request: 1 and its ticket, or 0 if the ring is full (it runs without waiting). */
static inline int os_enqueue(os_queue *q, uint32_t *ticket)
{
    if (q->tail - q->head >= OS_RING) {
        return 0;
    }
    *ticket = q->tail++;
    q->gone[*ticket % OS_RING] = 0;
    q->go[*ticket % OS_RING] = 0;
    q->owner[*ticket % OS_RING] = 0;
    q->waiting++;
    return 1;
}

/* Start up to n waiting requests, oldest first; returns how many, and ORs the futex bits of
 * their tickets (1 << ticket % 32) into *bits. */
static inline int32_t os_grant(os_queue *q, int32_t n, uint32_t *bits)
{
    int32_t done = 0;
    while (done < n && q->waiting > 0 && q->head != q->tail) {
        uint32_t t = q->head++;
        if (q->gone[t % OS_RING]) {
            q->gone[t % OS_RING] = 0;
            continue;
        }
        q->waiting--;
        q->active++;
        *bits |= 1u << (t & 31);
        done++;
    }
    return done;
}

/* Start up to n waiting requests, newest first; as os_grant. Each is marked gone (the head skips
 * it) and go (its waiter sees the start: os_started). The head then passes the gone tickets
 * before the oldest one still waiting: while starts go newest first, nothing else moves it, and
 * a head held back by tickets that left would fill the ring. */
static inline int32_t os_grant_newest(os_queue *q, int32_t n, uint32_t *bits)
{
    int32_t done = 0;
    uint32_t t = q->tail;
    while (done < n && q->waiting > 0 && t != q->head) {
        t--;
        if (q->gone[t % OS_RING]) {
            continue;
        }
        q->gone[t % OS_RING] = 1;
        __atomic_store_n(&q->go[t % OS_RING], 1, __ATOMIC_RELAXED);  /* published by the wake word */
        q->waiting--;
        q->active++;
        *bits |= 1u << (t & 31);
        done++;
    }
    while (q->head != q->tail && q->gone[q->head % OS_RING]) {
        q->gone[q->head % OS_RING] = 0;
        q->head++;
    }
    return done;
}

/* Has ticket t been granted in turn? (head moved past it) */
static inline int os_granted(uint32_t head, uint32_t t)
{
    return (int32_t)(head - t) > 0;
}

/* Has ticket t been started, in turn (head, as loaded by the caller) or out of turn? */
static inline int os_started(const os_queue *q, uint32_t head, uint32_t t)
{
    return os_granted(head, t) || __atomic_load_n(&q->go[t % OS_RING], __ATOMIC_RELAXED);
}

/* A waiter whose hold bound passed: 1 if it was granted meanwhile, else it leaves the queue and
 * runs (counted active) and 0 is returned. */
static inline int os_give_up(os_queue *q, uint32_t t)
{
    if (os_started(q, q->head, t)) {
        return 1;
    }
    q->gone[t % OS_RING] = 1;
    q->waiting--;
    q->active++;
    return 0;
}

/* A running request ended. */
static inline void os_complete(os_queue *q)
{
    if (q->active > 0) {
        q->active--;
    }
}

#endif
