/*
 * op_guard_pure.h -- the parts of the priority-inversion guard (op_guard.c) that need no Apache:
 * the words of its directives, which requests are exempt, and when a demoted request gets its
 * priority back. Plain C on libc only, checked with gcc alone
 * (tests/controller/harness/test_mod_guard_pure.py).
 *
 * Why a guard: a demoted request that holds a lock (a database write lock, a session file) makes
 * every request waiting for that lock wait for the demoted one, however high their own priority
 * (priority inversion). Requests that may take such a lock are exempt (never demoted), and a
 * demoted request can be given its priority back after a bounded time below it.
 */
#ifndef OP_GUARD_PURE_H
#define OP_GUARD_PURE_H

#include <stdint.h>

#pragma GCC visibility push(hidden)  /* only the module record is Apache's to see */

#define OP_GUARD_LIMIT_MAX 3600.0   /* seconds: the largest OvertakePrioDemotionLimit */

/* A word of OvertakePrioExemptMethods: */
typedef enum {
    OPG_WORD_BAD = 0,           /* not an HTTP method token in upper case */
    OPG_WORD_METHOD,            /* a method, e.g. POST */
    OPG_WORD_UNSAFE             /* 'unsafe': every method but GET and HEAD */
} op_guard_word;

op_guard_word op_guard_method_word(const char *w);

/* A request of `method` is exempt: unsafe is set and the method is neither GET nor HEAD, or the
 * method is one of names[0..n). */
int op_guard_method_exempt(int unsafe, const char *const *names, int n, const char *method);

/* A word of OvertakePrioExemptPath: an absolute URL path without blanks or a query. */
int op_guard_path_ok(const char *w);

/* `path` is under `prefix`: equal to it, or continuing it after a '/' (the prefix's last
 * character or the next one of path): /api matches /api and /api/x, not /apix. */
int op_guard_path_match(const char *prefix, const char *path);

/* When the monitor must look at a request again under OvertakePrioDemotionLimit: the earlier of
 * `due` (its next threshold) and since + limit, where `since` is when it first went below its
 * original priority; at or past that end, *release is set (give it its priority back) and
 * INT64_MAX returned. limit 0: no bound, `due` unchanged. */
static inline int64_t op_guard_due(int64_t now, int64_t since, int64_t limit, int64_t due,
                                   int *release)
{
    int64_t end;
    *release = 0;
    if (limit <= 0) {
        return due;
    }
    end = since > INT64_MAX - limit ? INT64_MAX : since + limit;
    if (now >= end) {
        *release = 1;
        return INT64_MAX;
    }
    return end < due ? end : due;
}

#pragma GCC visibility pop

#endif
