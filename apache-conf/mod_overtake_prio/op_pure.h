/*
 * op_pure.h -- the parts of mod_overtake_prio that need no Apache: the values of its
 * directives, the request headers it reads, and the arithmetic of the priority levels.
 *
 * Plain C on libc only, so that they are compiled with gcc and checked on known answers without
 * a server (tests/controller/harness/test_mod_pure.py). The level arithmetic runs on every
 * request and every monitor pass: it is inline here rather than in op_pure.c.
 */
#ifndef OP_PURE_H
#define OP_PURE_H

#include <stdint.h>

#pragma GCC visibility push(hidden)  /* only the module record is Apache's to see */

#define OP_MAX_LEVELS 8         /* demoted levels 1..OP_MAX_LEVELS; level 0 = original */
#define OP_NICE_IDLE 100        /* marker in a nice list: SCHED_IDLE */
#define OP_THRESHOLD_MAX 3600.0 /* seconds: the largest threshold OvertakePrioLevels takes */
#define OG_GEN_MASK 0x3fffffffu /* a gate slot's generation: the word's upper 30 bits */
#define OG_MAC_BYTES 16         /* of the gate header's MAC: HMAC-SHA256 truncated to 128 bits */

/* A per-level directive's words: why they are refused; *bad names the word. */
typedef enum {
    OP_PARSE_OK = 0,
    OP_PARSE_EMPTY,             /* no word */
    OP_PARSE_TOO_MANY,          /* more than OP_MAX_LEVELS words */
    OP_PARSE_RANGE,             /* not a number, trailing characters, or out of range */
    OP_PARSE_ORDER,             /* thresholds: not > 0 and increasing; nice: rises in priority */
    OP_PARSE_IDLE_NOT_LAST      /* nice: a level after 'idle' */
} op_parse_status;

/* w is a number in [lo, hi] and nothing else: 1 and *out set, else 0 (*out untouched). */
int op_parse_seconds(const char *w, double lo, double hi, double *out);
/* w is a decimal integer in [lo, hi] and nothing else: 1 and *out set, else 0. */
int op_parse_long(const char *w, long lo, long hi, long *out);

/* OvertakePrioLevels: n thresholds in seconds, in (0, OP_THRESHOLD_MAX] and strictly increasing,
 * into thr[]. */
op_parse_status op_parse_levels(const char *const *w, int n, double thr[OP_MAX_LEVELS], int *bad);
/* OvertakePrioNice: n increments in 1..19, non-decreasing, or 'idle' (OP_NICE_IDLE) last, into
 * nice[]. On OP_PARSE_ORDER, nice[*bad] holds the refused increment. */
op_parse_status op_parse_nice(const char *const *w, int n, int nice[OP_MAX_LEVELS], int *bad);

/* The class header: a level in 0..nlevels (blanks after it allowed). */
int op_parse_class(const char *h, int nlevels, int *out);
/* The gate header, "SLOT GENERATION MAC": two decimal numbers (the generation at most
 * OG_GEN_MASK) and 2 * OG_MAC_BYTES hex digits, one space apart. */
int op_parse_gate(const char *h, unsigned long *slot, unsigned long *gen,
                  uint8_t mac[OG_MAC_BYTES]);

/* The nice value of a thread of nice orig at a level of increment inc (at most 19), or
 * OP_NICE_IDLE. */
static inline int op_level_nice(int orig, int inc)
{
    if (inc == OP_NICE_IDLE) {
        return OP_NICE_IDLE;
    }
    return orig + inc > 19 ? 19 : orig + inc;
}

/* The level of a request at level `from` that has attained cpu ns of thread CPU: past every
 * threshold (ns, increasing) it has crossed; a request never goes back up by age. */
static inline int op_level_for(int64_t cpu, int from, const int64_t *thr, int n)
{
    int k = from;
    while (k < n && cpu >= thr[k]) {
        k++;
    }
    return k;
}

/* The monotonic time before which a request at `level` that had attained cpu ns at now cannot
 * cross its next threshold (thread CPU grows no faster than wall time); INT64_MAX at the last
 * level, and where the sum would overflow. */
static inline int64_t op_next_due(int64_t now, int64_t cpu, int level, const int64_t *thr,
                                  int n)
{
    int64_t left;
    if (level >= n) {
        return INT64_MAX;
    }
    left = thr[level] - cpu;
    return left > 0 && now > INT64_MAX - left ? INT64_MAX : now + left;
}

/* When the monitor wakes next: at the soonest due time, no later than horizon from now (a
 * request that starts later cannot cross sooner) and no sooner than period from now. */
static inline int64_t op_next_wake(int64_t now, int64_t soonest, int64_t horizon,
                                   int64_t period)
{
    int64_t next = now + horizon < soonest ? now + horizon : soonest;
    return next < now + period ? now + period : next;
}

/* The histogram bucket of a delay of late ns: the first bound (seconds, increasing) it does not
 * exceed, n if it exceeds them all. */
static inline unsigned op_bucket(int64_t late, const double *le, unsigned n)
{
    unsigned b = 0;
    while (b < n && late > (int64_t)(le[b] * 1e9)) {
        b++;
    }
    return b;
}

#pragma GCC visibility pop

#endif
